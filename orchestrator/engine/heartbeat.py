"""The orchestrator's heartbeats to its always-on stages: a protocol.liveness.HeartbeatLink each (one rule for misses),
PONGs kept for the hang watch, silence and recovery logged once."""
from __future__ import annotations

import logging
import time

import zmq

from protocol.liveness import Beat, HeartbeatLink

log = logging.getLogger(__name__)


class Heartbeats:
    """`tick()` from the daemon's idle loop: every stage is heartbeated every `[timeouts] heartbeat_s`; one that
    misses `liveness` in a row is silent (logged once, and again when it answers)."""

    def __init__(self, ctx: zmq.Context, config, stages: list[str]):
        t = config.timeouts
        self.links = {s: HeartbeatLink(ctx, config.endpoint(s), me="orchestrator", interval_s=t.heartbeat_s,
                                       liveness=t.liveness,
                                       curve=config.curve_client(s) if config.is_remote(s) else None,
                                       allow_plaintext=config.security.allow_plaintext_loopback)
                      for s in stages}
        self.beats: dict[str, Beat] = {s: link.beat for s, link in self.links.items()}
        self._silent: set[str] = set()

    def tick(self) -> None:
        now = time.monotonic()
        for stage, link in self.links.items():
            pong = link.tick(now)
            if link.silent and stage not in self._silent:
                self._silent.add(stage)
                log.warning("%s has not answered a heartbeat for %.1f s", stage, link.interval_s * link.liveness)
            elif pong is not None and stage in self._silent:
                self._silent.discard(stage)
                log.info("%s answers heartbeats again (pid %d)", stage, pong.pid)

    def alive(self, stage: str) -> bool:
        return stage in self.links and not self.links[stage].silent

    def silent_for(self, stage: str, now: float | None = None) -> float:
        """Seconds since the stage last answered (or since the watch was reset, when later)."""
        return self.beats[stage].silent_for(time.monotonic() if now is None else now)

    def reset(self, stage: str) -> None:
        """Count silence afresh (a new process of the stage is coming up)."""
        self.beats[stage].since = time.monotonic()

    def close(self) -> None:
        for link in self.links.values():
            link.close()
