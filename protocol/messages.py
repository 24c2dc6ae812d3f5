"""Every message between Anima's processes: kinds, fields, limits and the conversation they form.

Wire: a ZeroMQ multipart. Frame 0 is a msgpack map `{"v": 1, "kind": KIND, "id": ID, ...fields}`; frames 1..n are raw
tensor bytes for descriptors with `where = {"frame": k}` (see protocol/tensors.py). Requests go client → stage through
a REQ (Lazy Pirate) socket to the stage's ROUTER; the reply carries the request's `id`. Events go stage → orchestrator
through PUSH → PULL (the orchestrator's `events` endpoint) and need no reply.

The conversation (→ request, ← its reply, ⇢ event):

  control, any client ↔ any stage
    → HELLO {peer, pid, version}                       ← READY {stage, pid, version, info}
    → HEARTBEAT {peer}                                 ← PONG {stage, pid, busy, job, uptime_s, rss_mb}
    → CANCEL {job}                                     ← OK
    → SHUTDOWN {reason}                                ← OK, then the stage exits 0
    any request that fails                             ← ERROR {code, message, field, retry}
    ⇢ DYING {stage, pid, reason, job}   a stage's last word before it exits non-zero (supervisord restarts it)
  orchestrator → encoder
    → ENCODE {job, prompt, negative, arena, cond, uncond, rows, loras, prompt_entry, negative_entry}
                                                       ← ENCODED {job, cond, uncond, tokens_*, truncated, timings}
  orchestrator → scheduler (minutes; heartbeats are answered between branches)
    → DENOISE {job, job_dir, pack_dir, arena, params, cond, uncond, latent, scratch, executor, resume, context_rows,
               loras, conds}
    ⇢ PROGRESS {job, step, steps, block, branch, cfg_pass, forecast, elapsed_s, eta_s}
                                                       ← DENOISED {job, latent, computed/forecast steps, sums, ...}
  scheduler → executor (one per branch call: both CFG passes, or with interleave one pass per call, the first with
  hold=true so the second finds the model loaded; resent with attempt+1 after a timeout)
    → BRANCH {job, step, block, branch, model, index, arena, passes, next[], hold, attempt}
                                                       ← BRANCH_DONE {job, step, block, branch, attempt, times, outputs}
  orchestrator → vae
    → DECODE {job, latent, arena, output, return_png, metadata, tile}    ← DECODED {job, path, png, width, height, timings}
    → VAE_ENCODE {job, image, arena, latent, tile}     ← VAE_ENCODED {job, latent, timings}
  orchestrator CLI, HTTP front → orchestrator daemon (ipc://RUN/sock/orchestrator.sock)
    → SUBMIT {prompt, base_dir, origin, answer_by}     ← SUBMITTED {job, seed, position}
    → ESTIMATE {prompt, base_dir}                      ← ESTIMATED {estimate}   (checked as SUBMIT; nothing queued)
    → STATUS {job | None, detail, active, before, limit}   ← JOBS {jobs: [JobInfo], more}
    → CANCEL {job, queued_only}                        ← OK
    → RESUME {job}                                     ← SUBMITTED
    → INFO {}                                          ← PIPELINE {packs: [PackRef], models, max_queue, version,
                                                                   loras}

Tensors in the arena are written by the sender before the request and left untouched until the reply is applied,
so every request is idempotent and may be resent.
"""

import secrets
from typing import ClassVar, Literal

from msgspec.structs import force_setattr

from models.runtime import phase_times
from models.lora.choice import MAX_LORAS, LoraChoice
from models.base.schema import fields_of
from models.sampling.img2img import DENOISE_STEPS
from models.sampling.latent_ops import LatentOpError, schedule_steps
from models.sampling.bounds import Cfg, Steps
from models.sampling.spectrum import SpectrumSettings
from models.sampling.step_cache import CacheSettings
from protocol.prompt import MAX_COND_ENTRIES, MAX_COND_STRENGTH, MAX_NOISE_INDEX, CondEntry, PromptFile
from protocol.fields import (MAX_NAME_CHARS, MAX_PATH_CHARS, MAX_TEXT_CHARS, Count, Float, Int, List, Map, Name, Note,
                             Path, ProtocolError, Scalar, Seconds, Text, Version, WireRecord)
from protocol.tensors import TensorDesc

