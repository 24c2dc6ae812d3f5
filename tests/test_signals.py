"""tests/signals.py: no test can signal its own process group. A CI run ended with exit 137 and no report: the split
sampling test kills the daemon three times in a row; on a slow machine the third came while supervisord had not yet
restarted it after the second, `sup.info("orchestrator").pid` was 0, and os.kill(0, SIGKILL) killed pytest, make and
.ci/run. Each check runs in a child in a session of its own, so a regression kills the child, not this run."""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _in_own_session(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, start_new_session=True)


@pytest.mark.parametrize("call", ["signal_process(0)", "signal_process(-1)", "signal_process(1)",
                                  "signal_group(0)", "signal_group(os.getpgrp())"])
def test_a_pid_that_would_reach_the_test_itself_is_refused(call):
    r = _in_own_session(f"""
        import os
        from tests.signals import signal_group, signal_process
        try:
            {call}
        except AssertionError as e:
            print("refused:", e)
        """)
    assert r.returncode == 0, (r.returncode, r.stderr)           # -9: it signalled its own group
    assert r.stdout.startswith("refused: refusing to signal"), r.stdout + r.stderr


def test_a_program_between_its_death_and_its_restart_is_signalled_once_it_is_back():
    """The doubles harness's sigkill while supervisord reports EXITED then BACKOFF (pid 0): it waits for the restarted
    process and kills that one (before: os.kill(0, SIGKILL))."""
    r = _in_own_session("""
        import subprocess, sys
        from types import SimpleNamespace
        from tests.doubles_harness import Doubles
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        states = [("EXITED", 0), ("BACKOFF", 0), ("STARTING", child.pid)]
        class Sup:
            def info(self, name):
                state, pid = states.pop(0) if len(states) > 1 else states[0]
                return SimpleNamespace(state=state, pid=pid)
        d = Doubles.__new__(Doubles)
        d.sup = Sup()
        print("killed", d.sigkill("vae") == child.pid, child.wait(10))
        """)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.split() == ["killed", "True", str(-signal.SIGKILL)], r.stdout + r.stderr


def _signal_calls(path: Path) -> list[str]:
    """os.kill / os.killpg calls in a file, but the existence probe os.kill(pid, 0)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("kill", "killpg")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"):
            probe = len(node.args) == 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == 0
            if not probe:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_tests_and_benches_signal_only_through_tests_signals():
    files = [p for d in ("tests", "bench") for p in sorted((ROOT / d).rglob("*.py")) if p.name != "signals.py"]
    assert files and not [c for p in files for c in _signal_calls(p)]
    assert _signal_calls(ROOT / "tests" / "signals.py")          # the scan sees the calls it forbids elsewhere
