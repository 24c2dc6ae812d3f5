"""Hung stages: a local always-on stage that answers no heartbeat for `hang_timeout_s` is restarted through supervisord.

A stage answers HEARTBEAT while it works (stages.base), so silence means its process is stuck: stopped (SIGSTOP), deadlocked,
or swapped to a standstill. supervisord's own stop sends TERM and waits `stopwaitsecs` before SIGKILL, and a stopped
process never acts on the TERM; so the stop is followed at once by SIGKILL through supervisord (`signalProcess`), the
process group gets SIGCONT (its other processes can then act on their TERM), and once supervisord has reaped it the
stage is started again. The job in flight goes on like after any crash: the daemon sees the new pid and resends
DENOISE (the scheduler resumes from its per-step state), or the scheduler resends the branch call to the new executor.

Non-blocking: `tick()` runs from the daemon's event pump, also while a stage request is out.
"""
from __future__ import annotations

import logging
import os
import signal
import time

from orchestrator.engine.supervisor import STOPPED_STATES, SupervisorError

log = logging.getLogger(__name__)


class HangWatch:
    def __init__(self, sup, heartbeats, hang_timeout_s: float, local: list[str]):
        self.sup, self.hb, self.hang_timeout_s = sup, heartbeats, hang_timeout_s
        self.local = [s for s in local if s in heartbeats.beats]     # remote stages are not ours to restart
        self.pids: dict[str, int] = {}          # stage -> the pid whose silence is being counted
        self.restarting: dict[str, int] = {}    # stage -> pid of the hung process being replaced
        self.restarts: dict[str, int] = {s: 0 for s in self.local}

    def tick(self) -> None:
        if self.hang_timeout_s <= 0:
            return
        now = time.monotonic()
        for stage in self.local:
            try:
                if stage in self.restarting:
                    self._start_again(stage)
                elif self.hb.silent_for(stage, now) >= self.hang_timeout_s:
                    self._judge(stage)
            except SupervisorError as e:
                log.warning("hang watch on %s: %s", stage, e)

    def _judge(self, stage: str) -> None:
        info = self.sup.info(stage)
        if info.state != "RUNNING" or not info.pid:
            self.hb.reset(stage)                 # stopped, starting, backing off: supervisord's business
            return
        pong = self.hb.beats[stage].pong
        answered_before = pong is not None and pong.pid == info.pid
        if not answered_before and self.pids.get(stage) != info.pid:
            self.pids[stage] = info.pid          # a new process, never heard from: silence counts from now
            self.hb.reset(stage)
            return
        silent = self.hb.silent_for(stage)
        log.error("%s (pid %d) has answered no heartbeat for %.0f s (hang_timeout_s %.0f): hung; restarting it "
                  "through supervisord", stage, info.pid, silent, self.hang_timeout_s)
        self.sup.stop(stage, wait=False)         # expected stop: TERM to the group, state STOPPING
        try:
            self.sup.signal(stage, "KILL")       # a stopped or deadlocked process never acts on the TERM
        except SupervisorError as e:             # it exited by itself in between
            log.info("%s: SIGKILL not sent: %s", stage, e)
        try:
            os.killpg(info.pid, signal.SIGCONT)  # the rest of its group (if any) may act on the TERM now
        except (ProcessLookupError, PermissionError):
            pass
        self.restarting[stage] = info.pid
        self.restarts[stage] += 1

    def _start_again(self, stage: str) -> None:
        info = self.sup.info(stage)
        if info.pid and info.pid != self.restarting[stage] and info.state in ("STARTING", "RUNNING"):
            pass                                 # someone (the job flow) started it already
        elif info.state in STOPPED_STATES:
            self.sup.start(stage, wait=False)
        else:
            return                               # still STOPPING: supervisord has not reaped it yet
        log.info("%s: hung pid %d replaced", stage, self.restarting.pop(stage))
        self.pids.pop(stage, None)
        self.hb.reset(stage)
