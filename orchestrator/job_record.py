"""A job's record (RUN/jobs/<id>/job.json, `Job`) and what a listing keeps of it (`JobEntry`): the states a job goes
through and the ids it has. The store (orchestrator.jobs) reads, writes and lists them."""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

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


@dataclass
class Job:
    id: str
    state: str
    spec: dict                                   # PromptSpec.to_dict(), seed already resolved
    created: float
    updated: float
    start_at: str = "encoding"                   # the stage a dequeued job starts at (later ones after `resume`)
    failed_at: str | None = None                 # the stage that was running when it failed or was cancelled
    error: dict | None = None                    # {"stage": ..., "message": ...} of the last failure
    attempts: dict = field(default_factory=dict)  # stage -> times started
    cancel_requested: bool = False
    image: str | None = None
    report: str | None = None
    history: list = field(default_factory=list)  # [[state, unix time, note], ...]
    origin: dict | None = None                   # where it came from (SUBMIT origin: api, client id, graph)

    @property
    def active(self) -> bool:
        return self.state in STAGES

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        job = cls(**known)
        if job.state not in STATES or not JOB_ID_RE.match(job.id) or not isinstance(job.spec, dict):
            raise ValueError(f"bad job record: id={job.id!r} state={job.state!r}")
        return job


def _text(value, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name}: expected a string, got {type(value).__name__}")
    return value


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}"[:200])
    return float(value)


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
        """TypeError/ValueError when a field a listing sorts or shows does not convert."""
        err = job.error if job.error is not None else {}
        if not isinstance(err, dict):
            raise TypeError(f"error: expected a map, got {type(err).__name__}")
        return cls(id=job.id, state=job.state, created=_number(job.created, "created"),
                   updated=_number(job.updated, "updated"), error_stage=str(err.get("stage", "")),
                   error=str(err.get("message", "")), image=_text(job.image, "image"),
                   report=_text(job.report, "report"))


def job_json(job: Job) -> str:
    """job.json's text."""
    return json.dumps(job.to_dict(), indent=1, sort_keys=True)
