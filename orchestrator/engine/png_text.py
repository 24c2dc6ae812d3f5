"""A PNG's text chunks, as the engine writes them. The engine's own is `anima` (this project's fields, JSON, under a
keyword no other tool uses); what other tools read (A1111's `parameters`, ComfyUI's `prompt` and `workflow`) is
written by the formats the way in that starts the daemon hands it (orchestrator.http.png_formats.PNG_FORMATS), so the
engine speaks no front's vocabulary. JSON is ASCII (as ComfyUI's SaveImage writes it), so each chunk is a plain tEXt
chunk every reader knows; the chunks go to the VAE in DECODE `metadata`."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.engine.report import LATENT_NOTE, LATENT_SPACE


@dataclass(frozen=True)
class LoaderFiles:
    """The model files a job's loaders name: the pack's checkpoint, the text encoder's and the VAE's (empty: not
    known here)."""

    unet: tuple[str, ...] = ()
    clip: tuple[str, ...] = ()
    vae: tuple[str, ...] = ()


@dataclass(frozen=True)
class ImageText:
    """What one image's text chunks are written from: the job's spec (orchestrator.engine.prompt_spec.PromptSpec), the pack
    that made it, the job id, the loaders' files (None: only the pack's own checkpoint is known), the API graph a
    ComfyUI client sent (kept as sent), the LoRAs' short hashes (name -> models.lora.choice's) and the image's place
    in a batch."""

    spec: object
    pack: object
    job: str
    files: LoaderFiles | None = None
    graph: dict | None = None
    lora_hashes: dict = field(default_factory=dict)
    batch_pos: int = 0

    @property
    def width(self) -> int:
        return self.spec.width or self.pack.width

    @property
    def height(self) -> int:
        return self.spec.height or self.pack.height


PngFormat = Callable[[ImageText], dict]       # one front's chunks: keyword -> text


def png_text(formats: Sequence[PngFormat], image: ImageText) -> dict[str, str]:
    """The image's text chunks: each format's in the order given, then the engine's `anima`."""
    chunks: dict[str, str] = {}
    for fmt in formats:
        chunks.update(fmt(image))
    chunks["anima"] = anima_chunk(image)
    return chunks


def anima_chunk(image: ImageText) -> str:
    """This project's own fields of the image's job (JSON)."""
    spec, pack = image.spec, image.pack
    own = {"job": image.job, "prompt": spec.prompt, "negative_prompt": spec.negative_prompt, "seed": spec.seed,
           "steps": spec.steps, "cfg": spec.cfg, "sampler": spec.sampler, "scheduler": spec.scheduler,
           "width": image.width, "height": image.height, "spectrum": spec.spectrum.to_dict(),
           **({"init_image": spec.init_image, "mask": spec.mask, "denoise": spec.denoise} if spec.init_image else {}),
           **({"denoise_steps": spec.denoise_steps} if spec.denoise_steps != "comfyui" else {}),
           **({"init_mix": spec.init_mix.to_dict()} if spec.init_mix is not None else {}),
           **({"mask_channel": spec.mask_channel} if spec.mask_channel else {}),
           **({"grow_mask_by": spec.grow_mask_by} if spec.grow_mask_by is not None else {}),
           **({"batch": spec.batch, "batch_index": image.batch_pos} if spec.batch > 1 else {}),
           **({"hires": spec.hires.to_dict()} if spec.hires is not None else {}),
           "model": pack.source_name, "model_sha256": pack.source_sha256,
           "latent_space": LATENT_SPACE, "latent_note": LATENT_NOTE,
           "loras": [{**c.to_dict(), "clip_strength": c.te_strength, "short_hash": image.lora_hashes.get(c.name)}
                     for c in spec.loras]}
    return json.dumps(own)
