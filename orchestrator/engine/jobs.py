"""Durable job queue: one folder per job under RUN/jobs, job.json written durably (models.base.durable.atomic_write) at every
state change. A job folder appears whole (made under a hidden name with its first job.json, then renamed) and goes
whole (renamed aside, then removed), so a crash never leaves a job folder without its record."""
from __future__ import annotations

import bisect
import copy
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from models.base.durable import atomic_write, fsync_dir, remove_stale_temporaries
from models.base.schema import SchemaError
from orchestrator.engine.inputs import keep_in_job
from orchestrator.engine.job_files import DAEMON_FILES, JOB_FILE
from orchestrator.engine.job_record import (FINISHED, JOB_ID_RE, MAX_HISTORY, STAGES, TRANSITIONS, UNREADABLE, Job,
                                     JobEntry, job_json, record_text)

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 16          # queued + running jobs
DEFAULT_MIN_FREE_MB = 64        # free disk space needed to accept a job
NEW_PREFIX = ".new-"            # a job folder being made (hidden; renamed to its id with its first job.json inside)
GONE_PREFIX = ".gone-"          # a job folder being removed (renamed aside first, then deleted)
LEGACY_SUFFIXES = (".tmp", ".tmp.npy", ".new")   # write-then-rename names used before models.base.durable
STALE_TEMP_S = 600.0            # a stage's temporary this old (or older than the boot) is not being written


class JobError(Exception):
    """A request the queue refuses (unknown job, bad transition, queue full, disk full): the message is the answer."""


class QueueFull(JobError):
    pass


