"""The daemon and the front with many finished jobs: the daemon's RSS growth and the times of STATUS and `/history`.

    .venv/bin/python bench/history_scale.py --jobs 3000 --json bench/out/history_scale.json

The real supervisord, daemon and HTTP front over stand-in stages (tests/doubles_harness.py). One job goes through the
front as a ComfyUI graph (a real record: its spec and its origin with the graph); its job.json is then copied
`--jobs` times into the run's jobs folder (new ids, one second apart, state done) and the daemon is restarted to
read them. Measured here (wall time on this machine, the median of `--repeat` tries, after one warm-up try):
the daemon's RSS with the one job and with all of them (psutil on supervisord's pid), one STATUS (the CLI's
`orchestrator status`), `/history` (64 jobs, ComfyUI's default) and `/history?max_items=1024`. Prints a table; the
last line is `jobs=<n> rss_growth_mb=<x> status_s=<x> history_s=<x> history_1024_s=<x>`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from protocol import messages as m  # noqa: E402
from tests.comfy_graphs import standard_graph  # noqa: E402
from tests.doubles_harness import SOURCE, Doubles  # noqa: E402

NAMES = {"unet": SOURCE["name"], "clip": "any-te.safetensors", "vae": "any-vae.safetensors"}
HTTP_TIMEOUT_S = 600.0


def _rss_mb(d: Doubles) -> float:
    return psutil.Process(d.sup.info("orchestrator").pid).memory_info().rss / 2**20


def _timed(fn, repeat: int) -> float:
    fn()                                             # warm-up: the first look may read the records
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _clone_jobs(d: Doubles, template: dict, n: int) -> None:
    """`n` finished copies of one job record, one second apart, older than the template (it stays the newest)."""
    t_end = template["created"] - 1.0
    for i in range(n):
        created = t_end - (n - i)
        job_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(created)) + f"-{i:06x}"
        rec = {**template, "id": job_id, "created": created, "updated": created + 0.5,
               "history": [["queued", created, "submitted"], ["done", created + 0.5, ""]]}
        folder = d.rf.jobs / job_id
        folder.mkdir(mode=0o700)
        (folder / "job.json").write_text(json.dumps(rec, indent=1, sort_keys=True))


def measure(d: Doubles, jobs: int, repeat: int) -> dict:
    url = d.http_url()
    r = requests.post(url + "prompt", json={"prompt": standard_graph(width=64, height=64, steps=1, names=NAMES)},
                      timeout=30)
    r.raise_for_status()
    first = r.json()["prompt_id"]
    deadline = time.monotonic() + 120
    while d.status(job=first).jobs[0].state != "done":
        assert time.monotonic() < deadline, f"job {first} did not finish\n{d.logs()}"
        time.sleep(0.05)

    def probes() -> dict:
        return {"status_s": _timed(lambda: d.status(), repeat),
                "history_s": _timed(lambda: requests.get(url + "history", timeout=HTTP_TIMEOUT_S).raise_for_status(),
                                    repeat),
                "history_1024_s": _timed(lambda: requests.get(url + "history?max_items=1024",
                                                              timeout=HTTP_TIMEOUT_S).raise_for_status(), repeat)}

    def restart_daemon() -> None:
        d.close_client()
        d.sup.restart("orchestrator")
        deadline = time.monotonic() + 120
        while True:
            try:
                d.status(limit=1)
                return
            except Exception:  # noqa: BLE001 - the daemon is still reading its records
                assert time.monotonic() < deadline, f"the daemon did not come back\n{d.logs()}"
                time.sleep(0.2)

    restart_daemon()                                 # both sides start from a daemon that read its records
    one = {"rss_mb": _rss_mb(d), **probes()}
    one["rss_after_mb"] = _rss_mb(d)
    template = json.loads((d.rf.jobs / first / "job.json").read_text())
    _clone_jobs(d, template, jobs)
    restart_daemon()
    many = {"rss_mb": _rss_mb(d), **probes()}
    many["rss_after_mb"] = _rss_mb(d)
    listed = requests.get(url + "history?max_items=1024", timeout=HTTP_TIMEOUT_S).json()
    assert len(listed) == 1024, len(listed)
    return {"jobs": jobs + 1, "repeat": repeat, "one_job": one, "many_jobs": many,
            "rss_growth_mb": many["rss_after_mb"] - one["rss_after_mb"]}


def table(res: dict) -> str:
    one, many = res["one_job"], res["many_jobs"]
    rows = [("daemon RSS after the probes (MB)", one["rss_after_mb"], many["rss_after_mb"], "{:.1f}"),
            ("STATUS, newest 256 (s)", one["status_s"], many["status_s"], "{:.4f}"),
            ("/history (64 jobs) (s)", one["history_s"], many["history_s"], "{:.4f}"),
            ("/history?max_items=1024 (s)", one["history_1024_s"], many["history_1024_s"], "{:.4f}")]
    lines = [f"{'measured here':<36}{'1 job':>12}{str(res['jobs']) + ' jobs':>12}"]
    lines += [f"{name:<36}{fmt.format(a):>12}{fmt.format(b):>12}" for name, a, b, fmt in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=3000, help="finished jobs to add (default 3000)")
    ap.add_argument("--repeat", type=int, default=3, help="tries per probe, the median is kept (default 3)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="anima-history-"))
    try:
        with Doubles.start(root, [(64, 64)]) as d:
            res = measure(d, args.jobs, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    many = res["many_jobs"]
    line = (f"jobs={res['jobs']} rss_growth_mb={res['rss_growth_mb']:.1f} status_s={many['status_s']:.4f} "
            f"history_s={many['history_s']:.4f} history_1024_s={many['history_1024_s']:.4f}")
    print(table(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**res, "summary": line}, indent=1))
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
