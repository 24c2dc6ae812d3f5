"""The daemon's jobs as the front sees them, and their changes as WebSocket messages.

The front keeps no queue: every `poll_s` (while a job is followed or a WebSocket client listens) it asks the daemon
for the queued and running jobs (STATUS active, detail, every page of it) and turns what changed into ComfyUI's
messages (to the client that submitted the job) and `anima.progress` / `anima.job` (to every client: the page shows
any job).
A job that leaves the active set is asked for once more to learn how it ended. A prompt of several independent
chains (one job each, orchestrator/http/comfy_prompt.py) is announced as one: started by its first job, ended by its
last, or by a chain that fails or is interrupted, whose later chains are then cancelled without a word (ComfyUI runs
nothing of a prompt after a node's error).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from orchestrator.http.comfy_nodes import ModelNames
from orchestrator.http import comfy_shapes as shapes
from orchestrator.http.hub import Hub
from orchestrator.http.link import DaemonDown, DaemonLink, DaemonRefused
from orchestrator.http.views import JobView, model_names
from protocol import messages as m

log = logging.getLogger(__name__)

IDLE_REFRESH_S = 5.0            # nothing followed and nobody listening: look this seldom


class JobGone(Exception):
    """A waited-for job left the daemon's store (pruned, or its record set aside) before its end was seen."""


