"""Durable job queue: one folder per job under RUN/jobs, job.json written durably (models.durable.atomic_write) at every
state change. A job folder appears whole (made under a hidden name with its first job.json, then renamed) and goes
whole (renamed aside, then removed), so a crash never leaves a job folder without its record."""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from models.durable import atomic_write, fsync_dir, remove_stale_temporaries

log = logging.getLogger(__name__)

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
JOB_ID_RE = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9a-f]{6}$")
DEFAULT_MAX_QUEUE = 16          # queued + running jobs
DEFAULT_MIN_FREE_MB = 64        # free disk space needed to accept a job
MAX_HISTORY = 64                # state-change records kept per job
JOB_FILE = "job.json"
NEW_PREFIX = ".new-"            # a job folder being made (hidden; renamed to its id with its first job.json inside)
GONE_PREFIX = ".gone-"          # a job folder being removed (renamed aside first, then deleted)
# files only the daemon writes in a job folder: their temporaries are stale whenever a daemon starts
DAEMON_FILES = (JOB_FILE, "text.json", "cond.npy", "uncond.npy", "latent.npy", "report.json")
LEGACY_SUFFIXES = (".tmp", ".tmp.npy", ".new")   # write-then-rename names used before models.durable
STALE_TEMP_S = 600.0            # a stage's temporary this old (or older than the boot) is not being written


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


def _job_json(job: "Job") -> str:
    return json.dumps(job.to_dict(), indent=1, sort_keys=True)