def parse_age(text: str) -> float:
    """'7d', '12h', '30m', '45s' (or a bare number of seconds) -> seconds; ValueError naming the text otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([dhms]?)\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not an age like 7d, 12h, 30m or 45s")
    return float(m.group(1)) * {"d": 86400, "h": 3600, "m": 60, "s": 1, "": 1}[m.group(2)]


class JobStore:
    """The queue on disk. One writer (the daemon); readers may open their own store on the same folder.

    `cached=True` (the daemon, the single writer): the records are read once, at the first look or at `recover()`;
    every change is written through to disk first. In memory stay an index entry of every job (JobEntry: what a
    listing shows, in creation order) and the whole records of the queued and running jobs only: a finished job's
    record is read from its file when asked for, so the daemon's memory and a listing's cost do not grow with the
    finished jobs. Without `cached` every look reads job.json again (a reader beside a running daemon sees its
    latest writes). A record that cannot be read is set aside: logged, left on disk, listed as UNREADABLE with why."""

    def __init__(self, run_dir: str | os.PathLike, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 min_free_mb: float = DEFAULT_MIN_FREE_MB, cached: bool = False):
        self.root = Path(run_dir) / "jobs"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_queue = max_queue
        self.min_free_mb = min_free_mb
        self.cached = cached
        self._index: dict[str, JobEntry] | None = None  # id -> entry of every job, set-aside ones too (cached mode)
        self._keys: list[tuple[float, str]] = []        # (created, id) of the index, sorted: the listing order
        self._live: dict[str, Job] = {}                 # id -> record of a queued or running job (cached mode)

    # ------------------------------------------------------------ reading

    def job_dir(self, job_id: str) -> Path:
        if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
            raise JobError(f"job id {job_id!r} is not a job id (like 20260101-120000-a1b2c3)")
        return self.root / job_id

    def _read(self, job_id: str) -> tuple[Job, JobEntry]:
        path = self.job_dir(job_id) / JOB_FILE
        try:
            job = Job.read(path.read_text(encoding="utf-8"))     # every field's type and range checked
        except FileNotFoundError:
            raise JobError(f"no job {job_id} in {self.root}") from None
        except (ValueError, OSError) as e:               # SchemaError, bad JSON, not UTF-8, unreadable
            raise JobError(f"job {job_id}: unreadable {path}: {e}") from None
        if job.id != job_id:
            raise JobError(f"job {job_id}: unreadable {path}: it records job {job.id}")
        return job, JobEntry.of(job)

    def _job_ids(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.root) if JOB_ID_RE.match(e.name)
                      and e.is_dir(follow_symlinks=False))

    def _set_aside(self, job_id: str, why: str) -> JobEntry:
        log.warning("job record set aside (left on disk; fix or remove its folder): %s", why)
        try:
            mtime = os.stat(self.job_dir(job_id)).st_mtime
        except OSError:
            mtime = 0.0
        return JobEntry(id=job_id, state=UNREADABLE, created=mtime, updated=mtime, error=why)

    def _scan(self) -> tuple[dict[str, JobEntry], dict[str, Job]]:
        """Every job.json read: the entries of all jobs, the records of the queued and running ones."""
        index, live = {}, {}
        for job_id in self._job_ids():
            try:
                job, index[job_id] = self._read(job_id)
            except JobError as e:
                index[job_id] = self._set_aside(job_id, str(e))
                continue
            if job.state not in FINISHED:
                live[job_id] = job
        return index, live

    def _load(self) -> tuple[dict[str, JobEntry], dict[str, Job], list[tuple[float, str]]]:
        """(entries, live records, sorted keys): the cache (cached mode), else a fresh scan."""
        if not self.cached:
            index, live = self._scan()
            return index, live, sorted(e.key for e in index.values())
        if self._index is None:
            self._index, self._live = self._scan()
            self._keys = sorted(e.key for e in self._index.values())
        return self._index, self._live, self._keys

    def view(self, job_id: str) -> Job:
        """A job's record for reading only (never change it; `get` gives a copy to change): a queued or running one
        as kept in memory, a finished one read from its file. JobError when there is none or it cannot be read."""
        self.job_dir(job_id)                             # the id check
        if not self.cached:
            return self._read(job_id)[0]
        index, live, _ = self._load()
        if job_id in live:
            return live[job_id]
        entry = index.get(job_id)
        if entry is None:
            raise JobError(f"no job {job_id} in {self.root}")
        if entry.state == UNREADABLE:
            raise JobError(entry.error)
        try:
            return self._read(job_id)[0]
        except JobError as e:                            # changed on disk behind the daemon's back
            self._index[job_id] = self._set_aside(job_id, str(e))
            raise

    def get(self, job_id: str) -> Job:
        """A copy of the job's record (the caller may change it; `save` writes it through)."""
        job = self.view(job_id)
        return copy.deepcopy(job) if self.cached and job_id in self._live else job

    def entries(self, *, active: bool = False, before: str | None = None,
                limit: int | None = None) -> tuple[list[JobEntry], bool]:
        """The newest `limit` entries (queued and running jobs only with `active`; only jobs older than job `before`),
        oldest first (by creation time: ids tell only the second), and whether older ones matched too. Set-aside
        records are listed (state UNREADABLE) unless `active`. Costs no more for many finished jobs: no record is
        read or copied."""
        index, live, keys = self._load()
        if active:
            keys = sorted(index[i].key for i in live)
        end = len(keys)
        if before is not None:
            if before in index and (not active or before in live):
                end = bisect.bisect_left(keys, index[before].key)
            else:                                        # the cursor job is gone: ids are ordered by the second
                end = sum(1 for _, i in keys if i < before)
        start = 0 if not limit else max(0, end - limit)
        return [index[i] for _, i in keys[start:end]], start > 0

    def list(self, where=None) -> list[Job]:
        """Every readable job's record (for which `where(job)` holds), oldest first; set-aside ones are left out. Reads
        every finished record: a reader's look (the daemon lists `entries`)."""
        jobs = []
        for entry in self.entries()[0]:
            if entry.state == UNREADABLE:
                continue
            try:
                job = self.view(entry.id)
            except JobError:
                continue
            if where is None or where(job):
                jobs.append(job)
        return jobs

    def pending(self) -> list[Job]:
        """The queued and running jobs' records, oldest first (read-only, as `view`)."""
        index, live, _ = self._load()
        return [live[i] for _, i in sorted(index[i].key for i in live)]

    def next_job(self) -> Job | None:
        """The job to work on: one already running (after a restart) first, else the oldest queued one."""
        jobs = self.pending()
        running = [j for j in jobs if j.active]
        if running:
            return running[0]
        return jobs[0] if jobs else None

    # ------------------------------------------------------------ writing

    def _keep(self, job: Job) -> None:
        """Cached mode: the index and the live records after `job` was written."""
        if not self.cached or self._index is None:
            return
        entry = JobEntry.of(job)
        if job.id not in self._index:
            bisect.insort(self._keys, entry.key)
        self._index[job.id] = entry
        if job.state in FINISHED:
            self._live.pop(job.id, None)
        else:
            self._live[job.id] = copy.deepcopy(job)

    def save(self, job: Job) -> Job:
        """Write a changed record through; JobError (naming the field) when it is no longer a record, e.g. a job
        resumed whose spec its flow would refuse: nothing is written."""
        job.updated = time.time()
        try:
            text = job_json(job)
        except SchemaError as e:
            raise JobError(f"job {job.id}: not saved: {e}") from None
        atomic_write(self.job_dir(job.id) / JOB_FILE, text)
        self._keep(job)
        return job

    def submit(self, spec: dict, origin: dict | None = None, inputs: dict[str, bytes] | None = None) -> Job:
        """Queue a validated spec (PromptSpec.to_dict()); refuses when the queue is full or the disk is short.
        The folder is made under a hidden name with its job.json and its input images (`inputs`: init_image, mask ->
        PNG bytes, orchestrator.engine.inputs.keep_in_job), then renamed: it never exists without its record and inputs."""
        self._check_room()
        now = time.time()
        tmp = Path(tempfile.mkdtemp(prefix=NEW_PREFIX, dir=self.root))          # 0700
        try:
            if inputs:
                keep_in_job(tmp, inputs)
            for _ in range(8):
                job_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + secrets.token_hex(3)
                job = Job(id=job_id, state="queued", spec=dict(spec), created=now, updated=now,
                          history=[["queued", now, "submitted"]], origin=origin)
                atomic_write(tmp / JOB_FILE, job_json(job))
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
        self._keep(job)
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
            if k not in Job.__struct_fields__ or k in ("id", "state", "created"):
                raise JobError(f"job field {k!r} cannot be set")
            setattr(job, k, v)
        job.state = state
        job.history = (job.history + [(state, time.time(), record_text(note))])[-MAX_HISTORY:]
        log.info("job %s -> %s %s", job_id, state, note)
        return self.save(job)

    def fail(self, job_id: str, stage: str, message: str) -> Job:
        message = record_text(message)
        return self.transition(job_id, "failed", message, error={"stage": record_text(stage), "message": message})

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

    def remove(self, job_id: str) -> JobEntry:
        """Delete a finished job's folder: renamed aside first (a crash leaves a hidden folder, never half a job)."""
        self.job_dir(job_id)
        index, _, keys = self._load()
        entry = index.get(job_id)
        if entry is None or entry.state == UNREADABLE:
            self.view(job_id)                            # the JobError that says why
        if entry.state not in FINISHED:
            raise JobError(f"job {job_id} is {entry.state}; only finished jobs (done, failed, cancelled) are removed")
        aside = Path(tempfile.mkdtemp(prefix=GONE_PREFIX, dir=self.root))
        os.rename(self.job_dir(job_id), aside / job_id)
        fsync_dir(self.root)
        if self.cached:
            del self._index[job_id]
            del keys[bisect.bisect_left(keys, entry.key)]
        shutil.rmtree(aside, ignore_errors=True)
        log.info("job %s removed", job_id)
        return entry

    def prunable(self, *, keep: int | None = None, older_than_s: float | None = None,
                 now: float | None = None) -> list[JobEntry]:
        """The finished jobs (done, failed, cancelled; never a queued or running one) `prune` would remove: all but
        the `keep` newest, and/or those finished more than `older_than_s` ago; oldest first."""
        if keep is None and older_than_s is None:
            raise JobError("prune needs --keep N or --older-than AGE")
        now = time.time() if now is None else now
        finished = [e for e in self.entries()[0] if e.state in FINISHED]
        doomed = {e.id for e in finished[:max(0, len(finished) - keep)]} if keep is not None else set()
        if older_than_s is not None:
            doomed |= {e.id for e in finished if now - e.updated > older_than_s}
        return [e for e in finished if e.id in doomed]

    def prune(self, *, keep: int | None = None, older_than_s: float | None = None, now: float | None = None,
              max_jobs: int | None = None, max_s: float | None = None) -> list[JobEntry]:
        """Remove what `prunable` names, oldest first, stopping after `max_jobs` of them or `max_s` seconds (a
        request must not outlast its client's timeout; `prunable` says what is left). -> the removed jobs."""
        t0, removed = time.monotonic(), []
        for entry in self.prunable(keep=keep, older_than_s=older_than_s, now=now):
            if (max_jobs is not None and len(removed) >= max_jobs) or (
                    max_s is not None and removed and time.monotonic() - t0 > max_s):
                break
            removed.append(self.remove(entry.id))
        return removed

    def recover(self) -> list[Job]:
        """At start-up: remove what a crash left (temporaries, half-made or half-removed job folders); keep at most
        one running job and send the others back to the queue."""
        self.clean()
        self._index = None                                # read every record afresh
        running = [j for j in self.pending() if j.active]
        for extra in running[1:]:
            extra = self.get(extra.id)
            log.warning("job %s was %s next to %s; queued again", extra.id, extra.state, running[0].id)
            extra.history.append(("queued", time.time(), f"requeued at {extra.state} after restart"))
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
            for sub in [*path.glob("batch_*"), path / "hires", *path.glob("hires_*")]:   # a batch image's, a hires
                # pass's sampler state (hires_N/: a batch image's second pass)
                if sub.is_dir() and not sub.is_symlink():
                    removed += remove_stale_temporaries(sub, stage_age_s)
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
    """Write-then-rename leftovers of versions before models.base.durable ("job.json.tmp", "cond.npy.tmp.npy",
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
