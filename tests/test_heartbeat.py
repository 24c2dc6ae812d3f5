"""Orchestrator → stage heartbeats: PONGs recorded from a real stage process framework, silence noticed, recovery."""
import threading
import time
from pathlib import Path

import zmq

from orchestrator.heartbeat import Heartbeats
from stages.base import StageProc
from stages.config import parse_config


class _Idle:
    """A logic that serves nothing but the lifecycle kinds (test double)."""


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
