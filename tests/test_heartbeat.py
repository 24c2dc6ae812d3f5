"""Heartbeats, one rule for both watchers: the orchestrator's (PONGs recorded from a real stage process framework,
silence noticed, recovery) and the scheduler's PeerWatch (a silent, a restarted and an idle peer)."""
import os
import re
import threading
import time
from pathlib import Path

import pytest
import zmq

from orchestrator.engine.heartbeat import Heartbeats
from protocol import codec
from protocol import messages as m
from protocol.liveness import PeerLost, PeerWatch
from stages.base import StageProc
from stages.config import parse_config


class _Idle:
    """A logic that serves nothing but the control kinds (test double)."""


def _tick_until(hb, cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        hb.tick()
        time.sleep(0.01)
    return cond()


def test_pongs_silence_and_recovery(tmp_path):
    cfg = parse_config({"run_dir": str(tmp_path), "timeouts": {"heartbeat_s": 0.05, "liveness": 3}},
                       Path(tmp_path) / "pipeline.toml")
    ctx = zmq.Context()
    hb = Heartbeats(ctx, cfg, ["executor"])

    def start():
        proc = StageProc("executor", _Idle(), cfg, ctx=ctx, install_signals=False)
        t = threading.Thread(target=proc.run, daemon=True)
        t.start()
        return proc, t

    proc, t = start()
    try:
        assert _tick_until(hb, lambda: hb.beats["executor"].pong is not None)
        pong = hb.beats["executor"].pong
        assert pong.stage == "executor" and hb.alive("executor")
        proc.stopping = True                                  # the stage goes away: heartbeats go unanswered
        t.join(5)
        assert _tick_until(hb, lambda: not hb.alive("executor"))
        assert hb.beats["executor"].misses >= 1
        proc, t = start()                                     # back again: seen alive on the fresh socket
        assert _tick_until(hb, lambda: hb.alive("executor"))
    finally:
        proc.stopping = True
        t.join(5)
        hb.close()
        ctx.term()


class _Peer:
    """A stage's heartbeat side as a watcher sees it (REP): every HEARTBEAT gets PONG(pid, busy, job), until muted."""

    def __init__(self, ctx, endpoint):
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.pid, self.busy, self.job, self.mute, self.stop = 1000, True, "j1", False, False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            if self.mute or not self.sock.poll(10):
                time.sleep(0.005)
                continue
            msg = codec.decode(self.sock.recv_multipart())
            assert isinstance(msg, m.Heartbeat)
            self.sock.send_multipart(codec.encode(m.reply_to(msg, m.Pong, stage="executor", pid=self.pid,
                                                             busy=self.busy, job=self.job, uptime_s=1.0)))

    def close(self):
        self.stop = True
        self.thread.join(5)
        self.sock.close(0)


@pytest.fixture
def peer(tmp_path):
    ctx = zmq.Context()
    p = _Peer(ctx, f"ipc://{tmp_path}/executor.sock")
    p.ctx, p.endpoint = ctx, f"ipc://{tmp_path}/executor.sock"
    yield p
    p.close()
    ctx.term()


def _lost(watch, timeout_s=10.0) -> PeerLost:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            watch.tick()
        except PeerLost as e:
            return e
        time.sleep(0.01)
    raise AssertionError(f"no PeerLost within {timeout_s} s")


def _watch(peer, interval_s=0.05, liveness=3):
    watch = PeerWatch(peer.ctx, peer.endpoint, peer="executor", interval_s=interval_s, liveness=liveness)
    watch.reset("j1")
    return watch


def test_a_silent_peer_is_lost_after_liveness_misses_in_a_row(peer):
    watch = _watch(peer)
    try:
        assert _tick_until(watch, lambda: watch.pid == 1000)          # it answers: busy with our job
        peer.mute = True
        e = _lost(watch)
        assert e.silent and re.fullmatch(r"executor answered no heartbeat for \d+\.\d s", str(e))
        assert watch.link.beat.missed == 3                            # the rule: `liveness` misses in a row
    finally:
        watch.close()


def test_a_restarted_peer_is_lost_at_once(peer):
    watch = _watch(peer)
    try:
        assert _tick_until(watch, lambda: watch.pid == 1000)
        peer.pid = 1001                                               # a new process answers on the endpoint
        e = _lost(watch)
        assert not e.silent and str(e) == "executor restarted (pid 1000 -> 1001): the request died with it"
    finally:
        watch.close()


def test_an_idle_stage_lost_the_request(tmp_path):
    cfg = parse_config({"run_dir": str(tmp_path), "timeouts": {"heartbeat_s": 0.05, "liveness": 3}},
                       Path(tmp_path) / "pipeline.toml")
    ctx = zmq.Context()
    proc = StageProc("executor", _Idle(), cfg, ctx=ctx, install_signals=False)
    t = threading.Thread(target=proc.run, daemon=True)
    t.start()
    watch = PeerWatch(ctx, cfg.endpoint("executor"), peer="executor", interval_s=0.05, liveness=3)
    watch.reset("j1")
    try:
        e = _lost(watch)                             # a real stage that serves nothing answers PONG busy=false
        assert not e.silent and str(e) == (f"executor (pid {os.getpid()}) is idle, not working on job j1: "
                                           "request lost")
        assert watch.idle == 3
    finally:
        watch.close()
        proc.stopping = True
        t.join(5)
        ctx.term()


def test_an_answer_ends_a_run_of_misses(peer):
    watch = _watch(peer, interval_s=0.2, liveness=5)
    try:
        assert _tick_until(watch, lambda: watch.pid == 1000)
        peer.mute = True
        assert _tick_until(watch, lambda: watch.link.beat.missed == 2)     # one tick counts one miss at most
        peer.mute = False
        assert _tick_until(watch, lambda: watch.link.beat.missed == 0)     # no PeerLost: it answered in time
        assert watch.link.beat.misses == 2 and watch.pid == 1000
    finally:
        watch.close()


def test_the_daemon_and_the_scheduler_count_misses_alike(peer, tmp_path):
    """The orchestrator's Heartbeats go silent on the same rule as PeerWatch: `liveness` misses in a row."""
    cfg = parse_config({"run_dir": str(tmp_path), "endpoints": {"executor": peer.endpoint},
                        "timeouts": {"heartbeat_s": 0.05, "liveness": 4}}, Path(tmp_path) / "pipeline.toml")
    hb = Heartbeats(peer.ctx, cfg, ["executor"])
    try:
        assert _tick_until(hb, lambda: hb.beats["executor"].pong is not None and hb.alive("executor"))
        peer.mute = True
        assert _tick_until(hb, lambda: not hb.alive("executor"))
        assert hb.beats["executor"].missed == 4
        peer.mute = False
        assert _tick_until(hb, lambda: hb.alive("executor"))
        assert hb.beats["executor"].missed == 0 and hb.silent_for("executor") < 10.0
    finally:
        hb.close()