PROTOCOL_VERSION = 1
HEARTBEAT_INTERVAL_S = 1.0  # orchestrator → stage HEARTBEAT period
LIVENESS = 3  # missed heartbeats before a stage counts as dead; 3..5 is reasonable
MAX_ID = 2**63 - 1
MAX_STEPS = 1000  # step indices and counts in progress and reports; a job's steps: models/sampling/bounds.py
MAX_BLOCKS = 256
MAX_PASSES = 2  # CFG: conditional first, then unconditional
MAX_AHEAD = 8  # branches named in BRANCH.next (prefetch hints)
from models.dit.partition import KINDS as BRANCH_KINDS  # noqa: E402 - the order inside a block: the branch table's
PASS_NAMES = ("cond", "uncond")
ERROR_CODES = (
    "bad_request",  # a field is missing, ill-typed or out of range (`field` names it)
    "unknown_kind",  # the kind is not in KINDS, or this stage does not serve it
    "version",  # `v` is not PROTOCOL_VERSION
    "too_large",  # a frame, string, list or map exceeds its limit
    "bad_frames",  # frame count or a frame's byte count does not match the descriptors
    "busy",  # the stage is working on another request (retry later)
    "cancelled",  # the job was cancelled or the stage is shutting down
    "failed",  # the request was valid but could not be done (`message` says why)
    "internal",  # the stage broke; it sends DYING and exits for supervisord to restart it
)
BranchKind = Literal[BRANCH_KINDS]
Pid = Int(0, 2**31 - 1)
Step = Int(1, MAX_STEPS)  # 1-based
Block = Int(0, MAX_BLOCKS - 1)

KINDS: dict[str, type["Message"]] = {}


def new_id() -> int:
    """A random request id (63 bits); replies echo it."""
    return secrets.randbits(63)


class Message(WireRecord, frozen=True, dict=True, tag_field="kind"):
    """Base of every message: frame 0 carries `v`, `kind` (the class's tag) and `id`, which correlates a reply with
    its request; `inline` holds frames 1..n (not in frame 0: MESSAGE(..., inline=frames) attaches them)."""

    KIND: ClassVar[str] = ""
    RESERVED: ClassVar[frozenset[str]] = frozenset({"v", "kind"})
    WIRE_DEFAULTS: ClassVar[dict] = {"v": lambda: PROTOCOL_VERSION, "id": new_id}
    inline = ()                                 # the instance's own frames, when attached
    v: Literal[PROTOCOL_VERSION]
    id: Int(0, MAX_ID)

    @classmethod
    def _build(cls, *args, inline=(), **kw):
        msg = super()._build(*args, **kw)
        if inline:
            msg.attach(inline)
        return msg

    def attach(self, frames) -> None:
        """Set the inline frames (1..n) this message travels with."""
        force_setattr(self, "inline", tuple(frames))

    def replace(self, **changes):
        out = super().replace(**changes)
        if self.inline:
            out.attach(self.inline)
        return out

    def to_wire(self) -> dict:
        """The message's fields as plain data (without v and kind)."""
        d = self.to_dict()
        d.pop("v", None)
        d.pop("kind", None)
        return d


def _message(kind: str):
    def register(cls):
        clash = set(fields_of(cls)) & Message.RESERVED - {"v"}
        if clash or cls.__struct_config__.tag != kind:
            raise TypeError(f"{cls.__name__}: tag {cls.__struct_config__.tag!r} or reserved header names {clash}")
        cls.KIND = kind
        KINDS[kind] = cls
        return cls
    return register


class _Record(WireRecord, frozen=True):
    def to_wire(self) -> dict:
        return self.to_dict()


# ---- nested records ----------------------------------------------------------------------------------------------

# Spectrum settings are models/sampling/spectrum.py's one record (prompt.json's names and bounds), carried as they are; so are
# a job's LoRAs (models/lora/choice.py: names under MODELS/loras/, each stage resolves them in its own models folder).