class Tracker:
    def __init__(self, link: DaemonLink, hub: Hub, poll_s: float, loras=None):
        self.link, self.hub, self.poll_s = link, hub, poll_s
        self.loras = loras                           # orchestrator.engine.loras.LoraListing of the run's models folder
        self.pipeline: m.Pipeline | None = None
        self.active: dict[str, JobView] = {}         # queued and running, oldest first (the last STATUS)
        self.followed: dict[str, JobView | None] = {}  # jobs whose end is still to be announced -> last view
        self.waiters: dict[str, list[asyncio.Future]] = {}
        self.silenced: set[str] = set()              # jobs of a prompt that ended early: their end is not announced
        self.refreshed_at = 0.0
        self.remaining = 0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        hub.on_connect = self.greeting

    # ------------------------------------------------------------ what handlers ask

    async def info(self, fresh: bool = False) -> m.Pipeline:
        """The daemon's INFO, asked once (with `fresh`, again: DaemonDown when it does not answer)."""
        if self.pipeline is None or fresh:
            self.pipeline = await self.link.call(m.Info(), m.Pipeline)
        return self.pipeline

    async def names(self) -> ModelNames:
        """The loader file names: the daemon's (asked once), with the LoRAs as MODELS/loras/ is now (a file added
        after the front started is listed and may be named)."""
        try:
            names = model_names(await self.info())
        except DaemonDown:
            return ModelNames()
        if self.loras is None:
            return names
        loras = await asyncio.to_thread(self.loras.names)
        return dataclasses.replace(names, lora=tuple(loras[:m.MAX_LORAS_LISTED]))

    async def fresh(self, max_age_s: float | None = None) -> dict[str, JobView]:
        """The active jobs, refreshed when older than `max_age_s` (default poll_s)."""
        if time.monotonic() - self.refreshed_at > (self.poll_s if max_age_s is None else max_age_s):
            await self.refresh()
        return self.active

    def running(self) -> JobView | None:
        return next((j for j in self.active.values() if j.running), None)

    def follow(self, job_id: str) -> None:
        """A job submitted here: its end is announced even when it runs and ends between two looks."""
        self.followed.setdefault(job_id, None)

    async def wait(self, job_id: str) -> JobView:
        """The job's final view (done, failed or cancelled); JobGone when it went before its end was seen."""
        fut = asyncio.get_running_loop().create_future()
        self.waiters.setdefault(job_id, []).append(fut)
        self.follow(job_id)
        try:
            return await fut
        finally:
            futs = self.waiters.get(job_id, [])
            if fut in futs:
                futs.remove(fut)
            if not futs:
                self.waiters.pop(job_id, None)

    async def greeting(self, sid: str) -> list[tuple[str, dict]]:
        """The first messages of a WebSocket client: `status` (with its sid), as ComfyUI sends."""
        try:
            await self.fresh()
        except DaemonDown:
            pass
        return [("status", {**shapes.status(self.queue_remaining()), "sid": sid})]

    def queue_remaining(self) -> int:
        """ComfyUI's count: prompts queued or running (a prompt's chains are one)."""
        jobs = {j: self.active.get(j) for j in self.active}
        jobs.update({j: v for j, v in self.followed.items() if j not in jobs and (v is None or not v.finished)})
        return len({v.prompt_id if v is not None else j for j, v in jobs.items() if j not in self.silenced})

    async def end_prompt(self, job: JobView) -> None:
        """The prompt of `job` ended with it (failed, interrupted): its chains still queued or running are cancelled,
        their ends not announced."""
        if job.chain[1] == 1:
            return
        for other in list(self.active.values()):
            if other.prompt_id == job.prompt_id and other.id != job.id and not other.finished:
                self.silenced.add(other.id)
                self.follow(other.id)
                try:
                    await self.link.call(m.Cancel(job=other.id), m.Ok)
                except DaemonRefused:
                    pass                             # it ended meanwhile


    # ------------------------------------------------------------ the loop

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tracker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        down = False
        while True:
            busy = bool(self.followed) or len(self.hub) > 0
            if busy or time.monotonic() - self.refreshed_at > IDLE_REFRESH_S:
                try:
                    await self.refresh()
                    if down:
                        log.info("the orchestrator daemon answers again")
                    down = False
                except DaemonDown as e:
                    if not down:
                        log.warning("%s", e)
                    down = True
                except Exception:  # noqa: BLE001 - the loop must outlive one bad look
                    log.exception("tracker refresh failed")
            await asyncio.sleep(self.poll_s)

    async def refresh(self) -> None:
        async with self._lock:
            # every page: the details of a few large queued jobs fill one reply, and the running job is the oldest
            infos: list[m.JobInfo] = []
            try:
                async for page in self.link.status_pages(active=True, detail=True):
                    infos[:0] = page
            except DaemonDown:
                self.refreshed_at = 0.0          # the last look is no answer now: the next handler asks again
                raise
            now = {i.job: JobView.of(i) for i in infos}
            names = model_names(self.pipeline)
            # 1) running and queued jobs: start, node changes, progress
            for job in now.values():
                await self._announce(job, self.followed.get(job.id) or self.active.get(job.id))
                if job.running or job.id in self.followed:
                    self.followed[job.id] = job
            # 2) followed jobs that left the active set: how did they end?
            for job_id in [j for j in self.followed if j not in now]:
                await self._finish(job_id, self.followed[job_id], names)
            self.active = now
            self.refreshed_at = time.monotonic()
            remaining = self.queue_remaining()
            if remaining != self.remaining:
                self.remaining = remaining
                await self.hub.send("status", shapes.status(remaining))

    async def _announce(self, job: JobView, prev: JobView | None) -> None:
        sid = None if job.id in self.silenced else job.client_id
        before = prev.state if prev is not None else "queued"
        if sid and job.running and before == "queued":
            for kind, data in shapes.start(job):
                await self.hub.send(kind, data, sid)
        if sid and job.running and job.state != before:
            await self.hub.send(*shapes.executing(job, shapes.state_node(job)), sid)
        step = (job.info.progress.step if job.info.progress else None, job.state)
        was = (prev.info.progress.step if prev is not None and prev.info.progress else None, before)
        if sid and step != was and (msg := shapes.progress(job)) is not None:
            await self.hub.send(*msg, sid)
        if job.running and (prev is None or prev.info.progress != job.info.progress or job.state != before):
            blocks = self.blocks_of(job)
            await self.hub.send("anima.progress", job.progress_fields(blocks))

    def blocks_of(self, job: JobView) -> int | None:
        if self.pipeline is None:
            return None
        size = (job.spec.get("width"), job.spec.get("height"))
        return next((p.blocks for p in self.pipeline.packs if (p.width, p.height) == size), None)

    async def _finish(self, job_id: str, last: JobView | None, names: ModelNames) -> None:
        try:
            reply = await self.link.call(m.Status(job=job_id, detail=True), m.Jobs)
        except DaemonRefused as e:                  # removed (pruned) or set aside between two looks
            log.warning("job %s vanished: %s", job_id, e)
            self.followed.pop(job_id, None)
            for fut in self.waiters.get(job_id, []):
                if not fut.done():
                    fut.set_exception(JobGone(f"job {job_id} is gone before the front saw it end: {e}"))
            return
        job = JobView.of(reply.jobs[0])
        if not job.finished:                       # between two looks it moved on, not out: look next time
            return
        quiet = job_id in self.silenced
        self.silenced.discard(job_id)
        sid = None if quiet else job.client_id
        if sid:
            if last is None or not last.running:      # it ran and ended between two looks
                for kind, data in shapes.start(job):
                    await self.hub.send(kind, data, sid)
            for kind, data in shapes.end(job, names):
                await self.hub.send(kind, data, sid)
        if job.state != "done" and not quiet:
            await self.end_prompt(job)
        await self.hub.send("anima.job", {"job": job.id, "state": job.state, "error": job.info.error})
        self.followed.pop(job_id, None)
        for fut in self.waiters.get(job_id, []):
            if not fut.done():
                fut.set_result(job)
