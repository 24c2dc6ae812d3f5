"""Heartbeats from the orchestrator to its always-on stages: a non-blocking REQ each, PONGs kept, silence logged."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from protocol import codec
from protocol import messages as m
from protocol.fields import ProtocolError
from protocol.sockets import make_socket

log = logging.getLogger(__name__)


@dataclass
class Beat:
    """What we know of one stage from its heartbeats."""

    sent_at: float = 0.0            # monotonic time of the outstanding HEARTBEAT (0: none out)
    last_pong_at: float = 0.0       # monotonic time of the last PONG
    pong: m.Pong | None = None
    misses: int = 0                 # heartbeats that went unanswered, over the daemon's life
    silent: bool = False            # no PONG for interval × liveness
    since: float = 0.0              # monotonic time the watch (re)started: silence is counted from here at the earliest


class Heartbeats:
    """`tick()` from the daemon's idle loop: send a HEARTBEAT every `interval_s` to each stage, read PONGs without
    blocking; a stage silent for `interval_s × liveness` is logged once (its REQ socket is replaced: it is stuck)."""

    def __init__(self, ctx: zmq.Context, config, stages: list[str]):
        self.ctx, self.cfg = ctx, config
        self.interval_s = config.timeouts.heartbeat_s
        self.liveness = config.timeouts.liveness
        now = time.monotonic()
        self.beats = {s: Beat(since=now) for s in stages}
        self._socks: dict[str, zmq.Socket] = {}

    def _sock(self, stage: str) -> zmq.Socket:
        if stage not in self._socks:
            remote = self.cfg.is_remote(stage)
            self._socks[stage] = make_socket(self.ctx, zmq.REQ, self.cfg.endpoint(stage), bind=False,
                                             curve=self.cfg.curve_client(stage) if remote else None,
                                             allow_plaintext=self.cfg.security.allow_plaintext_loopback)
        return self._socks[stage]

    def _drop(self, stage: str) -> None:
        sock = self._socks.pop(stage, None)
        if sock is not None:
            sock.close(0)

    def tick(self) -> None:
        now = time.monotonic()
        for stage, beat in self.beats.items():
            # 1) a PONG waiting?
            if beat.sent_at:
                sock = self._sock(stage)
                if sock.poll(0, zmq.POLLIN):
                    try:
                        reply = codec.decode(sock.recv_multipart())
                    except ProtocolError as e:
                        log.warning("bad heartbeat reply from %s: %s", stage, e)
                        reply = None
                    beat.sent_at = 0.0
                    if isinstance(reply, m.Pong):
                        if beat.silent:
                            log.info("%s answers heartbeats again (pid %d)", stage, reply.pid)
                        beat.pong, beat.last_pong_at, beat.silent = reply, now, False
                elif now - beat.sent_at > self.interval_s * self.liveness:
                    # 2) silent too long: a REQ socket without its reply is stuck, so start over
                    beat.misses += 1
                    beat.sent_at = 0.0
                    self._drop(stage)
                    if not beat.silent:
                        log.warning("%s has not answered a heartbeat for %.1f s", stage,
                                    self.interval_s * self.liveness)
                    beat.silent = True
            # 3) time for the next one?
            if not beat.sent_at and now - max(beat.last_pong_at, 0.0) >= self.interval_s:
                try:
                    self._sock(stage).send_multipart(codec.encode(m.Heartbeat(peer="orchestrator")), zmq.NOBLOCK)
                    beat.sent_at = now
                except zmq.Again:
                    self._drop(stage)

    def alive(self, stage: str) -> bool:
        return stage in self.beats and not self.beats[stage].silent

    def silent_for(self, stage: str, now: float | None = None) -> float:
        """Seconds since the stage last answered (or since the watch was reset, when later)."""
        beat = self.beats[stage]
        return (time.monotonic() if now is None else now) - max(beat.last_pong_at, beat.since)

    def reset(self, stage: str) -> None:
        """Count silence afresh (a new process of the stage is coming up)."""
        self.beats[stage].since = time.monotonic()

    def close(self) -> None:
        for stage in list(self._socks):
            self._drop(stage)