class DenoiseParams(_Record, frozen=True):
    seed: Int(0, 2**64 - 1)
    steps: Steps
    cfg: Cfg
    sampler: Name = "euler"
    scheduler: Name = "sgm_uniform"
    width: Int(8, 16384)  # pixels
    height: Int(8, 16384)
    spectrum: SpectrumSettings = SpectrumSettings()
    cache: CacheSettings | None = None  # EasyCache / LazyCache (models/sampling/step_cache.py); None: off
    # sampling from a latent, as ComfyUI's KSampler (denoise) and KSamplerAdvanced (the rest); models/sampling/img2img.py
    denoise: Float(above=0.0, hi=1.0) = 1.0
    denoise_steps: Literal[DENOISE_STEPS] = "comfyui"  # ComfyUI's count of a partial denoise, or A1111's img2img's
    start_step: Int(0, MAX_STEPS) | None = None  # start_at_step
    end_step: Int(0, MAX_STEPS) | None = None  # end_at_step
    add_noise: bool = True
    leftover_noise: bool = False  # return_with_leftover_noise (with end_step)
    latent_fill: Literal["noise", "nothing"] | None = None  # the masked init latent: the seed's noise or zeros
    noise_index: Int(0, MAX_NOISE_INDEX) = 0  # the image's place in ComfyUI's batch noise (one randn over [B, C, h, w])
    batch_size: Int(1, 64) = 1  # the batch ComfyUI samples as one tensor (its noise samplers draw over all of it)
    batch_pos: Int(0, 63) = 0  # this image's place in that batch

    def __post_init__(self):
        if self.denoise_steps == "comfyui":         # A1111's count samples the schedule of `steps` itself
            try:
                schedule_steps(self.steps, float(self.denoise))
            except LatentOpError as e:              # refused here, before the scheduler builds int(steps / denoise)
                raise ProtocolError("denoise", str(e)) from None


class Region(_Record, frozen=True):
    """A byte range of the job's arena handed to a stage to carve its own slots from (protocol.arena.SlotAllocator)."""

    offset: Int(0, 2**48)
    nbytes: Int(0, 2**48)


class BranchPass(_Record, frozen=True):
    """One CFG pass of a branch call: named inputs (as in models/dit/partition.py) and where the output goes."""

    name: Literal[PASS_NAMES]
    inputs: Map(TensorDesc, max_items=16)
    output: TensorDesc | None = None  # None: reply inline (a remote executor)


class BranchRef(_Record, frozen=True):
    """The branch after this one (lets prefetch policies load it early)."""

    block: Block
    branch: BranchKind
    model: Path
    index: Int(0, 3 * MAX_BLOCKS)


# THE per-call lifecycle times and their per-kind sums are models/runtime/phase_times.py's records, carried as they are.
PhaseTimes = phase_times.PhaseTimes
PhaseSums = phase_times.PhaseSums


class StepTimes(_Record, frozen=True):
    """One sampler step on the scheduler's critical path (seconds measured here; in board-sim mode the executor's
    phases and the host-op segments are paced to the modelled board x time_scale)."""

    step: Step
    computed: bool = True  # False: a Spectrum forecast (no branch calls)
    wall_s: Seconds = 0.0
    infer_s: Seconds = 0.0  # the executor's inference (every pass)
    lifecycle_s: Seconds = 0.0  # load/init/release the scheduler waited for (not what ran ahead)
    host_s: Seconds = 0.0  # host-op segments between branch calls (paced on board-sim)
    host_work_s: Seconds = 0.0  # the host ops' own compute here, before any pacing
    transport_s: Seconds = 0.0  # call wall minus the executor's inference and visible lifecycle
    calls: Count = 0  # branch calls (requests to the executor)
    nfe: Count = 1  # model calls (forwards, both CFG passes each): 2 for a heun step, 0 for a forecast


class TileSettings(_Record, frozen=True):
    enabled: bool = True
    tile: Int(4, 4096) = 32  # latent pixels per tile side
    overlap: Float(0.0, 0.9) = 0.5  # fraction of a tile


# ---- control -----------------------------------------------------------------------------------------------------

@_message("HELLO")
class Hello(Message, tag="HELLO"):
    peer: Name  # who is asking: "orchestrator", "scheduler", "cli" ...
    pid: Pid
    version: Version  # software version of the sender


@_message("READY")
class Ready(Message, tag="READY"):
    stage: Name
    pid: Pid
    version: Version
    info: Map(Scalar) = {}  # backend, threads, policy, ...


@_message("HEARTBEAT")
class Heartbeat(Message, tag="HEARTBEAT"):
    peer: Name


