"""A 1024x1024 job through the REAL pipeline on this machine (not CI: minutes on 2 shared cores): supervisord and every
stage, the tiny model (tiny widths, all 28 blocks, random weights) at 4,096 image tokens on ONNX Runtime (CPU).

    .venv/bin/python bench/one_mp_job.py [--resolution 1024x1024] [--steps 1] [--cache /tmp/anima-one-mp] [--json F]

Checks what a 1 MP job must do as a 512x512 one does: the PNG is the size asked for, the encoder and the VAE were not
running while the denoise ran (supervisord's states sampled during the job, the report's teardown), every branch
call served once in strict block order (the executor's trace), nothing left behind (shared-memory segments, stray
processes). Last line: `one_mp_job resolution=WxH png=WxH steps=N branch_calls=N encoder_down=B vae_down=B
job_s=S load=L` (load: /proc/loadavg's 1-minute figure at the end: the time is this machine's, shared).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.dit.partition import KINDS, parse_resolution  # noqa: E402


def run(size: tuple, steps: int, cache: Path, threads: int) -> dict:
    from PIL import Image
    from tests.pipeline_harness import Pipeline, tiny_assets
    t = time.monotonic()
    models, pack = tiny_assets(cache, resolution=size)
    prep_s = time.monotonic() - t
    with Pipeline.start(models, pack, threads=threads, branch_timeout_s=600.0) as pipe:
        t = time.monotonic()
        job = pipe.submit({"prompt": "1girl, silver hair", "negative_prompt": "worst quality", "seed": 7,
                           "steps": steps, "cfg": 4.0, "width": size[0], "height": size[1], "spectrum": False})
        info = pipe.wait(job, ("done", "failed", "cancelled"), timeout_s=3600.0)
        job_s = time.monotonic() - t
        if info.state != "done":
            raise SystemExit(f"one_mp_job: the job ended {info.state}: {info.error_stage}: {info.error}\n"
                             f"{pipe.logs()}")
        with Image.open(info.image) as img:
            png = img.size
        r = pipe.report(job)
        trace = pipe.trace(job)
        blocks = r["branch_calls"] // (3 * len(r["computed_steps"]))
        order = [(s, b, k) for s in r["computed_steps"] for b in range(blocks) for k in KINDS]
        served = [(c["step"], c["block"], c["branch"]) for c in trace]
        clean = {"segments": pipe.leftover_segments(), "strays": [str(p) for p in pipe.strays()]}
    td = r["teardown"]
    return {"resolution": f"{size[0]}x{size[1]}", "png": list(png), "steps": steps, "job_s": round(job_s, 1),
            "prep_s": round(prep_s, 1), "branch_calls": r["branch_calls"], "strict_order": served == order,
            "encoder_down": td["encoder_running_during_denoise"] is False,
            "vae_down": td["vae_running_during_denoise"] is False, "teardown_samples": td["samples"],
            "stages": {k: {"wall_s": v.get("wall_s"), "peak_rss_mb": v.get("peak_rss_mb")}
                       for k, v in r["stages"].items()}, "left_behind": clean,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resolution", default="1024x1024")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default="/tmp/anima-one-mp", help="where the tiny models folder and pack are kept")
    ap.add_argument("--json", default=None, help="default bench/out/one_mp_job-WxH.json")
    args = ap.parse_args(argv)
    try:
        size = parse_resolution(args.resolution)
    except ValueError as e:
        print(f"bench/one_mp_job.py: --resolution: {e}", file=sys.stderr)
        return 2
    if not 1 <= args.steps <= 100:
        print(f"bench/one_mp_job.py: --steps {args.steps}: must be in 1..100", file=sys.stderr)
        return 2
    res = run(size, args.steps, Path(args.cache), args.threads)
    out = Path(args.json or ROOT / "bench" / "out" / f"one_mp_job-{res['resolution']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    ok = res["png"] == list(size) and res["encoder_down"] and res["vae_down"] and res["strict_order"] and \
        not res["left_behind"]["segments"] and not res["left_behind"]["strays"]
    print(f"one_mp_job resolution={res['resolution']} png={res['png'][0]}x{res['png'][1]} steps={res['steps']} "
          f"branch_calls={res['branch_calls']} encoder_down={res['encoder_down']} vae_down={res['vae_down']} "
          f"job_s={res['job_s']} load={res['loadavg'][0]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