def parse_age(text: str) -> float:
    """'7d', '12h', '30m', '45s' (or a bare number of seconds) -> seconds; ValueError naming the text otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([dhms]?)\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not an age like 7d, 12h, 30m or 45s")
    return float(m.group(1)) * {"d": 86400, "h": 3600, "m": 60, "s": 1, "": 1}[m.group(2)]


class JobStore:
    """The queue on disk. One writer (the daemon); readers may open their own store on the same folder.

    `cached=True` (the daemon, the single writer): the records are read once, at the first look or at `recover()`,
    and kept in memory; every change is written through to disk first. Without it every look reads job.json again
    (a reader beside a running daemon sees its latest writes)."""

    def __init__(self, run_dir: str | os.PathLike, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 min_free_mb: float = DEFAULT_MIN_FREE_MB, cached: bool = False):
        self.root = Path(run_dir) / "jobs"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_queue = max_queue
        self.min_free_mb = min_free_mb
        self.cached = cached
        self._jobs: dict[str, Job] | None = None        # id -> record (cached mode)
        self._unreadable: dict[str, str] = {}           # id -> why its job.json could not be read (cached mode)

    # ------------------------------------------------------------ reading

    def job_dir(self, job_id: str) -> Path:
        if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
            raise JobError(f"job id {job_id!r} is not a job id (like 20260101-120000-a1b2c3)")
        return self.root / job_id

    def _read(self, job_id: str) -> Job:
        path = self.job_dir(job_id) / JOB_FILE
        try:
            job = Job.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise JobError(f"no job {job_id} in {self.root}") from None
        except (ValueError, TypeError, OSError) as e:
            raise JobError(f"job {job_id}: unreadable {path}: {e}") from None
        if job.id != job_id:
            raise JobError(f"job {job_id}: unreadable {path}: it records job {job.id}")
        return job

    def _job_ids(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.root) if JOB_ID_RE.match(e.name)
                      and e.is_dir(follow_symlinks=False))

    def _load(self) -> dict[str, Job]:
        if self._jobs is None:
            self._jobs, self._unreadable = {}, {}
            for job_id in self._job_ids():
                try:
                    self._jobs[job_id] = self._read(job_id)
                except JobError as e:
                    log.warning("skipping %s", e)
                    self._unreadable[job_id] = str(e)
        return self._jobs

    def get(self, job_id: str) -> Job:
        if not self.cached:
            return self._read(job_id)
        self.job_dir(job_id)                             # the id check
        jobs = self._load()
        if job_id in jobs:
            return copy.deepcopy(jobs[job_id])           # callers change their copy; save() writes it through
        raise JobError(self._unreadable.get(job_id, f"no job {job_id} in {self.root}"))

    def list(self, where=None) -> list[Job]:
        """Every readable job (for which `where(job)` holds), oldest first (by creation time: ids alone tell only the
        second, and two jobs queued within one second must still run in order); unreadable ones are logged, skipped."""
        if self.cached:
            jobs = [copy.deepcopy(j) for j in self._load().values() if where is None or where(j)]
        else:
            jobs = []
            for job_id in self._job_ids():
                try:
                    jobs.append(self._read(job_id))
                except JobError as e:
                    log.warning("skipping %s", e)
        if where is not None and not self.cached:
            jobs = [j for j in jobs if where(j)]
        return sorted(jobs, key=lambda j: (j.created, j.id))

    def pending(self) -> list[Job]:
        return self.list(lambda j: j.state == "queued" or j.active)

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
        atomic_write(self.job_dir(job.id) / JOB_FILE, _job_json(job))
        if self.cached:
            self._load()[job.id] = copy.deepcopy(job)
            self._unreadable.pop(job.id, None)
        return job

    def submit(self, spec: dict, origin: dict | None = None) -> Job:
        """Queue a validated spec (PromptSpec.to_dict()); refuses when the queue is full or the disk is short.
        The folder is made under a hidden name with its job.json, then renamed: it never exists without its record."""
        self._check_room()
        now = time.time()
        tmp = Path(tempfile.mkdtemp(prefix=NEW_PREFIX, dir=self.root))          # 0700
        try:
            for _ in range(8):
                job_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + secrets.token_hex(3)
                job = Job(id=job_id, state="queued", spec=dict(spec), created=now, updated=now,
                          history=[["queued", now, "submitted"]], origin=origin)
                atomic_write(tmp / JOB_FILE, _job_json(job))
                if os.path.lexists(self.job_dir(job_id)):
                    continue
                try:
                    os.rename(tmp, self.job_dir(job_id))                         # an empty folder would be replaced,
                    break                                                         # hence the look just before
                except OSError:
                    if not os.path.lexists(self.job_dir(job_id)):
                        raise
            else:
                raise JobError("could not allocate a job id")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.root)
        if self.cached:
            self._load()[job_id] = copy.deepcopy(job)
        log.info("job %s queued", job_id)
        return job

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

    def remove(self, job_id: str) -> Job:
        """Delete a finished job's folder: renamed aside first (a crash leaves a hidden folder, never half a job)."""
        job = self.get(job_id)
        if job.state not in FINISHED:
            raise JobError(f"job {job_id} is {job.state}; only finished jobs (done, failed, cancelled) are removed")
        aside = Path(tempfile.mkdtemp(prefix=GONE_PREFIX, dir=self.root))
        os.rename(self.job_dir(job_id), aside / job_id)
        fsync_dir(self.root)
        if self.cached:
            self._load().pop(job_id, None)
        shutil.rmtree(aside, ignore_errors=True)
        log.info("job %s removed", job_id)
        return job

    def prune(self, *, keep: int | None = None, older_than_s: float | None = None,
              now: float | None = None) -> list[Job]:
        """Remove finished jobs (done, failed, cancelled; never a queued or running one): all but the `keep` newest,
        and/or those finished more than `older_than_s` ago. -> the removed jobs, oldest first."""
        if keep is None and older_than_s is None:
            raise JobError("prune needs --keep N or --older-than AGE")
        now = time.time() if now is None else now
        finished = [j for j in self.list() if j.state in FINISHED]
        doomed = {j.id for j in finished[:max(0, len(finished) - keep)]} if keep is not None else set()
        if older_than_s is not None:
            doomed |= {j.id for j in finished if now - j.updated > older_than_s}
        return [self.remove(j.id) for j in finished if j.id in doomed]

    def recover(self) -> list[Job]:
        """At start-up: remove what a crash left (temporaries, half-made or half-removed job folders); keep at most
        one running job and send the others back to the queue."""
        self.clean()
        self._jobs = None                                 # read every record afresh
        running = [j for j in self.list() if j.active]
        for extra in running[1:]:
            log.warning("job %s was %s next to %s; queued again", extra.id, extra.state, running[0].id)
            extra.history.append(["queued", time.time(), f"requeued at {extra.state} after restart"])
            extra.start_at, extra.state = extra.state, "queued"
            self.save(extra)
        return running[:1]

    def clean(self) -> list[Path]:
        """Remove a crash's leftovers: folders being made or removed, job folders with no job.json and nothing but
        temporaries in them, and stale temporaries inside job folders. -> what was removed."""
        removed = remove_stale_temporaries(self.root)
        stage_age_s = _stage_temporary_age_s()
        for e in list(os.scandir(self.root)):
            path = Path(e.path)
            if not e.is_dir(follow_symlinks=False):
                continue
            if e.name.startswith((NEW_PREFIX, GONE_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                continue
            if not JOB_ID_RE.match(e.name):
                continue
            # the daemon's own temporaries always (one daemon runs, and it is starting); a stage's (the sampler
            # state, image.png) only when stale, since a stage may still be finishing a dead daemon's request
            removed += remove_stale_temporaries(path, targets=lambda name: name in DAEMON_FILES)
            removed += remove_stale_temporaries(path, stage_age_s)
            removed += _remove_legacy_temporaries(path, time.time() - stage_age_s)
            if not (path / JOB_FILE).exists():
                if any(path.iterdir()):
                    log.warning("job folder %s has no %s but other files; left as it is", path, JOB_FILE)
                else:                                    # mkdir, then a crash before the first record
                    path.rmdir()
                    removed.append(path)
        if removed:
            fsync_dir(self.root)
            log.info("removed what a crash left: %s", ", ".join(str(p.relative_to(self.root)) for p in removed))
        return removed

    def _check_room(self) -> None:
        n = len(self.pending())
        if n >= self.max_queue:
            raise QueueFull(f"the queue is full ({n} queued or running jobs; the limit is {self.max_queue})")
        free_mb = shutil.disk_usage(self.root).free / 2**20
        if free_mb < self.min_free_mb:
            raise JobError(f"only {free_mb:.0f} MB free in {self.root}; at least {self.min_free_mb:.0f} MB needed")


def _stage_temporary_age_s() -> float:
    """A stage's temporary is stale when written before this boot, or STALE_TEMP_S ago (whichever is sooner)."""
    try:
        import psutil
        uptime_s = time.time() - psutil.boot_time()
    except Exception:  # noqa: BLE001 - no boot time: the age alone decides
        uptime_s = STALE_TEMP_S
    return max(0.0, min(uptime_s, STALE_TEMP_S))


def _remove_legacy_temporaries(folder: Path, cutoff: float) -> list[Path]:
    """Write-then-rename leftovers of versions before models.durable ("job.json.tmp", "cond.npy.tmp.npy",
    "sampler_state.safetensors.new"): the daemon's own always, a stage's when older than `cutoff` (unix time)."""
    removed = []
    for e in os.scandir(folder):
        if e.name.startswith(".") or not e.name.endswith(LEGACY_SUFFIXES) or not e.is_file(follow_symlinks=False):
            continue
        mine = any(e.name.startswith(f + ".") for f in DAEMON_FILES)
        try:
            if mine or e.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(e.path)
                removed.append(Path(e.path))
        except FileNotFoundError:
            pass
    return removed