@_message("PONG")
class Pong(Message, tag="PONG"):
    stage: Name
    pid: Pid
    busy: bool
    job: Name | None = None
    uptime_s: Seconds
    rss_mb: Seconds | None = None


@_message("CANCEL")
class Cancel(Message, tag="CANCEL"):
    job: Name
    queued_only: bool = False      # the orchestrator cancels the job only while it waits (ComfyUI's queue delete)


@_message("SHUTDOWN")
class Shutdown(Message, tag="SHUTDOWN"):
    reason: Note = ""


@_message("OK")
class Ok(Message, tag="OK"):
    note: Note = ""


@_message("ERROR")
class Error(Message, tag="ERROR"):
    code: Literal[ERROR_CODES]
    message: Note
    field: Note = ""  # dotted path of the bad field, "" when none
    retry: bool = False  # the same request may succeed later


@_message("DYING")
class Dying(Message, tag="DYING"):
    stage: Name
    pid: Pid
    reason: Note
    job: Name | None = None


# ---- encoder -----------------------------------------------------------------------------------------------------

@_message("ENCODE")
class Encode(Message, tag="ENCODE"):
    job: Name
    prompt: Text(MAX_TEXT_CHARS)
    negative: Text(MAX_TEXT_CHARS) = ""
    arena: Name | None = None  # None: reply with inline tensors (remote encoder)
    cond: TensorDesc | None = None  # [S, Dc] f32 slot to fill
    uncond: TensorDesc | None = None
    rows: Int(512, 2**16) = 512  # S: context rows to produce (the pack's; more than 512 for a long one)
    loras: List(LoraChoice, max_items=MAX_LORAS) = ()  # merged into the adapter and Qwen3 for this job
    # prompt.json's positive / negative entry when not plain (ConditioningZeroOut, ConditioningAverage): its text is
    # `prompt` / `negative`; None: the text encoded as it is
    prompt_entry: CondEntry | None = None
    negative_entry: CondEntry | None = None


@_message("ENCODED")
class Encoded(Message, tag="ENCODED"):
    job: Name
    cond: TensorDesc  # [S, Dc] where it was written
    uncond: TensorDesc
    tokens_cond: Int(0, 2**20)
    tokens_uncond: Int(0, 2**20)
    truncated: bool = False
    timings: Map(Seconds) = {}  # load_s, tokenize_s, encode_s, ...


# ---- scheduler ---------------------------------------------------------------------------------------------------

class CondPassRef(_Record, frozen=True):
    """One conditioning of a CFG side (prompt.json's positive/negative entries): its context [S, Dc] f32 and how the
    sampler mixes its model pass (models/sampling/cond_mix.py)."""

    side: Literal["positive", "negative"]
    context: TensorDesc
    strength: Float(0.0, MAX_COND_STRENGTH) = 1.0
    start: Float(0.0, 1.0) = 0.0       # percent of the schedule
    end: Float(0.0, 1.0) = 1.0


@_message("DENOISE")
class Denoise(Message, tag="DENOISE"):
    job: Name
    job_dir: Path  # per-step state is written here (write-then-rename)
    pack_dir: Path
    arena: Name
    params: DenoiseParams
    cond: TensorDesc  # [S, Dc]
    uncond: TensorDesc
    latent: TensorDesc  # output [C, H/8, W/8] f32
    init_latent: TensorDesc | None = None  # [C, H/8, W/8] f32 model space: the latent to start from (None: zeros)
    noise_mask: TensorDesc | None = None  # [C, H/8, W/8] f32 in [0, 1]: 1 where the sampler may change the latent
    scratch: Region  # the scheduler carves branch inputs/outputs from here
    executor: Path  # endpoint
    resume: bool = True  # continue from job_dir's last finished step when present
    # rows of ComfyUI's context per pass (cond, uncond) that a long-context pack leaves unmasked; () = all
    context_rows: List(Int(1, 2**16), max_items=2) = ()
    # the job's LoRAs: host layers merged here, branch layers as a LoRA-ready pack's low-rank inputs
    loras: List(LoraChoice, max_items=MAX_LORAS) = ()
    # several conditionings per side, each a model pass mixed as ComfyUI does; () = cond and uncond alone
    conds: List(CondPassRef, max_items=2 * MAX_COND_ENTRIES) = ()


