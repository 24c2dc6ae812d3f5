"""The orchestrator's RSS look at a stage (orchestrator/engine/report.py): the stage and every process below it,
found from the stage's own /proc entries, not by psutil's scan of every process on the machine (which, at each
sample of each stage, was most of the orchestrator's CPU during a job on a shared host)."""
from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from orchestrator.engine.report import current_rss_mb, descendants, peak_rss_mb
from tests.signals import signal_process

# a child that starts a grandchild, says its pid, and sleeps: a stage with a helper process below it
TREE = ("import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n")


@pytest.fixture
def tree():
    child = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    try:
        yield child.pid, grandchild
    finally:
        for pid in (grandchild, child.pid):
            signal_process(pid, missing_ok=True)
        child.wait(10)
        child.stdout.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the /proc children files are Linux's")
def test_a_stage_and_its_children_are_found_without_scanning_every_process(tree, monkeypatch):
    child, grandchild = tree
    proc = psutil.Process(child)
    want = {p.pid for p in proc.children(recursive=True)}              # psutil's scan, the reference
    assert want == {grandchild}
    rss = {pid: psutil.Process(pid).memory_info().rss for pid in (child, grandchild)}

    def scan(*args, **kwargs):
        raise AssertionError("psutil's children() reads every process's stat file")
    monkeypatch.setattr(psutil.Process, "children", scan)
    assert {p.pid for p in descendants(proc)} == want
    assert current_rss_mb(child) == pytest.approx(sum(rss.values()) / 2**20, abs=2.0)
    assert peak_rss_mb(child) >= current_rss_mb(child) - 2.0
    assert descendants(psutil.Process(grandchild)) == []


def test_a_process_gone_has_no_rss(tree):
    child, grandchild = tree
    signal_process(child)
    psutil.Process(child).wait(10)
    assert current_rss_mb(child) is None and peak_rss_mb(child) is None
