"""Spectrum vs plain Euler+CFG denoising on the tiny pack: wall time, model evaluations, how far the results drift.

    .venv/bin/python bench/bench_spectrum.py                      # tiny DiT, 256x256, 20 steps, fp32 pack
    .venv/bin/python bench/bench_spectrum.py --steps 28 --resolution 512 --dtype fp16 --json out.json

Not a test: one run of each, side by side. The DiT is the synthetic tiny checkpoint (random weights) run in process
through its pack (host ops + ONNX Runtime branches); contexts are fixed random [512, context_dim] arrays, because what is
measured is the sampler, not the prompt.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from models.sampling.noise import initial_noise
from models.sampling.sampler import Sampler
from models.sampling.spectrum import SpectrumSettings

log = logging.getLogger("bench_spectrum")


def prepare_pack(work: Path, resolution: int, dtype: str, seed: int) -> Path:
    from models.packs.pack import build_pack
    from models.dit.synth import write_dit
    ckpt = work / f"anima-tiny-{seed}.safetensors"
    if not ckpt.exists():
        write_dit("tiny", seed, ckpt, prefix="net.")
    pack = work / f"pack-tiny-{seed}-{resolution}-{dtype}"
    if not (pack / "manifest.json").exists():
        t0 = time.perf_counter()
        build_pack(ckpt, pack, resolution=(resolution, resolution), dtype=dtype)
        log.info("built pack %s in %.1f s", pack, time.perf_counter() - t0)
    return pack


def run_one(runner, sampler: Sampler, latent, ctx_c, ctx_u) -> dict:
    evals = {"n": 0, "model_s": 0.0}

    def model_fn(x, sigma):
        t0 = time.perf_counter()
        out = runner.forward_cfg(x, sigma, ctx_c, ctx_u)
        evals["model_s"] += time.perf_counter() - t0
        evals["n"] += 2                                          # conditional + unconditional pass
        return out

    t0 = time.perf_counter()
    state = sampler.sample(model_fn, latent)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "model_s": evals["model_s"], "sampler_s": wall - evals["model_s"],
            "model_evals": evals["n"], "computed": state.computed, "forecast": state.forecast, "latent": state.latent}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/anima-bench-spectrum", help="folder for the checkpoint and pack (reused)")
    ap.add_argument("--resolution", type=int, default=256, help="square image size in pixels (multiple of 16)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=4.0)
    ap.add_argument("--scheduler", default="sgm_uniform", choices=("sgm_uniform", "simple"))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from models.runtime.dit_runner import DiTRunner

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    pack = prepare_pack(work, args.resolution, args.dtype, args.seed)
    runner = DiTRunner(str(pack), threads=args.threads)
    cfg = runner.cfg
    h = w = args.resolution // 8
    rng = np.random.default_rng(args.seed + 1)
    ctx_c = rng.standard_normal((512, cfg.context_dim), dtype=np.float32)   # [512, Dc] f32
    ctx_u = rng.standard_normal((512, cfg.context_dim), dtype=np.float32)
    latent = initial_noise(args.seed, (cfg.latent_channels, h, w), "comfy")  # [16, h, w] f32

    runner.forward_cfg(latent, 1.0, ctx_c, ctx_u)                          # warm-up (first-load costs)
    base = run_one(runner, Sampler(args.steps, args.cfg, args.scheduler, spectrum=None), latent, ctx_c, ctx_u)
    spec = run_one(runner, Sampler(args.steps, args.cfg, args.scheduler, spectrum=SpectrumSettings()),
                   latent, ctx_c, ctx_u)
    diff = spec["latent"] - base["latent"]
    rel_rms = float(np.sqrt(np.mean(diff ** 2)) / np.sqrt(np.mean(base["latent"] ** 2)))
    result = {
        "resolution": args.resolution, "steps": args.steps, "dtype": args.dtype, "blocks": cfg.blocks,
        "width": cfg.width, "threads": args.threads, "cpu_count": os.cpu_count(),
        "baseline": {k: v for k, v in base.items() if k != "latent"},
        "spectrum": {k: v for k, v in spec.items() if k != "latent"},
        "wall_ratio": spec["wall_s"] / base["wall_s"],
        "eval_ratio": spec["model_evals"] / base["model_evals"],
        "final_latent_rel_rms_diff": rel_rms,
    }
    print(f"\nSpectrum vs baseline, tiny DiT ({cfg.blocks} blocks, width {cfg.width}), {args.resolution}x{args.resolution},"
          f" {args.steps} steps, {args.dtype} pack")
    print(f"{'':10s} {'wall s':>8s} {'model s':>8s} {'s/forward':>9s} {'sampler s':>10s} {'evals':>6s}  computed steps")
    for name, r in (("baseline", base), ("spectrum", spec)):
        per = r["model_s"] / max(1, len(r["computed"]))      # one forward = both CFG passes
        print(f"{name:10s} {r['wall_s']:8.2f} {r['model_s']:8.2f} {per:9.2f} {r['sampler_s']:10.4f} "
              f"{r['model_evals']:6d}  {r['computed']}")
    print(f"wall-time ratio {result['wall_ratio']:.3f}, model-evaluation ratio {result['eval_ratio']:.3f}, "
          f"final latent rel. RMS difference {rel_rms:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
