"""A job's plan: one record per step, each naming the job-folder files it reads and writes (orchestrator.engine.job_files),
the stage it needs up and the job state it runs in. A step's inputs are earlier steps' outputs or the job's own inputs
(init_image.png, mask.png, kept at submit): the plan is a DAG, listed in an order that runs it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from orchestrator.engine.job_files import INIT_IMAGE_FILE, MASK_FILE, MIX_IMAGE_FILE

ENCODER, VAE, SCHEDULER = "encoder", "vae", "scheduler"       # the stage a step calls (the scheduler: the denoiser)
ENCODING, DENOISING, DECODING = "encoding", "denoising", "decoding"      # job states (orchestrator.engine.job_record.STAGES)
JOB_INPUTS = (INIT_IMAGE_FILE, MASK_FILE, MIX_IMAGE_FILE)     # in the job folder before any step runs


@dataclass(frozen=True)
class Step:
    """One step: `inputs` it reads and `outputs` it writes (job-folder names; a step whose outputs are all whole is
    done), `scratch` it keeps for its own resume only (the sampler's per-step state, the pixel path's first image)."""

    pos: int = 0                          # the batch image it is for (0: the first, or the whole job)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    scratch: tuple[str, ...] = ()
    stage: ClassVar[str | None] = None    # None: the daemon alone
    phase: ClassVar[str] = ""
    per_image: ClassVar[bool] = False     # one step per batch image (its name shows `pos`)

    @property
    def name(self) -> str:
        return f"{type(self).__name__}[{self.pos}]" if self.per_image else type(self).__name__


@dataclass(frozen=True)
class EncodeText(Step):
    """The prompts' contexts and token counts (the conditioning cache first); `hires`: the second pass's own;
    `entries`: the (positive, negative) conditioning operations (protocol.prompt.CondEntry; None: the text as it is).
    `mixed`: one context per distinct text of prompt.json's positive/negative entries that each take a model pass
    (protocol.prompt.mixes)."""
    hires: bool = False
    entries: tuple = (None, None)
    mixed: bool = False
    stage: ClassVar[str | None] = ENCODER
    phase: ClassVar[str] = ENCODING

    @property
    def name(self) -> str:
        if self.mixed:
            return "EncodeText[entries]"
        ops = [f"{side}:" + "+".join(op for op, on in (("zero_out", e.zero_out), ("average", e.average)) if on)
               for side, e in zip(("positive", "negative"), self.entries) if e is not None]
        return ("EncodeText[hires]" if self.hires else "EncodeText") + (f"[{' '.join(ops)}]" if ops else "")


@dataclass(frozen=True)
class EncodeImage(Step):
    """img2img: the kept init image (grey under the mask for VAEEncodeForInpaint) through the VAE encoder; `mix`:
    init_mix's other upload (mix_image.png)."""
    mix: bool = False
    stage: ClassVar[str | None] = VAE
    phase: ClassVar[str] = ENCODING

    @property
    def name(self) -> str:
        return "EncodeImage[mix]" if self.mix else "EncodeImage"


@dataclass(frozen=True)
class MixStart(Step):
    """init_mix: the two uploads' latents combined as ComfyUI's LatentComposite / LatentBlend before the first
    KSampler (the daemon alone, numpy) into the job's init latent, which every first pass starts from."""
    phase: ClassVar[str] = ENCODING


@dataclass(frozen=True)
class Denoise(Step):
    """Image `pos`'s first pass (a DENOISE of its own, its place in the seed's batch noise)."""
    per_image: ClassVar[bool] = True
    stage: ClassVar[str | None] = SCHEDULER
    phase: ClassVar[str] = DENOISING


@dataclass(frozen=True)
class MixLatent(Step):
    """Image `pos`'s pass latent and the init image's combined as ComfyUI's LatentComposite / LatentBlend (prompt.json's
    `latent_mix`; the daemon alone, numpy), the latent its Decode reads."""
    per_image: ClassVar[bool] = True
    phase: ClassVar[str] = DENOISING


@dataclass(frozen=True)
class PixelStart(Step):
    """The hires fix's pixel path for image `pos`: its first latent decoded, scaled, encoded again."""
    per_image: ClassVar[bool] = True
    stage: ClassVar[str | None] = VAE
    phase: ClassVar[str] = DENOISING


@dataclass(frozen=True)
class HiresDenoise(Step):
    """Image `pos`'s second pass on the hires pack, from its upscaled first latent or its pixel-path start."""
    per_image: ClassVar[bool] = True
    stage: ClassVar[str | None] = SCHEDULER
    phase: ClassVar[str] = DENOISING


@dataclass(frozen=True)
class Decode(Step):
    """Image `pos`'s final latent to its PNG (the VAE stage; the daemon writes it when the VAE is remote); `base`:
    its first pass's latent to base.png (hires.keep_base), inline (not the hires arena's size)."""
    base: bool = False
    per_image: ClassVar[bool] = True
    stage: ClassVar[str | None] = VAE
    phase: ClassVar[str] = DECODING

    @property
    def name(self) -> str:
        return f"Decode[base {self.pos}]" if self.base else f"Decode[{self.pos}]"


@dataclass(frozen=True)
class CropImage(Step):
    """Image `pos`'s decoded PNG cut as ComfyUI's ImageCrop (the daemon alone, after every image is decoded: the VAE
    comes up once for the batch), its metadata kept."""
    per_image: ClassVar[bool] = True
    phase: ClassVar[str] = DECODING


@dataclass(frozen=True)
class Deliver(Step):
    """Every image (and base image) copied to the prompt's `output` once all are decoded (outside the job folder:
    it always runs)."""
    phase: ClassVar[str] = DECODING


@dataclass(frozen=True)
class Report(Step):
    """The job's record last: report.json (what the stages measured, the images delivered, which of the plan's steps
    ran) and timing.png drawn from it. It reads the images it names; a resume skips it when both files are whole and
    no step that writes what it reads ran again."""
    phase: ClassVar[str] = DECODING


class PlanError(ValueError):
    """A plan that is not a DAG of its files: an input nothing earlier writes, or a file written twice."""


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]

    def __post_init__(self):
        made = set(JOB_INPUTS)
        for step in self.steps:
            missing = [f for f in step.inputs if f not in made]
            if missing:
                raise PlanError(f"{step.name} reads {missing}, which no earlier step writes")
            twice = made.intersection(step.outputs)
            if twice:
                raise PlanError(f"{step.name} writes {sorted(twice)} again")
            made.update(step.outputs)

    def producers(self, step: Step) -> tuple[Step, ...]:
        """The earlier steps whose outputs `step` reads."""
        return tuple(s for s in self.steps if set(s.outputs).intersection(step.inputs))

    def describe(self) -> list[str]:
        """One line per step: its state, its stage, its name, what it reads and what it writes."""
        return [f"{s.phase:<9} {s.stage or '-':<9} {s.name:<16} {' '.join(s.inputs) or '-'} -> "
                f"{' '.join(s.outputs) or '-'}" for s in self.steps]