@_message("PROGRESS")
class Progress(Message, tag="PROGRESS"):
    job: Name
    step: Step  # 1-based
    steps: Step
    block: Block
    branch: BranchKind
    cfg_pass: Literal[PASS_NAMES + ("both",)] = "both"
    forecast: bool = False
    elapsed_s: Seconds
    eta_s: Seconds | None = None  # the sampling pass's time left (stages/eta.py)
    blocks: Int(0, MAX_BLOCKS) = 0  # the pack's blocks (0: not said)


@_message("DENOISED")
class Denoised(Message, tag="DENOISED"):
    job: Name
    latent: TensorDesc
    computed_steps: List(Step, max_items=MAX_STEPS)  # 1-based
    forecast_steps: List(Step, max_items=MAX_STEPS)
    branch_calls: Count
    branches: Map(PhaseSums, key=BranchKind) = {}
    host_s: Seconds  # scheduler time not spent waiting on the executor (host ops, sampler, state saves)
    host_hidden_s: Seconds = 0.0  # host-op seconds that ran while a branch inferred (interleave)
    transport_s: Seconds  # waiting on the executor beyond its critical path (visible transport)
    wall_s: Seconds
    resumed_from: Int(0, MAX_STEPS) = 0  # last finished step found on start; 0 = fresh
    resends: Count = 0
    host_work_s: Seconds = 0.0  # host ops' own compute here (host_s minus board-sim pacing)
    steps: List(StepTimes, max_items=MAX_STEPS) = ()  # this run's steps
    model_calls: Count = 0  # the job's model calls run (each one CFG pass or both), resumed steps' included
    reused_calls: Count = 0  # the job's model calls the step cache answered without the model
    executor_backend: Text(MAX_NAME_CHARS) = ""  # the backend the executor ran the branches on (its READY says)


# ---- executor ----------------------------------------------------------------------------------------------------

@_message("BRANCH")
class Branch(Message, tag="BRANCH"):
    job: Name
    step: Step
    block: Block
    branch: BranchKind
    model: Path  # branch model file (ONNX or RKNN)
    index: Int(0, 3 * MAX_BLOCKS)  # position in the branch table
    arena: Name | None = None  # None when every tensor is inline
    passes: List(BranchPass, max_items=MAX_PASSES, min_items=1)
    next: List(BranchRef, max_items=MAX_AHEAD) = ()  # what follows, in order
    hold: bool = False  # another pass of this branch follows (interleave): keep the model loaded
    attempt: Int(1, 1000) = 1


@_message("BRANCH_DONE")
class BranchDone(Message, tag="BRANCH_DONE"):
    job: Name
    step: Step
    block: Block
    branch: BranchKind
    attempt: Int(1, 1000) = 1
    times: PhaseTimes  # times.source says whether the model was already loaded
    outputs: List(TensorDesc, max_items=MAX_PASSES, min_items=1)  # per pass
    rss_mb: Seconds | None = None
    pss_mb: Seconds | None = None

    def __post_init__(self):
        for name, least in (("infer_s", 1), ("infer_at", 0)):          # a branch call runs one model per pass
            n = len(getattr(self.times, name))
            if not least <= n <= MAX_PASSES:
                raise ProtocolError(f"times.{name}", f"expected {least}..{MAX_PASSES} items, got {n}",
                                    "too_large" if n > MAX_PASSES else "bad_field")


# ---- vae ---------------------------------------------------------------------------------------------------------

# One PNG text chunk: the job's graphs as ASCII JSON (orchestrator.engine.png_text); a 4000-character prompt of
# emoji escapes to 48,000 characters and `workflow` holds both prompts (frame 0 is at most 1 MiB in all).
MAX_PNG_TEXT_CHARS = 4 * MAX_TEXT_CHARS


@_message("DECODE")
class Decode(Message, tag="DECODE"):
    job: Name
    latent: TensorDesc  # [C, H/8, W/8] f32, slot or inline
    arena: Name | None = None
    output: Path | None = None  # PNG path on the VAE's machine; None: return it inline
    return_png: bool = False
    metadata: Map(Text(MAX_PNG_TEXT_CHARS)) = {}  # PNG text chunks
    tile: TileSettings = TileSettings()


