"""Stage control for one job: supervisord programs started, stopped and waited on, a request to a stage that dies
meanwhile asked again, the encoder and VAE kept down while denoising, and the stages' memory sampled into the job's
report."""
from __future__ import annotations

import logging
import os
import time

from orchestrator.engine import keep_up
from orchestrator.engine.report import current_rss_mb, peak_rss_mb
from orchestrator.engine.runfolder import ALWAYS_ON_STAGES, ON_DEMAND_STAGES
from orchestrator.engine.supervisor import SupervisorError
from protocol import messages as m
from protocol.fields import ProtocolError
from protocol.sockets import PeerUnavailable
from protocol.version import VERSION
from stages.base import EXIT_CONFIG
from stages.preflight import missing_files

log = logging.getLogger("orchestrator.engine.plan")     # one logger for a job's story, whichever half tells it

BUSY_RETRY_S = 0.5           # a stage that answers `busy` is asked again after this long (at most the call's timeout)
READY_TIMEOUT_S = 5.0        # one HELLO while a stage comes up (repeated until start_timeout_s)
DYING_WAIT_S = 2.0           # a stage's last word (DYING) is looked for this long after its config exit
START_ATTEMPTS = 3           # a stage that dies while supervisord starts it (within startsecs) is started again


class StageFailed(Exception):
    def __init__(self, stage: str, message: str):
        super().__init__(f"{stage}: {message}")
        self.stage, self.message = stage, message


class Cancelled(Exception):
    pass


class Stopping(Exception):
    """The daemon is shutting down: the job stays in its state on disk for the next daemon to resume."""


