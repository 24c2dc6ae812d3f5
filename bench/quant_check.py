"""INT8 measurement (not CI): the outlier preset in the rknn-toolkit2 simulator, smoothing off vs on, side by side.

    .venv/bin/python bench/quant_check.py [--out bench/out/quant] [--blocks 4] [--resolution 256x256] [--steps 20] \
        [--shards N [--cuts self=heads,cross=rows,ffn=rows]] [--turbo --steps 8 --cfg 1]

1) writes the tiny-width synthetic DiT with outlier channels (--blocks blocks) and a tiny models folder;
2) an FP32 pack, calibrated over 3 prompts x 2 seeds x every step (`anima-models calibrate`);
3) two W8A8 packs of the same INT8 layers (fc1, qkv, q): `--smooth off` and `--smooth 0.5`;
4) `quant-check` of each: per-branch cosines vs the FP32 reference on held-out inputs, a --steps job's final latent
   vs the FP16 pack's. With --shards N the W8A8 packs are sharded (each shard its own hybrid-quantized graph; the
   job runs the shards, the table adds each shard's cosine). Writes OUT/quant_check.json (-sN.json); last line
   `quant_check off_worst=X off_final=Y smooth_worst=Z smooth_final=W` (simulator, synthetic weights: measured).
--turbo: a Turbo-like checkpoint, the outlier preset with a synthetic LoRA in the official Turbo LoRA's layout
(models/lora/synth.py `turbo`: blocks and host, rank 32) merged into its weights (models/lora/merged_file.py), as a
Turbo checkpoint is the base with the distillation's update merged; calibrated and checked on its own jobs at
--steps / --cfg (Turbo: 8 steps, cfg 1).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS = ("1girl, blue hair, school uniform, smiling", "a mountain lake at dawn, mist, pine trees",
           "cyberpunk street at night, neon signs, rain")


def _turbo_like(base: Path, out: Path) -> Path:
    """`base` with a synthetic Turbo-layout LoRA merged into its block and host weights."""
    from models.dit.checkpoint import DiTCheckpoint
    from models.lora import LoraUse, TargetTable, plan_loras
    from models.lora.merged_file import write_merged
    from models.lora.synth import write_lora
    ck = DiTCheckpoint.open(base)
    shapes = {k: ck.shape(k) for k in ck.keys()}
    lora = out / "turbo-lora.safetensors"
    write_lora((shapes, None), 43, lora, "turbo", rank=32, groups=("blocks", "host"))
    plan = plan_loras([LoraUse(str(lora), 1.0, 0.0, lora.name)], TargetTable(shapes))
    merged = out / "turbo-like.safetensors"
    write_merged(base, plan, merged)
    return merged


def _prepare(out: Path, blocks: int, res: tuple, steps: int, cfg: float = 4.0, turbo: bool = False) -> tuple:
    from models.commands.cli import main
    from models.dit.synth import write_dit
    from models.setup.models_dir import write_bundle
    from models.packs.pack import build_pack
    ck = out / "outliers.safetensors"
    if not ck.exists():
        write_dit("tiny", 0, ck, outliers=True, blocks=blocks)
    if turbo:
        ck = _turbo_like(ck, out)
    models = out / "models"
    if not (models / "text_encoders").exists():
        write_bundle("tiny", 0, models)
    p32 = build_pack(ck, out / "fp32", res, "fp32", overwrite=True)
    (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    calib = out / "calib"
    t0 = time.perf_counter()
    assert main(["calibrate", str(p32), "--models", str(models), "--dit", str(ck), "--prompts",
                 str(out / "prompts.txt"), "--out", str(calib), "--seeds", "0,1", "--steps", str(steps),
                 "--cfg", str(cfg), "--samples", "8", "--holdout", "4"]) == 0
    return ck, calib, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "quant"))
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--resolution", default="256x256")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--venv", default=None, help="rknn-toolkit2 environment")
    ap.add_argument("--shards", type=int, default=1, help="build the W8A8 packs with --shards N (1-3)")
    ap.add_argument("--cuts", default=None, help="with --shards: KIND=CUT,... (default: the board model's choice)")
    ap.add_argument("--cfg", type=float, default=4.0, help="CFG scale of the calibration and the job (Turbo: 1)")
    ap.add_argument("--turbo", action="store_true", help="a Turbo-like checkpoint (a Turbo-layout LoRA merged in)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from models.dit.partition import parse_resolution
    from models.packs.pack import build_pack, load_pack
    from models.runtime.quant_check import describe, quant_check
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from models.packs.sharded import parse_cuts
    res = parse_resolution(args.resolution)
    cuts = parse_cuts(args.cuts)
    ck, calib, calib_s = _prepare(out, args.blocks, res, args.steps, args.cfg, args.turbo)
    fp16 = build_pack(ck, out / "fp16", res, "fp16", overwrite=True)
    report = {"what": "measured in the rknn-toolkit2 2.5.0 simulator on synthetic weights (outlier preset"
                      + (", a Turbo-layout LoRA merged)" if args.turbo else ")"),
              "blocks": args.blocks, "resolution": list(res), "steps": args.steps, "calibrate_s": round(calib_s, 1),
              "shards": args.shards, "cfg": args.cfg, "turbo": args.turbo}
    for name, alpha in (("off", None), ("smooth", 0.5)):
        pack = build_pack(ck, out / f"w8a8-{name}", res, "fp16", overwrite=True, shards=args.shards, cuts=cuts,
                          quant=(calib, ("fc1", "qkv", "q"), alpha))
        report["cuts"] = load_pack(pack).manifest.get("shards", {}).get("cuts", {})
        rep = quant_check(pack, ck, calib, steps=args.steps, cfg_scale=args.cfg, venv=args.venv, fp16_pack=fp16)
        print(f"--- smoothing {name}\n{describe(rep)}", flush=True)
        report[name] = rep
    fname = "quant_check.json" if args.shards == 1 else f"quant_check-s{args.shards}.json"
    (out / fname).write_text(json.dumps(report, indent=1, default=str) + "\n")
    side = [f"{r['off']['branch']:<10} {r['off']['cos']:.6f} {r['smooth']['cos']:.6f}" for r in
            ({"off": a, "smooth": b} for a, b in zip(report["off"]["branches"], report["smooth"]["branches"]))]
    print("branch     off       smooth\n" + "\n".join(side))
    print(f"quant_check off_worst={report['off']['worst_cos']:.6f} off_final={report['off']['final_cos']:.6f} "
          f"smooth_worst={report['smooth']['worst_cos']:.6f} smooth_final={report['smooth']['final_cos']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