@_message("DECODED")
class Decoded(Message, tag="DECODED"):
    job: Name
    path: Path | None = None
    png: TensorDesc | None = None  # u8 [n] inline PNG bytes when asked
    width: Int(1, 65536)
    height: Int(1, 65536)
    timings: Map(Seconds) = {}


@_message("VAE_ENCODE")
class VaeEncode(Message, tag="VAE_ENCODE"):
    """An image to a model-space latent (img2img's start): the VAE stage's encoder half."""

    job: Name
    image: TensorDesc  # [3, H, W] f32 in [-1, 1] (2 * pixel / 255 - 1), slot or inline
    arena: Name | None = None
    latent: TensorDesc | None = None  # [16, H/8, W/8] f32 slot to fill; None: the latent comes back inline
    tile: TileSettings = TileSettings()


@_message("VAE_ENCODED")
class VaeEncoded(Message, tag="VAE_ENCODED"):
    job: Name
    latent: TensorDesc  # [16, H/8, W/8] f32 model space, where it was written
    timings: Map(Seconds) = {}


# ---- orchestrator CLI ↔ daemon ------------------------------------------------------------------------------------

MAX_PROMPT_JSON_CHARS = 65_536  # a whole prompt.json (protocol.prompt.MAX_FILE_BYTES)
MAX_ORIGIN_CHARS = 65_536       # what a job came from (JSON: api, client id, the client's graph)
MAX_JOBS_LISTED = 256
MAX_PACKS = 32
MAX_LORAS_LISTED = 1024         # LoRA names in PIPELINE (ComfyUI's LoraLoader list)


SAMPLING_PASSES = ("first", "hires")      # a job's sampling passes: its own, then a hires fix's second pass


class DenoisePass(_Record, frozen=True):
    """Which DENOISE of its job is running: the image of the batch and the sampling pass (what a progress line
    names: `image 2/3 · hires pass · step 4/6`)."""

    image: Int(1, 64)  # 1-based
    images: Int(1, 64)
    name: Literal[SAMPLING_PASSES] = "first"


class JobInfo(_Record, frozen=True):
    """One job as `orchestrator status` shows it; the progress fields are the latest PROGRESS of a running job and
    the DENOISE it belongs to."""

    job: Name
    state: Name  # queued, encoding, denoising, decoding, done, failed, cancelled
    created: Seconds
    updated: Seconds
    position: Int(0, 2**20) = 0  # jobs ahead of a queued one
    error_stage: Text(MAX_NAME_CHARS) = ""
    error: Note = ""
    image: Path | None = None
    report: Path | None = None
    progress: Progress | None = None
    denoise_pass: DenoisePass | None = None  # with `progress`: which image of the batch, which sampling pass
    spec_json: Text(MAX_PROMPT_JSON_CHARS) = ""  # with STATUS detail: the job's resolved prompt
    origin: Text(MAX_ORIGIN_CHARS) = ""  # with STATUS detail: SUBMIT's origin ("" when none)


class SamplingRef(_Record, frozen=True):
    """The sampling settings a pack records for its model (models/packs/sampling.py): a job that sets none takes
    them."""

    steps: Steps
    cfg: Cfg
    sampler: Name
    scheduler: Name


class PackRef(_Record, frozen=True):
    """A model pack the daemon serves: one image size."""

    width: Int(8, 16384)
    height: Int(8, 16384)
    dir: Path
    dtype: Name  # io dtype of its branches: f16 | f32
    blocks: Int(1, MAX_BLOCKS)
    source_name: Note = ""  # the checkpoint it was built from
    source_sha256: Text(64) = ""
    lora_rank: Int(0, 2**16) = 0  # R of a LoRA-ready pack; 0: it takes no LoRA per job
    sampling: SamplingRef | None = None  # None: the pack records none (prompt.json's defaults)


@_message("SUBMIT")
class Submit(Message, tag="SUBMIT"):
    prompt: PromptFile  # the one prompt record (protocol/prompt.py), checked as it is decoded
    base_dir: Path  # relative `output` paths resolve from here (the CLI's working directory)
    origin: Text(MAX_ORIGIN_CHARS) = ""  # JSON object kept with the job: {"api", "client_id", "graph"...}
    # the wall-clock time (s since the epoch) after which the client no longer waits for the answer: a SUBMIT
    # decided later is refused (busy, retry), never queued behind a client told it failed; 0: the client waits
    answer_by: Float(0.0, 1e11) = 0.0


