"""HangWatch decisions (supervisord and heartbeats replaced by recorders; tests/test_hardening_pipeline.py runs the
real thing with SIGSTOP): when a silent stage counts as hung, and how it is replaced through supervisord."""
from dataclasses import dataclass

from orchestrator.engine.supervisor import ProcInfo
from orchestrator.engine.watchdog import HangWatch
from protocol import messages as m
from protocol.liveness import Beat


@dataclass
class _Beats:
    """Heartbeats as HangWatch sees them: silence per stage, the last PONG, resets."""
    silent: float = 0.0

    def __post_init__(self):
        self.beats = {"scheduler": Beat(), "executor": Beat()}
        self.resets = []

    def silent_for(self, stage, now=None):
        return self.silent

    def reset(self, stage):
        self.resets.append(stage)
        self.silent = 0.0


class _Sup:
    def __init__(self, state="RUNNING", pid=100):
        self.state, self.pid, self.calls = state, pid, []

    def info(self, name):
        return ProcInfo(name, self.state, self.pid if self.state in ("RUNNING", "STARTING", "STOPPING") else 0,
                        0, "", "", 0.0)

    def stop(self, name, wait=True):
        self.calls.append(("stop", name, wait))
        self.state = "STOPPING"

    def signal(self, name, sig):
        self.calls.append(("signal", name, sig))

    def start(self, name, wait=True):
        self.calls.append(("start", name, wait))
        self.state, self.pid = "RUNNING", self.pid + 1


def _pong(pid):
    return m.Pong(stage="scheduler", pid=pid, busy=True, job=None, uptime_s=1.0)


def test_a_stage_that_answered_and_fell_silent_is_replaced():
    hb, sup = _Beats(silent=10.0), _Sup(pid=4242)
    hb.beats["scheduler"].pong = _pong(4242)
    w = HangWatch(sup, hb, hang_timeout_s=5.0, local=["scheduler"])
    w.tick()
    assert sup.calls == [("stop", "scheduler", False), ("signal", "scheduler", "KILL")]
    assert w.restarting == {"scheduler": 4242} and w.restarts["scheduler"] == 1
    w.tick()                                     # still STOPPING: wait for supervisord to reap it
    assert len(sup.calls) == 2
    sup.state = "STOPPED"
    w.tick()
    assert sup.calls[-1] == ("start", "scheduler", False) and w.restarting == {} and hb.resets == ["scheduler"]


def test_a_new_process_gets_the_full_timeout_and_others_are_left_alone():
    hb, sup = _Beats(silent=10.0), _Sup(pid=7)
    hb.beats["scheduler"].pong = _pong(6)        # the last PONG came from an earlier process
    w = HangWatch(sup, hb, hang_timeout_s=5.0, local=["scheduler", "encoder"])   # encoder: not heartbeated
    w.tick()
    assert sup.calls == [] and hb.resets == ["scheduler"]
    hb.silent = 10.0                             # still silent a whole timeout later: hung
    w.tick()
    assert [c[0] for c in sup.calls] == ["stop", "signal"]
    for state in ("STARTING", "BACKOFF", "STOPPED", "FATAL"):   # supervisord's business, not a hang
        hb2, sup2 = _Beats(silent=99.0), _Sup(state=state)
        HangWatch(sup2, hb2, 5.0, ["scheduler"]).tick()
        assert sup2.calls == [] and hb2.resets == ["scheduler"]
    hb3, sup3 = _Beats(silent=99.0), _Sup()
    hb3.beats["scheduler"].pong = _pong(100)
    HangWatch(sup3, hb3, 0.0, ["scheduler"]).tick()             # 0: off
    assert sup3.calls == []
