"""What drawing timing.png costs, and why it runs in a child process: the child's wall time and peak RSS per job, vs
what importing matplotlib and drawing once would add to the long-lived daemon's own RSS.

    .venv/bin/python bench/bench_timing_plot.py [--runs 5] [--steps 30] [--json bench/out/timing_plot.json]

The report is a realistic full-size one (30 steps, 84 branch calls per computed step, every stage's memory trace at
its 600-point cap), made up here: the figures only shape the picture, what is measured is the drawing.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from models.base.durable import atomic_write
from models.dit.partition import KINDS
from orchestrator.engine.report import MEMORY_POINTS


def make_report(steps: int) -> dict:
    computed = [s for s in range(1, steps + 1) if s <= 4 or s % 2 == 0 or s > steps - 3]
    rows = [{"step": s, "computed": s in computed, "wall_s": 47.0 if s in computed else 0.02,
             "infer_s": 30.0 if s in computed else 0.0, "lifecycle_s": 9.0 if s in computed else 0.0,
             "host_s": 6.5 if s in computed else 0.0, "host_work_s": 6.5 if s in computed else 0.0,
             "transport_s": 0.8 if s in computed else 0.0, "calls": 84 if s in computed else 0} for s in range(1, steps + 1)]
    span = 47.0 * len(computed)
    series = {stage: [[round(i * span / MEMORY_POINTS, 3), 500.0 + (i % 50)] for i in range(MEMORY_POINTS)]
              for stage in ("scheduler", "executor")}
    series["encoder"] = [[i * 0.2, 3000.0] for i in range(150)]
    series["vae"] = [[span + 30 + i * 0.2, 900.0] for i in range(300)]
    calls = 28 * len(computed)
    return {"job": "bench", "prompt": {"width": 512, "height": 512, "steps": steps}, "branch_calls": len(KINDS) * calls,
            "wall_s": span + 120, "steps": rows, "phases": [["encoding", 0, 30], ["denoising", 30, 30 + span],
                                                            ["decoding", 30 + span, span + 120]],
            "branches": {k: {"load_s": 40.0, "init_s": 120.0, "infer_s": 900.0, "release_s": 5.0, "calls": calls}
                         for k in KINDS},
            "memory": {"series": series}}


def child_runs(report_path: Path, runs: int) -> list[dict]:
    out = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "orchestrator.engine.timing_plot", str(report_path)], check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out.append({"wall_s": wall, "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
                    "max_rss_mb": after.ru_maxrss / 1024})
    return out


IN_PROCESS = """
import json, resource, sys
from models.runtime.probes import status_kb
def rss():
    return status_kb()["VmRSS"] / 1024
import orchestrator.engine.plan.run, orchestrator.engine.daemon          # what the daemon has loaded anyway
base = rss()
from orchestrator.engine import timing_plot
timing_plot.render(json.load(open(sys.argv[1])))
print(json.dumps({"daemon_like_rss_mb": base, "after_draw_rss_mb": rss()}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default="bench/out/timing_plot.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        report.write_text(json.dumps(make_report(args.steps)))
        runs = child_runs(report, args.runs)
        size = (Path(tmp) / "timing.png").stat().st_size
        r = subprocess.run([sys.executable, "-c", IN_PROCESS, str(report)], check=True, capture_output=True, text=True)
        inproc = json.loads(r.stdout)
    walls = sorted(x["wall_s"] for x in runs)
    result = {"runs": runs, "png_bytes": size, "median_wall_s": walls[len(walls) // 2],
              "max_rss_mb": max(x["max_rss_mb"] for x in runs), **inproc,
              "in_process_growth_mb": inproc["after_draw_rss_mb"] - inproc["daemon_like_rss_mb"]}
    print(f"{'timing.png, child process':<40} {'median wall s':>14} {'cpu s':>8} {'peak RSS MB':>12}")
    print(f"{f'{args.steps} steps, {args.runs} runs, {size // 1024} KiB PNG':<40} {result['median_wall_s']:>14.2f} "
          f"{sorted(x['cpu_s'] for x in runs)[len(runs) // 2]:>8.2f} {result['max_rss_mb']:>12.1f}")
    print(f"drawing in the daemon instead: its RSS {inproc['daemon_like_rss_mb']:.1f} MB -> "
          f"{inproc['after_draw_rss_mb']:.1f} MB (+{result['in_process_growth_mb']:.1f} MB for the rest of its life)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
