"""Full-size VAE on the NPU path (not CI): VAE packs of the synthetic full VAE compiled by rknn-toolkit2 2.5.0 and
decoded in its simulator against the FP32 torch decode.

    .venv/bin/python bench/vae_npu.py [--out bench/out/vae_npu] [--vae FILE] [--resolutions 512x512,512x768]
                                      [--tile 32] [--overlap 0.5] [--extra 512x512:64] [--threads 2]

Per resolution (one pack each): 1) `pack-vae` (FP16 calibration: activation ranges, norm scales, headroom);
2) `compile` (build s, .rknn MB, peak RSS, layers, operators left on the CPU); 3) one seeded model-space latent
decoded by torch FP32 (the pack's tiling, and whole), ONNX Runtime FP32 (`onnx`) and the simulator (`rknn-sim`):
PSNR against torch (same tiling: the NPU's own error; whole: with the seams), max |diff|, NaN/Inf; 4) the NPU decode
ESTIMATE (models/vae/npu_estimate.py: FLOPs ÷ the reference FFN throughput + lifecycle per byte) — modelled, not
measured. `--extra RES:TILE` adds a pack with another tile size (e.g. 512x512:64, one tile = the whole image).
Prints a table, writes OUT/vae_npu.json; the packs stay in OUT for bench/bench_vae_backends.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
log = logging.getLogger("bench.vae_npu")
TARGET_PSNR_DB = 40.0


def psnr(a, b) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))    # images in [0, 1]
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def one(vae: Path, out: Path, res: tuple, tile: int, overlap: float, threads: int, seed: int) -> dict:
    from models.runtime.backends import make_backend
    from models.rknn.compile import compile_pack
    from models.vae import VAE
    from models.vae.api import to_uint8
    from models.vae.npu_estimate import describe, estimate
    from models.vae.pack import build_vae_pack, load_vae_pack
    from models.vae.pack_decoder import PackDecoder
    w, h = res
    name = f"vae-{w}x{h}-t{tile}"
    row = {"resolution": f"{w}x{h}", "tile": tile, "overlap": overlap, "pack": str(out / name)}
    # 1) pack (calibration included)
    t0 = time.perf_counter()
    pack = load_vae_pack(build_vae_pack(vae, out / name, (w, h), tile, overlap, overwrite=True, threads=threads))
    row["pack_s"] = time.perf_counter() - t0
    row["fp16"] = pack.manifest["fp16"]
    row["tiling"] = pack.manifest["tiling"]
    # 2) compile (one process per model)
    t0 = time.perf_counter()
    rep = compile_pack(pack.dir, target="rk3588", jobs=1)
    row["compile_s"] = time.perf_counter() - t0
    row["compile"] = rep
    pack = load_vae_pack(pack.dir)
    row["models"] = [{k: b.get(k) for k in ("name", "gflop", "calls", "bytes")} |
                     {k: b["rknn"].get(k) for k in ("bytes", "build_s", "peak_rss_mb", "layers", "npu_layers",
                                                    "cpu_ops")} | {"onnx_bytes": b["bytes"]}
                     for b in pack.manifest["branches"]]
    for m in row["models"]:
        m["rknn_bytes"] = m.pop("bytes")
    # 3) decodes of one latent
    lat = np.random.default_rng(seed).standard_normal(pack.latent_shape, dtype=np.float32)
    tv = VAE.open(vae, threads=threads)
    t0 = time.perf_counter()
    ref_tiled = tv.decode(lat, tile=tile, overlap=overlap).array
    row["torch_tiled_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref_whole = tv.decode(lat, tile=None).array
    row["torch_whole_s"] = time.perf_counter() - t0
    del tv
    row["tiled_vs_whole_db"] = psnr(ref_tiled, ref_whole)
    for backend, kw in (("onnx", {"threads": threads}), ("rknn-sim", {})):
        t0 = time.perf_counter()
        res_ = PackDecoder(pack, make_backend(backend, **kw)).decode(lat)
        a = res_.array
        row[backend] = {"s": time.perf_counter() - t0, "psnr_vs_torch_same_tiling_db": psnr(a, ref_tiled),
                        "psnr_vs_torch_whole_db": psnr(a, ref_whole),
                        "max_abs_diff": float(np.abs(a - ref_tiled).max()),
                        "nonfinite": int(a.size - np.count_nonzero(np.isfinite(a))),
                        "u8_max_diff": int(np.abs(res_.image.astype(np.int16) - to_uint8(ref_tiled)).max())}
        log.info("%s %s: %s", name, backend, row[backend])
    # 4) the ESTIMATE
    row["estimate"] = estimate(pack.manifest)
    row["estimate_line"] = describe(row["estimate"], f"{w}x{h} tile {tile}/{overlap}")
    row["ok"] = (row["rknn-sim"]["psnr_vs_torch_same_tiling_db"] >= TARGET_PSNR_DB
                 and row["rknn-sim"]["psnr_vs_torch_whole_db"] >= TARGET_PSNR_DB
                 and row["rknn-sim"]["nonfinite"] == 0)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "vae_npu"))
    ap.add_argument("--vae", help="VAE file (default: the synthetic full VAE, written to OUT once)")
    ap.add_argument("--resolutions", default="512x512,512x768")
    ap.add_argument("--tile", type=int, default=32)
    ap.add_argument("--overlap", type=float, default=0.5)
    ap.add_argument("--extra", default="", help="more packs as RES:TILE, comma-separated (e.g. 512x512:64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from models.dit.partition import parse_resolution
    from models.vae.synth import write_vae
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vae = Path(args.vae) if args.vae else out / "qwen_image_vae_full.safetensors"
    if not vae.exists():
        write_vae("full", 0, vae)
    runs = [(parse_resolution(r), args.tile) for r in args.resolutions.split(",") if r]
    runs += [(parse_resolution(x.split(":")[0]), int(x.split(":")[1])) for x in args.extra.split(",") if x]
    rows = []
    for res, tile in runs:
        rows.append(one(vae, out, res, tile, args.overlap, args.threads, args.seed))
        (out / "vae_npu.json").write_text(json.dumps({"rows": rows, "load_average": os.getloadavg(),
                                                      "target_psnr_db": TARGET_PSNR_DB}, indent=1) + "\n")
    print(f"\nVAE packs of {vae.name}: rknn-toolkit2 simulator vs FP32 torch (PSNR in dB on [0, 1] images), "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'pack':<22}{'tiles':>6}{'build s':>9}{'rknn MB':>9}{'RSS MB':>8}  {'CPU ops':<10}{'sim dB':>8}"
          f"{'(whole)':>9}{'onnx dB':>9}{'NaN/Inf':>8}{'FP16 room':>10}")
    for r in rows:
        ms = r["models"]
        cpu = sum(len(m["cpu_ops"]) for m in ms)
        print(f"{r['resolution'] + ' t' + str(r['tile']):<22}{r['tiling']['count']:>6}"
              f"{sum(m['build_s'] for m in ms):>9.1f}{sum(m['rknn_bytes'] for m in ms) / 1e6:>9.1f}"
              f"{max(m['peak_rss_mb'] for m in ms):>8.0f}  {cpu if cpu else 'none':<10}"
              f"{r['rknn-sim']['psnr_vs_torch_same_tiling_db']:>8.1f}{r['rknn-sim']['psnr_vs_torch_whole_db']:>9.1f}"
              f"{r['onnx']['psnr_vs_torch_same_tiling_db']:>9.1f}{r['rknn-sim']['nonfinite']:>8}"
              f"{min(v['headroom'] for v in r['fp16']['models'].values()):>9.0f}x")
    for r in rows:
        print(r["estimate_line"])
    ok = all(r["ok"] for r in rows)
    print(f"{'PASS' if ok else 'FAIL'}: simulator PSNR >= {TARGET_PSNR_DB} dB (same tiling and whole), no NaN/Inf; "
          f"wrote {out / 'vae_npu.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
