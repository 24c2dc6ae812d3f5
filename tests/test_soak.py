"""Soak at CI size through bench/soak.py: 5 tiny jobs back to back on the real pipeline; after 2 warm-up jobs the RSS
of every stage grows < 5 %, the always-on stages' file descriptors do not grow and keep their pids, no /dev/shm
segment is left after any job (the 50-job count is bench/soak.py's default). On the session's board pipeline (encoder
and VAE on ONNX Runtime, as on the board): what stays behind lives in the always-on stages, which are the same."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soak import ALWAYS_ON, MAX_DRIFT, PER_JOB, soak  # noqa: E402

pytestmark = pytest.mark.slow

JOBS, WARMUP = 5, 2
# 1 step: the soak is about what stays behind between jobs, not about sampling
PROMPT = {"prompt": "1girl, soak", "negative_prompt": "lowres", "steps": 1, "cfg": 4.0}


def test_five_jobs_back_to_back_stay_flat(board_pipeline):
    pipe = board_pipeline
    r = soak(pipe, JOBS, WARMUP, prompt=PROMPT)
    assert pipe.strays() == [] and pipe.stage_children() == []
    print("\n" + r.line())
    assert r.failed == [], r.failed
    assert len(r.samples) == JOBS and r.pid_changes == []
    assert set(r.drift) == set(ALWAYS_ON + PER_JOB)
    for stage, d in r.drift.items():
        assert abs(d) < MAX_DRIFT, f"{stage} RSS grew {100 * d:+.1f} % over {JOBS - WARMUP} jobs"
    assert r.fd_growth == {s: 0 for s in ALWAYS_ON}, r.fd_growth
    assert r.shm_max == 0 and all(s.shm == 0 for s in r.samples)
    assert r.ok and r.line().endswith("shm=0 ok=True")
