"""`make demo` (orchestrator/demo.py): the whole path on the embedded tiny model through supervisord, and a
supervisord that is still shutting down (right after `supervisorctl shutdown`) waited for, not raced."""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator import demo
from orchestrator.supervisor import Supervisor, SupervisorError
from tests.doubles_harness import Doubles

SLOW_STOP_S = 4.0
# a program that takes SLOW_STOP_S to stop: supervisord's shutdown lasts that long, answering "shutting down"
SLOW_STOP = f"""
[program:slowstop]
command={sys.executable} -c "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep({SLOW_STOP_S}), sys.exit(0))); time.sleep(10**6)"
autostart=true
stopwaitsecs=30
priority=1
"""


def test_demo_waits_for_a_supervisord_that_is_shutting_down(capsys):
    """`make demo` right after `supervisorctl shutdown` failed: "Another program is already listening on a port that
    one of our HTTP servers is configured to use" (shutdown returns before supervisord has gone, and a shutting-down
    supervisord refuses every call). The demo waits for it to exit, then starts it again."""
    root = Path(tempfile.mkdtemp(prefix="anima-demo-"))
    d = Doubles.start(root, extra_conf=SLOW_STOP)
    sup = Supervisor(d.rf.supervisor_sock)
    try:
        d.sup.wait_state("slowstop", ("RUNNING",), 60)
        old = sup._call("supervisor.getPID")
        sup.shutdown()
        assert demo.ensure_supervisord(d.rf) is True                 # started anew, its daemon answering
        assert "is shutting down: waiting for it to exit" in capsys.readouterr().err
        assert d.proc.poll() is not None                              # the old supervisord has exited
        assert sup._call("supervisor.getPID") != old and sup.info("orchestrator").state == "RUNNING"
    finally:
        try:
            sup.shutdown()
            sup.wait_gone()
        except SupervisorError:
            pass
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
