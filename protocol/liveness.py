"""Peer liveness while a long request is outstanding: HEARTBEAT on a side socket, PeerLost after LIVENESS misses.

A busy stage still answers HEARTBEAT (stages.base serves lifecycle kinds while a handler works) with PONG saying it is
busy and with which job. So silence means the peer process is gone, a new pid means it restarted, and a peer that stays
idle never got the request (or lost it): in each case the caller drops its request socket and resends at once instead
of waiting out a long request timeout. Non-blocking: `tick()` is meant for LazyPirate's `idle` callback.
"""
from __future__ import annotations

import os
import time
from typing import Any

import zmq

from protocol import codec
from protocol.messages import HEARTBEAT_INTERVAL_S, LIVENESS, Heartbeat, Pong
from protocol.sockets import make_socket


class PeerLost(Exception):
    """The peer answered no HEARTBEAT for LIVENESS intervals (`silent`), or it restarted or stays idle (the request
    died with it). A silent peer may be dead or only hung (SIGSTOP, a deadlock): resending reaches it once it is
    restarted, so a caller may bound silence by time rather than by count."""

    def __init__(self, message: str, *, silent: bool = False):
        super().__init__(message)
        self.silent = silent


class PeerWatch:
    """Heartbeats `endpoint` every `interval_s`; `tick()` raises PeerLost after `liveness` unanswered ones."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, peer: str, interval_s: float = HEARTBEAT_INTERVAL_S,
                 liveness: int = LIVENESS, curve: Any = None, allow_plaintext: bool = False):
        self.ctx, self.endpoint, self.peer = ctx, endpoint, peer
        self.interval_s, self.liveness = interval_s, liveness
        self.curve, self.allow_plaintext = curve, allow_plaintext
        self.sock: zmq.Socket | None = None
        self.sent_at = 0.0
        self.missed = self.idle = 0
        self.waiting = False
        self.pid: int | None = None
        self.job: str | None = None

    def _send(self, now: float) -> None:
        if self.sock is None:
            self.sock = make_socket(self.ctx, zmq.REQ, self.endpoint, bind=False, curve=self.curve,
                                    allow_plaintext=self.allow_plaintext)
        self.sock.send_multipart(codec.encode(Heartbeat(peer=f"watch-{os.getpid()}")), copy=False)
        self.sent_at = now
        self.waiting = True

    def reset(self, job: str | None = None) -> None:
        """Start watching a new request (for `job`): forget earlier misses, pid and idle answers."""
        self.close()
        self.missed = self.idle = 0
        self.pid, self.job = None, job

    def tick(self) -> None:
        now = time.monotonic()
        if not self.waiting:                   # nothing outstanding: next heartbeat when the interval is up
            if self.sock is None or now - self.sent_at >= self.interval_s:
                self._send(now)
            return
        if self.sock.poll(0, zmq.POLLIN):
            try:
                pong = codec.decode(self.sock.recv_multipart(copy=False))
            except Exception:  # noqa: BLE001 - a garbled answer is still an answer from a live peer
                pong = None
            self.waiting = False
            self.missed = 0
            if isinstance(pong, Pong):
                self._judge(pong)
            return
        if now - self.sent_at >= self.interval_s:
            self.missed += 1
            self.close()                       # a REQ socket without a reply is stuck: start a fresh one
            if self.missed >= self.liveness:
                raise PeerLost(f"{self.peer} answered no heartbeat for {self.missed * self.interval_s:.1f} s",
                               silent=True)
            self._send(now)

    def _judge(self, pong: Pong) -> None:
        """A live peer may still have lost our request: it restarted (new pid), or it stays idle."""
        if self.pid is None:
            self.pid = pong.pid
        elif pong.pid != self.pid:
            raise PeerLost(f"{self.peer} restarted (pid {self.pid} -> {pong.pid}): the request died with it")
        working = pong.busy and (self.job is None or pong.job == self.job)
        self.idle = 0 if working else self.idle + 1
        if self.idle >= self.liveness:
            raise PeerLost(f"{self.peer} (pid {pong.pid}) is idle, not working on job {self.job}: request lost")

    def close(self) -> None:
        self.waiting = False
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
