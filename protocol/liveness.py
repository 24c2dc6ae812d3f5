"""Heartbeats to a peer stage: HEARTBEAT on a REQ side socket, PONGs read without blocking, one rule for misses.

The rule, for every watcher: one HEARTBEAT is out at a time, the next `interval_s` after the previous one; a HEARTBEAT
unanswered for `interval_s` is a miss (its REQ socket, stuck without a reply, is replaced and the next one goes out at
once); `liveness` misses in a row make the peer silent, i.e. it answered nothing for `interval_s × liveness`. Any
answer ends the run of misses. `HeartbeatLink` is that rule for one peer; its two users are `PeerWatch` below (the
scheduler while a BRANCH is out) and the orchestrator's `Heartbeats` (orchestrator/engine/heartbeat.py: its always-on stages,
read by the hang watch).

A busy stage still answers HEARTBEAT (stages.base serves the control kinds while a handler works) with PONG saying it
is busy and with which job. So silence means the peer process is gone or hung, a new pid means it restarted, and a peer
that stays idle never got the request (or lost it). Non-blocking: `tick()` is meant for an idle loop (LazyPirate's
`idle` callback, the daemon's pump).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import zmq

from protocol import codec
from protocol.fields import ProtocolError
from protocol.messages import HEARTBEAT_INTERVAL_S, LIVENESS, Heartbeat, Pong
from protocol.sockets import make_socket

log = logging.getLogger(__name__)


@dataclass
class Beat:
    """What heartbeats told of one peer (monotonic times)."""

    since: float = 0.0              # when the watch (re)started: silence is counted from here at the earliest
    sent_at: float = 0.0            # when the last HEARTBEAT went out (0: none yet)
    waiting: bool = False           # that HEARTBEAT is still unanswered
    last_pong_at: float = 0.0
    pong: Pong | None = None        # the last PONG
    missed: int = 0                 # misses in a row (an answer ends the run)
    misses: int = 0                 # misses over the watch's life

    def silent_for(self, now: float) -> float:
        """Seconds since the peer last answered with a PONG (or since the watch started, when later)."""
        return now - max(self.last_pong_at, self.since)


class HeartbeatLink:
    """The heartbeat rule (module docstring) for one peer at `endpoint`; `me` names the sender in HEARTBEAT."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, me: str, interval_s: float = HEARTBEAT_INTERVAL_S,
                 liveness: int = LIVENESS, curve: Any = None, allow_plaintext: bool = False):
        self.ctx, self.endpoint, self.me = ctx, endpoint, me
        self.interval_s, self.liveness = interval_s, liveness
        self.curve, self.allow_plaintext = curve, allow_plaintext
        self.sock: zmq.Socket | None = None
        self.beat = Beat(since=time.monotonic())

    @property
    def silent(self) -> bool:
        return self.beat.missed >= self.liveness

    def tick(self, now: float | None = None) -> Pong | None:
        """Read an answer, count a miss, send the next HEARTBEAT when it is due; the PONG read now, if any."""
        now = time.monotonic() if now is None else now
        b = self.beat
        if b.waiting:
            if self.sock is not None and self.sock.poll(0, zmq.POLLIN):
                b.waiting, b.missed = False, 0
                try:
                    reply = codec.decode(self.sock.recv_multipart(copy=False))
                except ProtocolError as e:      # garbled, yet an answer from a live process
                    log.warning("bad heartbeat reply from %s: %s", self.endpoint, e)
                    return None
                if isinstance(reply, Pong):
                    b.pong, b.last_pong_at = reply, now
                    return reply
                return None
            if now - b.sent_at < self.interval_s:
                return None
            b.missed += 1
            b.misses += 1
            self._drop()                        # a REQ socket without its reply is stuck: a fresh one
        elif b.sent_at and now - b.sent_at < self.interval_s:
            return None
        self._send(now)
        return None

    def _send(self, now: float) -> None:
        if self.sock is None:
            self.sock = make_socket(self.ctx, zmq.REQ, self.endpoint, bind=False, curve=self.curve,
                                    allow_plaintext=self.allow_plaintext)
        try:
            self.sock.send_multipart(codec.encode(Heartbeat(peer=self.me)), zmq.NOBLOCK, copy=False)
        except zmq.Again:                       # not deliverable now: it counts as sent and unanswered
            self._drop()
        self.beat.sent_at, self.beat.waiting = now, True

    def restart(self) -> None:
        """Watch afresh: no HEARTBEAT out, no misses in a row, silence counted from now (the last PONG is kept)."""
        self._drop()
        b = self.beat
        b.since, b.sent_at, b.waiting, b.missed = time.monotonic(), 0.0, False, 0

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    def close(self) -> None:
        self._drop()
        self.beat.waiting = False


class PeerLost(Exception):
    """The peer answered no HEARTBEAT for LIVENESS intervals (`silent`), or it restarted or stays idle (the request
    died with it). A silent peer may be dead or only hung (SIGSTOP, a deadlock): resending reaches it once it is
    restarted, so a caller may bound silence by time rather than by count."""

    def __init__(self, message: str, *, silent: bool = False):
        super().__init__(message)
        self.silent = silent


class PeerWatch:
    """A peer working on our request, watched by heartbeats: `tick()` raises PeerLost when it is silent (the rule
    above), restarted (a new pid), or answers idle `liveness` times in a row (not working on our job)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, peer: str, interval_s: float = HEARTBEAT_INTERVAL_S,
                 liveness: int = LIVENESS, curve: Any = None, allow_plaintext: bool = False):
        self.peer = peer
        self.link = HeartbeatLink(ctx, endpoint, me=f"watch-{os.getpid()}", interval_s=interval_s,
                                  liveness=liveness, curve=curve, allow_plaintext=allow_plaintext)
        self.idle = 0
        self.pid: int | None = None
        self.job: str | None = None

    def reset(self, job: str | None = None) -> None:
        """Start watching a new request (for `job`): forget earlier misses, pid and idle answers."""
        self.link.restart()
        self.idle = 0
        self.pid, self.job = None, job

    def tick(self) -> None:
        pong = self.link.tick()
        if self.link.silent:
            missed = self.link.beat.missed
            raise PeerLost(f"{self.peer} answered no heartbeat for {missed * self.link.interval_s:.1f} s",
                           silent=True)
        if pong is not None:
            self._judge(pong)

    def _judge(self, pong: Pong) -> None:
        """A live peer may still have lost our request: it restarted (new pid), or it stays idle."""
        if self.pid is None:
            self.pid = pong.pid
        elif pong.pid != self.pid:
            raise PeerLost(f"{self.peer} restarted (pid {self.pid} -> {pong.pid}): the request died with it")
        working = pong.busy and (self.job is None or pong.job == self.job)
        self.idle = 0 if working else self.idle + 1
        if self.idle >= self.link.liveness:
            raise PeerLost(f"{self.peer} (pid {pong.pid}) is idle, not working on job {self.job}: request lost")

    def close(self) -> None:
        self.link.close()
