"""The page's report view's data, GET /anima/jobs/JOB/timing, over the front's app with a stand-in daemon link (the
view itself, in Chromium: tests/test_http_page.py, whose Playwright loop rules out asyncio.run in its module)."""
from __future__ import annotations

import json

import pytest

from tests.test_graph_front_hardening import Front


def test_the_report_views_data_and_its_refusals(tmp_path):
    """GET /anima/jobs/JOB/timing: timing_plot's panels of the job's report.json with the plot's colours; a name that
    is not a job id is 400, a job without a report or with one that is not JSON a 404 saying so (no traceback)."""
    f = Front(tmp_path)
    f.front.rf.root.mkdir(mode=0o700, exist_ok=True)
    jobs = f.front.rf.jobs
    good, bad, none = "20260101-120000-a1b2c3", "20260101-120001-a1b2c4", "20260101-120002-a1b2c5"
    for job in (good, bad):
        (jobs / job).mkdir(parents=True)
    report = {"job": good, "prompt": {"width": 64, "height": 64, "steps": 2}, "wall_s": 3.0,
              "steps": [{"step": 1, "wall_s": 1.5, "infer_s": 1.0, "host_s": 0.2},
                        {"step": 2, "wall_s": 1.0, "infer_s": 1.1, "computed": False}],
              "branches": {"self": {"calls": 4, "infer_s": 0.8, "load_s": 0.1}, "cross": {"calls": 0}}}
    (jobs / good / "report.json").write_text(json.dumps(report))
    (jobs / bad / "report.json").write_text("{not json")
    (status, data), (s_bad, e_bad), (s_none, e_none), (s_name, e_name) = f.requests(
        [("GET", f"/anima/jobs/{j}/timing", None) for j in (good, bad, none, "not-a-job")])
    assert status == 200, data
    steps = next(p for p in data["panels"] if p["name"] == "steps")
    assert steps["x"] == [1, 2] and steps["computed"] == [True, False]
    # each step's series add up to its wall time (the rest is "other"), or past it where the parts exceed it
    totals = [sum(v[i] for v in steps["series"].values()) for i in range(2)]
    assert totals == pytest.approx([1.5, 1.1])
    assert list(next(p for p in data["panels"] if p["name"] == "branches")["series"]) == ["self"]
    assert all(name in data["colours"] for name in steps["series"])
    assert s_bad == 404 and "cannot be read" in e_bad["error"]
    assert s_none == 404 and "no report.json" in e_none["error"]
    assert s_name == 400 and e_name["error"] == "not a job id"
