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
    → ENCODE {job, prompt, negative, arena, cond, uncond, rows}        ← ENCODED {job, cond, uncond, tokens_*, truncated, timings}
  orchestrator → scheduler (minutes; heartbeats are answered between branches)
    → DENOISE {job, job_dir, pack_dir, arena, params, cond, uncond, latent, scratch, executor, resume, context_rows}
    ⇢ PROGRESS {job, step, steps, block, branch, cfg_pass, forecast, elapsed_s, eta_s}
                                                       ← DENOISED {job, latent, computed/forecast steps, sums, ...}
  scheduler → executor (one per branch call: both CFG passes, or with interleave one pass per call, the first with
  hold=true so the second finds the model loaded; resent with attempt+1 after a timeout)
    → BRANCH {job, step, block, branch, model, index, arena, passes, next[], hold, attempt}
                                                       ← BRANCH_DONE {job, step, block, branch, attempt, times, outputs}
  orchestrator → vae
    → DECODE {job, latent, arena, output, return_png, metadata, tile}    ← DECODED {job, path, png, width, height, timings}
  orchestrator CLI, HTTP front → orchestrator daemon (ipc://RUN/sock/orchestrator.sock)
    → SUBMIT {prompt_json, base_dir, origin}           ← SUBMITTED {job, seed, position}
    → STATUS {job | None, detail, active, before, limit}   ← JOBS {jobs: [JobInfo], more}
    → CANCEL {job}                                     ← OK
    → RESUME {job}                                     ← SUBMITTED
    → INFO {}                                          ← PIPELINE {packs: [PackRef], models, max_queue, version}

Tensors in the arena are written by the sender before the request and left untouched until the reply is applied,
so every request is idempotent and may be resent.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, ClassVar

from models import phase_times
from protocol.fields import (MAX_NAME_CHARS, MAX_PATH_CHARS, MAX_TEXT_CHARS, Bool, Float, Int, List, Map, Name, Nested, Optional,
                             Path, ProtocolError, Record, Scalar, Str, Struct, spec)
from protocol.tensors import Tensor, TensorDesc

PROTOCOL_VERSION = 1
HEARTBEAT_INTERVAL_S = 1.0  # orchestrator → stage HEARTBEAT period
LIVENESS = 3  # missed heartbeats before a stage counts as dead; 3..5 is reasonable
MAX_ID = 2**63 - 1
MAX_STEPS = 1000
MAX_BLOCKS = 256
MAX_PASSES = 2  # CFG: conditional first, then unconditional
MAX_AHEAD = 8  # branches named in BRANCH.next (prefetch hints)
from models.partition import KINDS as BRANCH_KINDS  # noqa: E402 - the order inside a block: the branch table's
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

KINDS: dict[str, type["Message"]] = {}


def new_id() -> int:
    """A random request id (63 bits); replies echo it."""
    return secrets.randbits(63)


def _message(kind: str):
    def register(cls):
        cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        clash = {f.name for f in dataclasses.fields(cls)} & Message.RESERVED
        if clash:
            raise TypeError(f"{cls.__name__} uses reserved header names {clash}")
        cls.KIND = kind
        KINDS[kind] = cls
        return cls
    return register


def _record(cls):
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message(Record):
    """Base of every message: `id` correlates a reply with its request; `inline` holds frames 1..n (not in frame 0)."""

    KIND: ClassVar[str] = ""
    RESERVED: ClassVar[frozenset[str]] = frozenset({"v", "kind"})
    id: int = spec(Int(0, MAX_ID), factory=new_id)
    inline: tuple = dataclasses.field(default=(), compare=False, repr=False)


# ---- nested records ----------------------------------------------------------------------------------------------

@_record
class SpectrumSettings(Record):
    """Spectrum step forecasting (defaults as in stable-diffusion.cpp; see ../shared/anima-facts.md)."""

    enabled: bool = spec(Bool(), True)
    w: float = spec(Float(0.0, 1.0), 0.4)  # Chebyshev vs Taylor blend
    m: int = spec(Int(1, 8), 3)  # Chebyshev degree
    lam: float = spec(Float(0.0, 1e6), 1.0)  # ridge penalty
    window: float = spec(Float(1.0, 100.0), 2.0)
    flex: float = spec(Float(0.0, 100.0), 0.5)
    warmup: int = spec(Int(0, MAX_STEPS), 4)
    stop: float = spec(Float(0.0, 1.0), 0.9)


@_record
class DenoiseParams(Record):
    seed: int = spec(Int(0, 2**64 - 1))
    steps: int = spec(Int(1, MAX_STEPS))
    cfg: float = spec(Float(0.0, 100.0))
    sampler: str = spec(Name(), "euler")
    schedule: str = spec(Name(), "sgm_uniform")
    width: int = spec(Int(8, 16384))  # pixels
    height: int = spec(Int(8, 16384))
    spectrum: SpectrumSettings = spec(Nested(SpectrumSettings), factory=SpectrumSettings)


@_record
class Region(Record):
    """A byte range of the job's arena handed to a stage to carve its own slots from (protocol.arena.SlotAllocator)."""

    offset: int = spec(Int(0, 2**48))
    nbytes: int = spec(Int(0, 2**48))


@_record
class BranchPass(Record):
    """One CFG pass of a branch call: named inputs (as in models/partition.py) and where the output goes."""

    name: str = spec(Str(16, choices=PASS_NAMES))
    inputs: dict[str, TensorDesc] = spec(Map(Tensor(), max_items=16))
    output: TensorDesc | None = spec(Optional(Tensor()), None)  # None: reply inline (a remote executor)


@_record
class BranchRef(Record):
    """The branch after this one (lets prefetch policies load it early)."""

    block: int = spec(Int(0, MAX_BLOCKS - 1))
    branch: str = spec(Str(16, choices=BRANCH_KINDS))
    model: str = spec(Path())
    index: int = spec(Int(0, 3 * MAX_BLOCKS))


# THE per-call lifecycle times and their per-kind sums are models/phase_times.py's classes; checked here on the wire.
PhaseTimes = phase_times.PhaseTimes
PhaseSums = phase_times.PhaseSums
PHASE_TIMES = Struct(PhaseTimes, required=("load_s", "init_s", "infer_s", "release_s"),
                     load_s=Float(), init_s=Float(), infer_s=List(Float(), min_items=1, max_items=MAX_PASSES),
                     release_s=Float(), wait_s=Float(), prev_release_s=Float(),
                     source=Str(16, choices=phase_times.SOURCES), context_mb=Float(),
                     infer_at=List(Float(0.0, 1e12), max_items=MAX_PASSES))
PHASE_SUMS = Struct(PhaseSums, required=("calls", "load_s", "init_s", "infer_s", "release_s"),
                    calls=Int(0, 2**40), load_s=Float(), init_s=Float(), infer_s=Float(), release_s=Float(),
                    wait_s=Float(), visible_s=Float(), hidden_s=Float(), cached=Int(0, 2**40))


@_record
class StepTimes(Record):
    """One sampler step on the scheduler's critical path (seconds measured here; in board-sim mode the executor's
    phases and the host-op segments are paced to the modelled board x time_scale)."""

    step: int = spec(Int(1, MAX_STEPS))  # 1-based
    computed: bool = spec(Bool(), True)  # False: a Spectrum forecast (no branch calls)
    wall_s: float = spec(Float(), 0.0)
    infer_s: float = spec(Float(), 0.0)  # the executor's inference (every pass)
    lifecycle_s: float = spec(Float(), 0.0)  # load/init/release the scheduler waited for (not what ran ahead)
    host_s: float = spec(Float(), 0.0)  # host-op segments between branch calls (paced on board-sim)
    host_work_s: float = spec(Float(), 0.0)  # the host ops' own compute here, before any pacing
    transport_s: float = spec(Float(), 0.0)  # call wall minus the executor's inference and visible lifecycle
    calls: int = spec(Int(0, 2**40), 0)


@_record
class TileSettings(Record):
    enabled: bool = spec(Bool(), True)
    tile: int = spec(Int(4, 4096), 32)  # latent pixels per tile side
    overlap: float = spec(Float(0.0, 0.9), 0.5)  # fraction of a tile


# ---- control -----------------------------------------------------------------------------------------------------

@_message("HELLO")
class Hello(Message):
    peer: str = spec(Name())  # who is asking: "orchestrator", "scheduler", "cli" ...
    pid: int = spec(Int(0, 2**31 - 1))
    version: str = spec(Str(64))  # software version of the sender


@_message("READY")
class Ready(Message):
    stage: str = spec(Name())
    pid: int = spec(Int(0, 2**31 - 1))
    version: str = spec(Str(64))
    info: dict[str, Any] = spec(Map(Scalar()), factory=dict)  # backend, threads, policy, ...


@_message("HEARTBEAT")
class Heartbeat(Message):
    peer: str = spec(Name())


@_message("PONG")
class Pong(Message):
    stage: str = spec(Name())
    pid: int = spec(Int(0, 2**31 - 1))
    busy: bool = spec(Bool())
    job: str | None = spec(Optional(Name()), None)
    uptime_s: float = spec(Float())
    rss_mb: float | None = spec(Optional(Float()), None)


@_message("CANCEL")
class Cancel(Message):
    job: str = spec(Name())


@_message("SHUTDOWN")
class Shutdown(Message):
    reason: str = spec(Str(MAX_PATH_CHARS), "")


@_message("OK")
class Ok(Message):
    note: str = spec(Str(MAX_PATH_CHARS), "")


@_message("ERROR")
class Error(Message):
    code: str = spec(Str(32, choices=ERROR_CODES))
    message: str = spec(Str(MAX_PATH_CHARS))
    field: str = spec(Str(MAX_PATH_CHARS), "")  # dotted path of the bad field, "" when none
    retry: bool = spec(Bool(), False)  # the same request may succeed later


@_message("DYING")
class Dying(Message):
    stage: str = spec(Name())
    pid: int = spec(Int(0, 2**31 - 1))
    reason: str = spec(Str(MAX_PATH_CHARS))
    job: str | None = spec(Optional(Name()), None)


# ---- encoder -----------------------------------------------------------------------------------------------------

@_message("ENCODE")
class Encode(Message):
    job: str = spec(Name())
    prompt: str = spec(Str(MAX_TEXT_CHARS))
    negative: str = spec(Str(MAX_TEXT_CHARS), "")
    arena: str | None = spec(Optional(Name()), None)  # None: reply with inline tensors (remote encoder)
    cond: TensorDesc | None = spec(Optional(Tensor()), None)  # [S, Dc] f32 slot to fill
    uncond: TensorDesc | None = spec(Optional(Tensor()), None)
    rows: int = spec(Int(512, 2**16), 512)  # S: context rows to produce (the pack's; more than 512 for a long one)


@_message("ENCODED")
class Encoded(Message):
    job: str = spec(Name())
    cond: TensorDesc = spec(Tensor())  # [S, Dc] where it was written
    uncond: TensorDesc = spec(Tensor())
    tokens_cond: int = spec(Int(0, 2**20))
    tokens_uncond: int = spec(Int(0, 2**20))
    truncated: bool = spec(Bool(), False)
    timings: dict[str, float] = spec(Map(Float()), factory=dict)  # load_s, tokenize_s, encode_s, ...


# ---- scheduler ---------------------------------------------------------------------------------------------------

@_message("DENOISE")
class Denoise(Message):
    job: str = spec(Name())
    job_dir: str = spec(Path())  # per-step state is written here (write-then-rename)
    pack_dir: str = spec(Path())
    arena: str = spec(Name())
    params: DenoiseParams = spec(Nested(DenoiseParams))
    cond: TensorDesc = spec(Tensor())  # [S, Dc]
    uncond: TensorDesc = spec(Tensor())
    latent: TensorDesc = spec(Tensor())  # output [C, H/8, W/8] f32
    scratch: Region = spec(Nested(Region))  # the scheduler carves branch inputs/outputs from here
    executor: str = spec(Str(MAX_PATH_CHARS, min_chars=1))  # endpoint
    resume: bool = spec(Bool(), True)  # continue from job_dir's last finished step when present
    # rows of ComfyUI's context per pass (cond, uncond) that a long-context pack leaves unmasked; () = all
    context_rows: tuple = spec(List(Int(1, 2**16), max_items=2), factory=tuple)


@_message("PROGRESS")
class Progress(Message):
    job: str = spec(Name())
    step: int = spec(Int(1, MAX_STEPS))  # 1-based
    steps: int = spec(Int(1, MAX_STEPS))
    block: int = spec(Int(0, MAX_BLOCKS - 1))
    branch: str = spec(Str(16, choices=BRANCH_KINDS))
    cfg_pass: str = spec(Str(16, choices=PASS_NAMES + ("both",)), "both")
    forecast: bool = spec(Bool(), False)
    elapsed_s: float = spec(Float())
    eta_s: float | None = spec(Optional(Float()), None)


@_message("DENOISED")
class Denoised(Message):
    job: str = spec(Name())
    latent: TensorDesc = spec(Tensor())
    computed_steps: tuple[int, ...] = spec(List(Int(1, MAX_STEPS), max_items=MAX_STEPS))  # 1-based
    forecast_steps: tuple[int, ...] = spec(List(Int(1, MAX_STEPS), max_items=MAX_STEPS))
    branch_calls: int = spec(Int(0, 2**40))
    branches: dict[str, PhaseSums] = spec(Map(PHASE_SUMS, keys=BRANCH_KINDS), factory=dict)
    host_s: float = spec(Float())  # scheduler time not spent waiting on the executor (host ops, sampler, state saves)
    host_hidden_s: float = spec(Float(), 0.0)  # host-op seconds that ran while a branch inferred (interleave)
    transport_s: float = spec(Float())  # waiting on the executor beyond its critical path (visible transport)
    wall_s: float = spec(Float())
    resumed_from: int = spec(Int(0, MAX_STEPS), 0)  # last finished step found on start; 0 = fresh
    resends: int = spec(Int(0, 2**40), 0)
    host_work_s: float = spec(Float(), 0.0)  # host ops' own compute here (host_s minus board-sim pacing)
    steps: tuple[StepTimes, ...] = spec(List(Nested(StepTimes), max_items=MAX_STEPS), ())  # this run's steps


# ---- executor ----------------------------------------------------------------------------------------------------

@_message("BRANCH")
class Branch(Message):
    job: str = spec(Name())
    step: int = spec(Int(1, MAX_STEPS))
    block: int = spec(Int(0, MAX_BLOCKS - 1))
    branch: str = spec(Str(16, choices=BRANCH_KINDS))
    model: str = spec(Path())  # branch model file (ONNX or RKNN)
    index: int = spec(Int(0, 3 * MAX_BLOCKS))  # position in the branch table
    arena: str | None = spec(Optional(Name()), None)  # None when every tensor is inline
    passes: tuple[BranchPass, ...] = spec(List(Nested(BranchPass), min_items=1, max_items=MAX_PASSES))
    next: tuple[BranchRef, ...] = spec(List(Nested(BranchRef), max_items=MAX_AHEAD), ())  # what follows, in order
    hold: bool = spec(Bool(), False)  # another pass of this branch follows (interleave): keep the model loaded
    attempt: int = spec(Int(1, 1000), 1)


@_message("BRANCH_DONE")
class BranchDone(Message):
    job: str = spec(Name())
    step: int = spec(Int(1, MAX_STEPS))
    block: int = spec(Int(0, MAX_BLOCKS - 1))
    branch: str = spec(Str(16, choices=BRANCH_KINDS))
    attempt: int = spec(Int(1, 1000), 1)
    times: PhaseTimes = spec(PHASE_TIMES)  # times.source says whether the model was already loaded
    outputs: tuple[TensorDesc, ...] = spec(List(Tensor(), min_items=1, max_items=MAX_PASSES))  # per pass
    rss_mb: float | None = spec(Optional(Float()), None)
    pss_mb: float | None = spec(Optional(Float()), None)


# ---- vae ---------------------------------------------------------------------------------------------------------

# One PNG text chunk: the job's graphs as ASCII JSON (orchestrator.report.png_metadata); a 4000-character prompt of
# emoji escapes to 48,000 characters and `workflow` holds both prompts. The codec's limit per string (bytes).
MAX_PNG_TEXT_CHARS = 4 * MAX_TEXT_CHARS


@_message("DECODE")
class Decode(Message):
    job: str = spec(Name())
    latent: TensorDesc = spec(Tensor())  # [C, H/8, W/8] f32, slot or inline
    arena: str | None = spec(Optional(Name()), None)
    output: str | None = spec(Optional(Path()), None)  # PNG path on the VAE's machine; None: return it inline
    return_png: bool = spec(Bool(), False)
    metadata: dict[str, str] = spec(Map(Str(MAX_PNG_TEXT_CHARS)), factory=dict)  # PNG text chunks
    tile: TileSettings = spec(Nested(TileSettings), factory=TileSettings)


@_message("DECODED")
class Decoded(Message):
    job: str = spec(Name())
    path: str | None = spec(Optional(Path()), None)
    png: TensorDesc | None = spec(Optional(Tensor()), None)  # u8 [n] inline PNG bytes when asked
    width: int = spec(Int(1, 65536))
    height: int = spec(Int(1, 65536))
    timings: dict[str, float] = spec(Map(Float()), factory=dict)


# ---- orchestrator CLI ↔ daemon ------------------------------------------------------------------------------------

MAX_PROMPT_JSON_CHARS = 65_536  # a whole prompt.json (orchestrator.prompt_spec.MAX_FILE_BYTES)
MAX_ORIGIN_CHARS = 65_536       # what a job came from (JSON: api, client id, the client's graph)
MAX_JOBS_LISTED = 256
MAX_PACKS = 32


@_record
class JobInfo(Record):
    """One job as `orchestrator status` shows it; the progress fields are the latest PROGRESS of a running job."""

    job: str = spec(Name())
    state: str = spec(Name())  # queued, encoding, denoising, decoding, done, failed, cancelled
    created: float = spec(Float())
    updated: float = spec(Float())
    position: int = spec(Int(0, 2**20), 0)  # jobs ahead of a queued one
    error_stage: str = spec(Str(MAX_NAME_CHARS), "")
    error: str = spec(Str(MAX_PATH_CHARS), "")
    image: str | None = spec(Optional(Path()), None)
    report: str | None = spec(Optional(Path()), None)
    progress: Progress | None = spec(Optional(Nested(Progress)), None)
    spec_json: str = spec(Str(MAX_PROMPT_JSON_CHARS), "")  # with STATUS detail: the job's resolved prompt
    origin: str = spec(Str(MAX_ORIGIN_CHARS), "")  # with STATUS detail: SUBMIT's origin ("" when none)


@_record
class PackRef(Record):
    """A model pack the daemon serves: one image size."""

    width: int = spec(Int(8, 16384))
    height: int = spec(Int(8, 16384))
    dir: str = spec(Path())
    dtype: str = spec(Name())  # io dtype of its branches: f16 | f32
    blocks: int = spec(Int(1, MAX_BLOCKS))
    source_name: str = spec(Str(MAX_PATH_CHARS), "")  # the checkpoint it was built from
    source_sha256: str = spec(Str(64), "")


@_message("SUBMIT")
class Submit(Message):
    prompt_json: str = spec(Str(MAX_PROMPT_JSON_CHARS))  # the file's text: the daemon validates it again
    base_dir: str = spec(Path())  # relative `output` paths resolve from here (the CLI's working directory)
    origin: str = spec(Str(MAX_ORIGIN_CHARS), "")  # JSON object kept with the job: {"api", "client_id", "graph"...}


@_message("SUBMITTED")
class Submitted(Message):
    job: str = spec(Name())
    seed: int = spec(Int(0, 2**64 - 1))  # drawn by the daemon when the file had none
    position: int = spec(Int(0, 2**20), 0)


@_message("STATUS")
class Status(Message):
    job: str | None = spec(Optional(Name()), None)  # None: every job (the newest `limit`, oldest first)
    detail: bool = spec(Bool(), False)  # fill JobInfo.spec_json and .origin (the reply stays under the frame limit: `more`)
    active: bool = spec(Bool(), False)  # queued and running jobs only
    before: str | None = spec(Optional(Name()), None)  # only jobs older than this id (paging back)
    limit: int = spec(Int(0, MAX_JOBS_LISTED), 0)  # 0: MAX_JOBS_LISTED


@_message("JOBS")
class Jobs(Message):
    jobs: tuple[JobInfo, ...] = spec(List(Nested(JobInfo), max_items=MAX_JOBS_LISTED))
    more: bool = spec(Bool(), False)  # older jobs matched but were left out (limit or size); ask with `before`


@_message("RESUME")
class Resume(Message):
    job: str = spec(Name())


@_message("INFO")
class Info(Message):
    """What the daemon serves (no fields)."""


@_message("PIPELINE")
class Pipeline(Message):
    packs: tuple[PackRef, ...] = spec(List(Nested(PackRef), min_items=1, max_items=MAX_PACKS))  # the default first
    models: dict[str, str] = spec(Map(Str(MAX_PATH_CHARS)), factory=dict)  # part -> file name: text_encoder, vae
    max_queue: int = spec(Int(1, 2**20))
    version: str = spec(Str(64))


@_message("PRUNE")
class Prune(Message):
    """Remove finished jobs (done, failed, cancelled) and their folders; the reply is JOBS with the removed ones."""

    keep: int | None = spec(Optional(Int(0, 2**20)), None)  # keep this many of the newest finished jobs
    older_than_s: float | None = spec(Optional(Float(0.0, 1e11)), None)  # and remove those finished longer ago


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
