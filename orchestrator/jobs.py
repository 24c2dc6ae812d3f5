"""Durable job queue: one folder per job under RUN/jobs, job.json written then renamed at every state change."""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# queued -> encoding -> denoising -> decoding -> done, or failed / cancelled from any of them.
STAGES = ("encoding", "denoising", "decoding")          # the active states, in job-flow order
STATES = ("queued",) + STAGES + ("done", "failed", "cancelled")
FINISHED = ("done", "failed", "cancelled")
TRANSITIONS = {
    "queued": {"encoding", "denoising", "decoding", "failed", "cancelled"},  # a resumed job starts at its stage
    "encoding": {"denoising", "failed", "cancelled"},
    "denoising": {"decoding", "failed", "cancelled"},
    "decoding": {"done", "failed", "cancelled"},
    "failed": {"queued"},        # resume
    "cancelled": {"queued"},     # resume
    "done": set(),
}
JOB_ID_RE = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9a-f]{6}$")
DEFAULT_MAX_QUEUE = 16          # queued + running jobs
DEFAULT_MIN_FREE_MB = 64        # free disk space needed to accept a job
MAX_HISTORY = 64                # state-change records kept per job


class JobError(Exception):
    """A request the queue refuses (unknown job, bad transition, queue full, disk full): the message is the answer."""


class QueueFull(JobError):
    pass


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


def _write_json_atomic(path: Path, obj) -> None:
    """Write-then-rename with fsync, so a crash leaves either the old or the new file, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class JobStore:
    """The queue on disk. One writer (the daemon); readers may open their own store on the same folder."""

    def __init__(self, run_dir: str | os.PathLike, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 min_free_mb: float = DEFAULT_MIN_FREE_MB):
        self.root = Path(run_dir) / "jobs"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_queue = max_queue
        self.min_free_mb = min_free_mb

    # ------------------------------------------------------------ reading

    def job_dir(self, job_id: str) -> Path:
        if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
            raise JobError(f"job id {job_id!r} is not a job id (like 20260101-120000-a1b2c3)")
        return self.root / job_id

    def get(self, job_id: str) -> Job:
        path = self.job_dir(job_id) / "job.json"
        try:
            return Job.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise JobError(f"no job {job_id} in {self.root}") from None
        except (ValueError, TypeError) as e:
            raise JobError(f"job {job_id}: unreadable {path}: {e}") from None

    def list(self) -> list[Job]:
        """Every readable job, oldest first (by creation time: ids order by the second only, so two jobs of one
        second would otherwise run in random order); unreadable ones are logged and skipped."""
        jobs = []
        for d in self.root.iterdir():
            if not (d.is_dir() and JOB_ID_RE.match(d.name)):
                continue
            try:
                jobs.append(self.get(d.name))
            except JobError as e:
                log.warning("skipping %s", e)
        return sorted(jobs, key=lambda j: (j.created, j.id))

    def pending(self) -> list[Job]:
        return [j for j in self.list() if j.state == "queued" or j.active]

    def next_job(self) -> Job | None:
        """The job to work on: one already running (after a restart) first, else the oldest queued one."""
        jobs = self.pending()
        running = [j for j in jobs if j.active]
        if running:
            return running[0]
        return jobs[0] if jobs else None

    # ------------------------------------------------------------ writing

    def save(self, job: Job) -> Job:
        job.updated = time.time()
        _write_json_atomic(self.job_dir(job.id) / "job.json", job.to_dict())
        return job

    def submit(self, spec: dict, origin: dict | None = None) -> Job:
        """Queue a validated spec (PromptSpec.to_dict()); refuses when the queue is full or the disk is short."""
        self._check_room()
        now = time.time()
        for _ in range(8):
            job_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + secrets.token_hex(3)
            d = self.job_dir(job_id)
            try:
                d.mkdir(mode=0o700)
                break
            except FileExistsError:
                continue
        else:
            raise JobError("could not allocate a job id")
        job = Job(id=job_id, state="queued", spec=dict(spec), created=now, updated=now,
                  history=[["queued", now, "submitted"]], origin=origin)
        log.info("job %s queued", job_id)
        return self.save(job)

    def transition(self, job_id: str, state: str, note: str = "", **fields) -> Job:
        job = self.get(job_id)
        if state not in TRANSITIONS[job.state]:
            raise JobError(f"job {job_id} is {job.state}; it cannot become {state}")
        if state in STAGES:
            job.attempts[state] = job.attempts.get(state, 0) + 1
        if state in ("failed", "cancelled"):
            job.failed_at = job.state if job.state in STAGES else job.start_at
        for k, v in fields.items():
            if k not in Job.__dataclass_fields__ or k in ("id", "state", "created"):
                raise JobError(f"job field {k!r} cannot be set")
            setattr(job, k, v)
        job.state = state
        job.history = (job.history + [[state, time.time(), note]])[-MAX_HISTORY:]
        log.info("job %s -> %s %s", job_id, state, note)
        return self.save(job)

    def fail(self, job_id: str, stage: str, message: str) -> Job:
        return self.transition(job_id, "failed", message, error={"stage": stage, "message": message})

    def cancel(self, job_id: str) -> Job:
        """A queued job is cancelled at once; a running one is flagged for the daemon to stop at its next check."""
        job = self.get(job_id)
        if job.state == "queued":
            return self.transition(job_id, "cancelled", "cancelled while queued")
        if job.active:
            job.cancel_requested = True
            return self.save(job)
        raise JobError(f"job {job_id} is already {job.state}")

    def resume(self, job_id: str) -> Job:
        """Queue a failed or cancelled job again; it restarts at the stage it stopped in, its folder kept as is."""
        job = self.get(job_id)
        if job.state not in ("failed", "cancelled"):
            raise JobError(f"job {job_id} is {job.state}; only failed or cancelled jobs can be resumed")
        self._check_room()
        return self.transition(job_id, "queued", f"resumed at {job.failed_at or 'encoding'}",
                               start_at=job.failed_at or "encoding", cancel_requested=False, attempts={})

    def recover(self) -> list[Job]:
        """At start-up: clean torn temp files; keep at most one running job, send the others back to the queue."""
        for tmp in self.root.glob("*/job.json.tmp"):
            tmp.unlink(missing_ok=True)
        running = [j for j in self.list() if j.active]
        for extra in running[1:]:
            log.warning("job %s was %s next to %s; queued again", extra.id, extra.state, running[0].id)
            extra.history.append(["queued", time.time(), f"requeued at {extra.state} after restart"])
            extra.start_at, extra.state = extra.state, "queued"
            self.save(extra)
        return running[:1]

    def _check_room(self) -> None:
        n = len(self.pending())
        if n >= self.max_queue:
            raise QueueFull(f"the queue is full ({n} queued or running jobs; the limit is {self.max_queue})")
        free_mb = shutil.disk_usage(self.root).free / 2**20
        if free_mb < self.min_free_mb:
            raise JobError(f"only {free_mb:.0f} MB free in {self.root}; at least {self.min_free_mb:.0f} MB needed")
