"""A job's record (RUN/jobs/<id>/job.json, `Job`) and what a listing keeps of it (`JobEntry`): the states a job goes
through and the ids it has. The store (orchestrator.engine.jobs) reads, writes and lists them."""

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from models.base.schema import Float, Int, Mapping, Meta, Record, SchemaError, Text
from orchestrator.engine.prompt_spec import PromptSpec
from protocol.fields import MAX_NAME_CHARS, MAX_PATH_CHARS, MAX_TEXT_CHARS

# queued -> encoding -> denoising -> decoding -> done, or failed / cancelled from any of them.
STAGES = ("encoding", "denoising", "decoding")          # the active states, in job-flow order
STATES = ("queued",) + STAGES + ("done", "failed", "cancelled")
FINISHED = ("done", "failed", "cancelled")
TRANSITIONS = {
    "queued": {"encoding", "denoising", "decoding", "failed", "cancelled"},  # a resumed job starts at its stage
    "encoding": {"denoising", "failed", "cancelled"},
    # back to an earlier stage when what that stage left in the job folder is unusable (a torn file after a power cut)
    "denoising": {"decoding", "encoding", "failed", "cancelled"},
    "decoding": {"done", "denoising", "encoding", "failed", "cancelled"},
    "failed": {"queued"},        # resume
    "cancelled": {"queued"},     # resume
    "done": set(),
}
JOB_ID_RE = re.compile(r"\A[0-9]{8}-[0-9]{6}-[0-9a-f]{6}\Z")    # \Z: `$` also matches before a final newline
MAX_HISTORY = 64                # state-change records kept per job
UNREADABLE = "unreadable"       # a listing's state for a record set aside: its job.json could not be read


JOB_ID = Annotated[str, Meta(pattern=JOB_ID_RE.pattern)]
TIME = Float(0.0, 1e11)                                 # unix seconds
NOTE_CHARS = MAX_TEXT_CHARS                             # a history note, a failure's message
ORIGIN = Mapping(Text(MAX_NAME_CHARS), Any, 64)        # SUBMIT's origin: {"api", "client_id", "graph", ...}
State = Literal[STATES]
Stage = Literal[STAGES]


class Job(Record, forbid_unknown_fields=False):
    """RUN/jobs/<id>/job.json: every field typed and bounded, checked when the file is read (a record that is not
    one is set aside by the store, never fatal) and when it is written. Not frozen: the store changes a copy
    (`JobStore.get`) and saves it, which checks it again (its spec's prompt rules once per spec: `spec_record`). Keys
    it does not know are ignored (a record written by another version still lists and runs)."""

    id: JOB_ID
    state: State
    spec: Mapping(Text(64, 1), Any, 64)                 # PromptSpec.to_dict(), seed resolved (checked: __post_init__)
    created: TIME
    updated: TIME
    start_at: Stage = "encoding"                        # the stage a dequeued job starts at (later ones after resume)
    failed_at: Stage | None = None                      # the stage that was running when it failed or was cancelled
    error: Mapping(Literal["stage", "message"], Text(NOTE_CHARS), 2) | None = None   # the last failure
    attempts: Mapping(Stage, Int(0, 2**31), 3) = {}     # stage -> times started
    cancel_requested: bool = False
    image: Text(MAX_PATH_CHARS, 1) | None = None
    report: Text(MAX_PATH_CHARS, 1) | None = None
    history: Annotated[list[tuple[State, TIME, Text(NOTE_CHARS)]], Meta(max_length=MAX_HISTORY)] = []
    origin: ORIGIN | None = None                        # where it came from

    def __post_init__(self):
        # a job still to run: its spec as its runner will read it (orchestrator.engine.plan.run), so a record it would refuse
        # is set aside when read, or refused when written (a resume), never met by the daemon when its turn comes.
        # A finished job's spec is only listed: parsing its prompt's weights at every read would make a listing's
        # cost grow with the prompts' length.
        if self.state in FINISHED:
            return
        try:
            self.prompt()
        except SchemaError as e:
            raise SchemaError(f"spec.{e.field}" if e.field else "spec", e.detail, e.code) from None

    def prompt(self) -> PromptSpec:
        """The job's prompt as the one prompt record (protocol/prompt.py); job.json keeps its data."""
        return spec_record(self.spec)

    @property
    def active(self) -> bool:
        return self.state in STAGES

    @classmethod
    def read(cls, text: str) -> "Job":
        """job.json's text as a record; ValueError (SchemaError naming the field and its range) otherwise."""
        return cls.from_data(json.loads(text))