class StageControl:
    """The stages as one job drives them. `d` is the Daemon (sockets, supervisor, idle pump, cancel requests);
    `report` is the job's JobReport, which gets the stages' memory and the teardown record."""

    def __init__(self, daemon, job, report):
        self.d, self.job, self.report = daemon, job, report
        self.sup, self.cfg, self.settings = daemon.sup, daemon.cfg, daemon.settings
        self._watch: tuple[str, int, float] | None = None     # (stage, pid at request start, start time)
        self._died: str | None = None
        self._config_exit, self._up_since = False, 0.0
        self._sampling: set[str] = set()                      # stages whose RSS is sampled now
        self._denoising = False
        self._last_sample = 0.0
        # which on-demand stages stay up after a use (orchestrator/engine/keep_up.py; from its pack on the board model)
        self.keep = keep_up.for_job(daemon, job)
        report.keep_up = self.keep.why

    # ------------------------------------------------------------ starting and stopping stages

    def bring_up(self, stage: str, *, gone_pid: int = 0) -> None:
        """Local: start through supervisord (after the dead process `gone_pid` has left), then HELLO until READY. A
        remote stage is only health-checked."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        self._up_since = time.time()             # a DYING after this is this start's last word
        if not self.cfg.is_remote(stage):
            if not gone_pid and self._held(stage):
                log.info("job %s: %s already up, keep_up %s: no start", self.job.id, stage, self.keep.why)
            else:
                self._preflight(stage)
                self._stop_held(stage)
                self._start_program(stage, gone_pid, deadline)
                self.report.stage_starts[stage] = self.report.stage_starts.get(stage, 0) + 1
            self._sampling.add(stage)
        check = self._start_failed(stage)
        while True:
            try:
                reply = self.d.link(stage).request(m.Hello(peer="orchestrator", pid=os.getpid(), version=VERSION),
                                                   timeout_s=READY_TIMEOUT_S, retries=0, should_stop=check,
                                                   idle=self.d.idle, wake=self.d.wake)
                m.expect(reply, m.Ready, stage)
                if stage in self._sampling:          # loaded and ready: the first point of its memory trace
                    self._sample_one(stage)
                self.d.config_exits.discard(stage)
                return
            except PeerUnavailable:
                self.check_cancel()
                if self._config_exit:
                    self.d.config_exits.add(stage)
                    raise StageFailed(stage, self._died) from None
                if self._died or time.monotonic() > deadline:
                    where = self.cfg.endpoint(stage)
                    why = self._died or f"no READY within {self.settings.start_timeout_s:.0f} s"
                    raise StageFailed(stage, f"not reachable at {where}: {why}") from None
            except (m.RemoteError, ProtocolError) as e:
                raise StageFailed(stage, f"bad READY: {e}") from None

    def _preflight(self, stage: str) -> None:
        """After a start of `stage` ended in a config exit: StageFailed at once while its model files are still not
        there (stages/preflight.py, the stage's own look, made again each job: a file put in place is seen), instead
        of a process start, its imports and supervisord's startsecs for the same exit every job."""
        if stage not in self.d.config_exits:
            return
        why = missing_files(self.cfg, stage)
        if why:
            raise StageFailed(stage, f"cannot start: {why} (checked before starting it: not started)")

    def _start_program(self, stage: str, gone_pid: int, deadline: float) -> None:
        """A local stage's program started through supervisord once `gone_pid` has left. Not waited for RUNNING: the
        stage's READY is the sign it serves, and supervisord says RUNNING only after startsecs, a second the job would
        wait for nothing whenever the stage loads sooner. A start that dies is started again by _start_failed."""
        while gone_pid and time.monotonic() < deadline:      # its last word is out; wait for the exit itself
            info = self.sup.info(stage)
            if info.pid != gone_pid:
                break
            self.d.pump(0.05)
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self.sup.start(stage, wait=False)
                return
            except SupervisorError as e:  # supervisord could not spawn it (e.g. SPAWN_ERROR)
                if attempt == START_ATTEMPTS or time.monotonic() > deadline:
                    raise StageFailed(stage, f"could not start ({attempt} attempts): {e}") from None
                log.warning("job %s: %s did not start (%s); again (%d/%d)", self.job.id, stage, e, attempt,
                            START_ATTEMPTS)
                self.d.pump(1.0)

    def _start_failed(self, stage: str):
        """A should_stop for HELLO while a stage comes up: a config exit ends it; a start that ended (FATAL: it kept
        dying within startsecs; EXITED, STOPPED) is started again, START_ATTEMPTS starts in all."""
        self._died, self._config_exit = None, False
        restarts = [0]

        def check() -> bool:
            self._sample()                   # its memory while it loads (the longest part of a stage's phase)
            if self.d.stopping or self.job.id in self.d.cancel_requests:
                return True
            if not self.cfg.is_remote(stage):
                info = self.sup.info(stage)
                why = self._config_exit_reason(stage, info)
                if why:
                    self._died, self._config_exit = why, True
                    return True
                if info.state in ("FATAL", "EXITED", "STOPPED") and restarts[0] < START_ATTEMPTS - 1:
                    restarts[0] += 1
                    log.warning("job %s: %s ended while starting (%s); again (%d/%d)", self.job.id, stage,
                                info.spawnerr or info.description or info.state, restarts[0] + 1, START_ATTEMPTS)
                    self.sup.start(stage, wait=False)
                elif info.state in ("FATAL", "EXITED", "STOPPED"):
                    self._died = f"{info.state}: {info.spawnerr or info.description} (see its log)"
                    return True
            return False
        return check

    def _config_exit_reason(self, stage: str, info) -> str:
        """Why a stage that exited EXIT_CONFIG did (its DYING of this start, else a pointer to its log); "" for any
        other state. A config or pack problem fails the same way every time: it is not retried, and its cause is
        the job's error, not only a line in the stage's log."""
        if info.state != "EXITED" or info.exitstatus != EXIT_CONFIG:
            return ""
        said, until = "", time.monotonic() + DYING_WAIT_S
        while True:                     # its DYING went out before the exit; it may not have been read yet
            dying = self.d.dying.get(stage)
            said = dying[1].reason if dying is not None and dying[0] >= self._up_since else ""
            if said or time.monotonic() > until:
                break
            self.d.pump(0.05)
        return (f"{said} (exit {EXIT_CONFIG}, not retried)" if said else
                f"exited {EXIT_CONFIG} (a config or pack problem, not retried; see orchestrator logs {stage})")

    def _held(self, stage: str) -> bool:
        """Up from an earlier use this policy kept it for (a live process: its HELLO still has to answer)."""
        return self.keep.after_use(stage) and self.sup.info(stage).live

    def _stop_held(self, starting: str) -> None:
        """The other on-demand stage, when kept up, stopped before `starting` comes up unless both fit together."""
        live = [s for s in ON_DEMAND_STAGES if s != starting and self.keep.after_use(s) and not self.cfg.is_remote(s)
                and self.sup.info(s).live]
        for stage in self.keep.to_stop_before(starting, live):
            log.info("job %s: %s stopped before %s starts (keep_up %s)", self.job.id, stage, starting, self.keep.why)
            try:
                self.sup.stop(stage, timeout_s=self.settings.stop_timeout_s, sleep=self.d.pump)
            except SupervisorError as e:
                raise StageFailed(stage, f"could not stop: {e}") from None

    def bring_down(self, stage: str) -> None:
        """A stage's phase is over: stopped, or left up when the job's keep_up policy says so."""
        if self.cfg.is_remote(stage):
            return
        info = self.sup.info(stage)
        if info.pid:
            self.report.stages[stage].see_rss(peak_rss_mb(info.pid))
            self.report.memory.add(stage, self.report.since_start(), current_rss_mb(info.pid))   # its last look
        self._sampling.discard(stage)
        if self.keep.after_use(stage):
            log.info("job %s: %s kept up (keep_up %s)", self.job.id, stage, self.keep.why)
            return
        try:
            self.sup.stop(stage, timeout_s=self.settings.stop_timeout_s, sleep=self.d.pump)
        except SupervisorError as e:
            raise StageFailed(stage, f"could not stop: {e}") from None

    def tear_down_on_demand(self) -> None:
        """Nothing heavy may be up while denoising: the local on-demand stages still live are stopped (but one the
        keep_up policy keeps up through the denoise: never on 8 GB)."""
        for name in ON_DEMAND_STAGES:
            if self.keep.while_denoising(name):
                continue
            if not self.cfg.is_remote(name) and self.sup.info(name).live:
                self.sup.stop(name, timeout_s=self.settings.stop_timeout_s, sleep=self.d.pump)

    def stop_quietly(self) -> None:
        for stage in ON_DEMAND_STAGES:
            if not self.cfg.is_remote(stage):
                try:
                    self.sup.stop(stage, timeout_s=self.settings.stop_timeout_s, sleep=self.d.pump)
                except SupervisorError as e:
                    log.warning("could not stop %s: %s", stage, e)

    # ------------------------------------------------------------ requests with death detection

    def call(self, stage: str, msg: m.Message, timeout_s: float) -> m.Message:
        """Send one request; a stage that dies meanwhile is waited for and asked again (bounded), then StageFailed."""
        deaths, busy_since, last_error = 0, None, ""
        while True:
            self.check_cancel()
            self._arm(stage)
            pid0 = self._watch[1]
            try:
                reply = self.d.link(stage).request(msg, timeout_s=timeout_s, retries=0, should_stop=self._abort,
                                                   idle=self.d.idle, wake=self.d.wake)
            except PeerUnavailable as e:
                self.check_cancel()
                last_error, dead = self._died or str(e), self._died is not None
                reply = None
            finally:
                self._watch = None
            if isinstance(reply, m.Error) and reply.code == "busy":
                busy_since = busy_since or time.monotonic()
                if time.monotonic() - busy_since > timeout_s:   # e.g. still serving a dead orchestrator's request
                    raise StageFailed(stage, f"busy for {timeout_s:.0f} s: {reply.message}")
                self.d.pump(BUSY_RETRY_S)
                continue
            if isinstance(reply, m.Error) and reply.code == "cancelled" and self.job.id in self.d.cancel_requests:
                raise Cancelled()
            if reply is None or (isinstance(reply, m.Error) and reply.retry):
                if reply is not None:                # `internal` (ERROR, DYING, exit) or a retryable failure
                    last_error, dead = f"{reply.code}: {reply.message}", reply.code == "internal"
                deaths += 1
                if deaths > self.settings.stage_retries:
                    raise StageFailed(stage, f"gave up after {deaths} failed attempts; last error: {last_error}")
                log.warning("job %s: %s failed (%s); waiting for it to come back (%d/%d)", self.job.id, stage,
                            last_error, deaths, self.settings.stage_retries)
                try:
                    self.bring_up(stage, gone_pid=pid0 if dead else 0)
                except StageFailed as e:
                    raise StageFailed(stage, f"{e.message}; last error: {last_error}") from None
                continue
            if isinstance(reply, m.Error):
                raise StageFailed(stage, f"{reply.code}: {reply.message}" + (f" (field {reply.field})"
                                                                            if reply.field else ""))
            return reply

    def denoise(self, msg: m.Denoise, timeout_s: float, sampling_pass: str = "first") -> m.Denoised:
        """The DENOISE request, with the always-on stages' memory and the teardown record sampled while it runs.
        Its place in the job (the image of the batch from its params, `sampling_pass`: "first" or "hires") is what
        the job's progress names meanwhile (JobInfo.denoise_pass), and its reply is the report's next pass."""
        where = m.DenoisePass(image=msg.params.batch_pos + 1, images=msg.params.batch_size, name=sampling_pass)
        job = self.job.id
        self.d.progress.pop(job, None)                        # the last pass's steps are not this one's
        self.d.denoise_pass[job] = where
        self._denoising = True
        self._sampling = set(ALWAYS_ON_STAGES)
        try:
            self._sample(force=True)
            reply = m.expect(self.call("scheduler", msg, timeout_s), m.Denoised, "scheduler")
            self._sample(force=True)
        finally:
            self._denoising = False
            self._sampling = set()
            self.d.denoise_pass.pop(job, None)
            self.d.progress.pop(job, None)
        self.report.add_pass(where, reply.to_wire())         # branches: PhaseSums, steps: StepTimes, as maps
        return reply

    def _arm(self, stage: str) -> None:
        pid = 0 if self.cfg.is_remote(stage) else self.sup.info(stage).pid
        self._watch, self._died = (stage, pid, time.time()), None

    def _abort(self) -> bool:
        """Polled while a request is out: cancel asked, or the stage's process is gone (supervisord / DYING)."""
        if self.d.stopping or self.job.id in self.d.cancel_requests:
            return True
        self._sample()
        return self._died is not None

    def _sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_sample < self.settings.sample_interval_s:
            return
        self._last_sample = now
        try:
            infos = self.sup.all_info()
        except SupervisorError as e:
            log.warning("supervisord sample failed: %s", e)
            return
        if self._denoising:                                   # the teardown record, read from supervisord
            self.report.teardown.sample({n: None if self.cfg.is_remote(n) else infos.get(n)
                                         for n in ON_DEMAND_STAGES})
        for stage in self._sampling:
            self._sample_one(stage, infos.get(stage))
        if self._watch is not None:
            self._see_watched(infos)

    def _see_watched(self, infos: dict) -> None:
        """The stage a request is out to: gone when it said DYING since, or its process is not the one asked."""
        stage, pid0, t0 = self._watch
        dying = self.d.dying.get(stage)
        if dying is not None and dying[0] >= t0:
            self._died = f"{stage} died: {dying[1].reason}"
        elif not self.cfg.is_remote(stage):
            info = infos.get(stage)
            if info is None or not info.live or (pid0 and info.pid != pid0):
                state = "gone" if info is None else f"{info.state} {info.description}".strip()
                self._died = f"{stage} process {pid0} is gone (supervisord: {state})"

    def _sample_one(self, stage: str, info=None) -> None:
        """One RSS look at a local stage: its peak so far and a point of the report's memory trace."""
        try:
            info = info or self.sup.info(stage)
        except SupervisorError:
            return
        if info.live:
            mb = current_rss_mb(info.pid)
            self.report.stages[stage].see_rss(mb)
            self.report.memory.add(stage, self.report.since_start(), mb)

    def check_cancel(self) -> None:
        if self.d.stopping:
            raise Stopping()
        if self.job.id in self.d.cancel_requests:
            link = self.d.links.get("scheduler")
            if self._denoising and link is not None:
                try:
                    link.request(m.Cancel(job=self.job.id), timeout_s=2.0, retries=0)
                except PeerUnavailable:
                    pass
            raise Cancelled()