@_message("SUBMITTED")
class Submitted(Message, tag="SUBMITTED"):
    job: Name
    seed: Int(0, 2**64 - 1)  # drawn by the daemon when the file had none
    position: Int(0, 2**20) = 0


@_message("ESTIMATE")
class EstimateJob(Message, tag="ESTIMATE"):
    """The job SUBMIT would queue, checked the same way and priced on the board model instead (nothing is queued)."""
    prompt: PromptFile
    base_dir: Path


@_message("ESTIMATED")
class Estimated(Message, tag="ESTIMATED"):
    estimate: Text(MAX_ORIGIN_CHARS)  # JSON object: orchestrator/engine/estimate.py Estimate.to_dict (modelled seconds)


@_message("STATUS")
class Status(Message, tag="STATUS"):
    job: Name | None = None  # None: every job (the newest `limit`, oldest first)
    detail: bool = False  # fill JobInfo.spec_json and .origin (the reply stays under the frame limit: `more`)
    active: bool = False  # queued and running jobs only
    before: Name | None = None  # only jobs older than this id (paging back)
    limit: Int(0, MAX_JOBS_LISTED) = 0  # 0: MAX_JOBS_LISTED


@_message("JOBS")
class Jobs(Message, tag="JOBS"):
    jobs: List(JobInfo, max_items=MAX_JOBS_LISTED)
    more: bool = False  # older jobs matched but were left out (limit or size); ask with `before`


@_message("RESUME")
class Resume(Message, tag="RESUME"):
    job: Name


@_message("INFO")
class Info(Message, tag="INFO"):
    """What the daemon serves (no fields)."""


@_message("PIPELINE")
class Pipeline(Message, tag="PIPELINE"):
    packs: List(PackRef, max_items=MAX_PACKS, min_items=1)  # the default first
    models: Map(Note) = {}  # part -> file name: text_encoder, vae
    max_queue: Int(1, 2**20)
    version: Version
    loras: List(Text(MAX_PATH_CHARS, 1), max_items=MAX_LORAS_LISTED) = ()  # names under MODELS/loras/


@_message("PRUNE")
class Prune(Message, tag="PRUNE"):
    """Remove finished jobs (done, failed, cancelled) and their folders; the reply is JOBS with the removed ones."""

    keep: Int(0, 2**20) | None = None  # keep this many of the newest finished jobs
    older_than_s: Float(0.0, 1e11) | None = None  # and remove those finished longer ago


# ---- helpers -----------------------------------------------------------------------------------------------------

def reply_to(request: Message, cls: type[Message], **fields) -> Message:
    """A reply of kind `cls` carrying the request's id."""
    return cls(id=request.id, **fields)


def _printable(text: str) -> str:
    """Text safe for an ERROR reply: NULs and lone surrogates escaped (they may come from the bad request itself and
    would not encode), length capped."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\x00", "\\x00")[:MAX_PATH_CHARS]


def error_reply(request_id: int, error: ProtocolError | str, message: str = "", *, field: str = "",
                retry: bool = False) -> Error:
    """An ERROR reply from a ProtocolError, or from a code plus message. Never fails on odd text."""
    if isinstance(error, ProtocolError):
        code = "bad_request" if error.code in ("bad_field", "unknown_field", "missing_field") else error.code
        if code not in ERROR_CODES:
            code = "bad_request"
        return Error(id=request_id, code=code, message=_printable(str(error)), field=_printable(error.field))
    return Error(id=request_id, code=error, message=_printable(message), field=_printable(field), retry=retry)


class RemoteError(Exception):
    """An ERROR reply turned into an exception on the client side."""

    def __init__(self, reply: Error, peer: str = ""):
        self.reply = reply
        self.code, self.field, self.retry = reply.code, reply.field, reply.retry
        where = f" from {peer}" if peer else ""
        super().__init__(f"{reply.code}{where}: {reply.message}")


def expect(reply: Message, cls: type[Message], peer: str = "") -> Message:
    """`reply` if it is a `cls`; RemoteError for an ERROR; ProtocolError for any other kind."""
    if isinstance(reply, cls):
        return reply
    if isinstance(reply, Error):
        raise RemoteError(reply, peer)
    raise ProtocolError("kind", f"expected {cls.KIND} in reply, got {reply.KIND}", "unknown_kind")
