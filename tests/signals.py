"""The one way the tests signal a process or a process group.

Why a module of its own: `os.kill(0, sig)` signals the caller's own process group and `os.kill(-1, sig)` every process
it may signal. Under `make test` the caller's group is pytest, its workers, make and .ci/run, so one SIGKILL sent to a
pid of 0 ends the whole run with exit 137 and no report. supervisord answers pid 0 for a program between its death and
its restart (EXITED, BACKOFF), which a test that kills the same program twice in a row meets on a slow machine.
Here a pid below 2 is refused with the reason, and a program is signalled only once it has a process again."""
from __future__ import annotations

import os
import signal
import time

PROGRAM_UP_S = 60.0          # how long kill_program waits for supervisord to have the program running again
_POLL_S = 0.05


def _checked(pid: int, what: str) -> int:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 2:
        raise AssertionError(f"refusing to signal {what} {pid!r}: 0 is this test's own process group (make and CI "
                             "with it), -1 every process, 1 init")
    return pid


def signal_process(pid: int, sig: int = signal.SIGKILL, *, missing_ok: bool = False) -> None:
    """Send `sig` to one process (not its group: as a crash would). `missing_ok`: a process already gone is fine."""
    try:
        os.kill(_checked(pid, "pid"), sig)
    except ProcessLookupError:
        if not missing_ok:
            raise


def signal_group(pgid: int, sig: int = signal.SIGKILL, *, missing_ok: bool = True) -> None:
    """Send `sig` to a process group the test started (start_new_session=True: its leader's pid is the group's id)."""
    if _checked(pgid, "process group") == os.getpgrp():
        raise AssertionError(f"refusing to signal process group {pgid}: it is this test's own")
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        if not missing_ok:
            raise


def kill_program(sup, program: str, sig: int = signal.SIGKILL, timeout_s: float = PROGRAM_UP_S) -> int:
    """Signal a supervisord program's process. A program that is between a death and its restart has no process yet:
    wait (up to `timeout_s`) for the one supervisord starts, then signal it. -> the pid signalled."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = sup.info(program)
        if info.pid and info.state in ("STARTING", "RUNNING"):
            try:
                signal_process(info.pid, sig)
                return info.pid
            except ProcessLookupError:            # it died by itself just now: its restart is the one to signal
                pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{program} has no process to signal after {timeout_s:.0f} s ({info.state})")
        time.sleep(_POLL_S)