CHECKED_MEMORY = 64             # specs kept with their checked record (a job's spec is read at each save of its record)
_checked: "OrderedDict[str, PromptSpec]" = OrderedDict()      # the spec's canonical JSON -> its record


def spec_record(spec: dict) -> PromptSpec:
    """A job's spec as its prompt record: checked the first time this content is met (a job.json read from disk, a
    spec written by hand), then that record again for the same content (a record is checked at every save, and its
    runner reads it): the rules run once per spec, not once per look."""
    try:
        key = json.dumps(spec, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):             # not JSON data: no key, checked as it is (and refused by job.json)
        return PromptSpec.from_dict(spec)
    record = _checked.get(key)
    if record is None:
        record = PromptSpec.from_dict(spec)
    remember(record, key)
    return record


def remember(spec: PromptSpec, key: str | None = None) -> dict:
    """Keep a checked spec (the daemon's resolved one) as its content's record -> its data for job.json."""
    data = spec.to_dict()
    key = key or json.dumps(data, sort_keys=True, ensure_ascii=False)
    _checked[key] = spec
    _checked.move_to_end(key)
    while len(_checked) > CHECKED_MEMORY:
        _checked.popitem(last=False)
    return data


def record_text(text: str) -> str:
    """Free text as a record keeps it: NULs escaped, length capped (a stage's message may carry the request's)."""
    return text.replace("\x00", "\\x00")[:NOTE_CHARS]


@dataclass(frozen=True)
class JobEntry:
    """What a listing shows of a job (STATUS), kept in memory for every job by the daemon's store."""
    id: str
    state: str
    created: float
    updated: float
    error_stage: str = ""
    error: str = ""                              # the last failure, or why a set-aside record could not be read
    image: str | None = None
    report: str | None = None

    @property
    def key(self) -> tuple[float, str]:
        return (self.created, self.id)

    @classmethod
    def of(cls, job: "Job") -> "JobEntry":
        err = job.error or {}
        return cls(id=job.id, state=job.state, created=job.created, updated=job.updated,
                   error_stage=err.get("stage", ""), error=err.get("message", ""), image=job.image,
                   report=job.report)


def info_of(entry: JobEntry, record: Job | None = None, *, position: int = 0, progress=None, denoise_pass=None):
    """What STATUS says of a job (protocol.messages.JobInfo): its index entry, and with `record` its spec and origin
    (each left out when too long for the wire). The daemon's answer and `orchestrator status JOB` reading the job
    folder when the daemon does not answer both say it this way."""
    from protocol import messages as m
    spec_json = origin = ""
    if record is not None:
        spec_json = json.dumps(record.spec, ensure_ascii=False)[:m.MAX_PROMPT_JSON_CHARS]
        origin = json.dumps(record.origin, ensure_ascii=False) if record.origin else ""
        origin = origin if len(origin) <= m.MAX_ORIGIN_CHARS else ""
    return m.JobInfo(job=entry.id, state=entry.state, created=entry.created, updated=entry.updated,
                     position=position, error_stage=entry.error_stage[:m.MAX_NAME_CHARS],
                     error=entry.error[:m.MAX_PATH_CHARS], image=entry.image, report=entry.report, progress=progress,
                     denoise_pass=denoise_pass, spec_json=spec_json, origin=origin)


def job_json(job: Job) -> str:
    """job.json's text, of a record checked again (the store changes records in place before it saves them)."""
    data = job.to_dict()
    Job.from_data(data)
    return json.dumps(data, indent=1, sort_keys=True)
