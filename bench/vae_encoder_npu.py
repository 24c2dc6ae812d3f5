"""Full-size VAE encoder on the NPU path (not CI): VAE encoder packs of the synthetic full VAE compiled by
rknn-toolkit2 2.5.0 and run in its simulator against the FP32 torch encoder.

    .venv/bin/python bench/vae_encoder_npu.py [--out bench/out/vae_encoder_npu] [--vae FILE] [--resolutions 512x512]
                                              [--tile 32] [--overlap 0.5] [--threads 2]

Per resolution (one pack each): 1) the encoder pack (FP16 calibration: activation ranges, norm scales, headroom);
2) `compile` (build s, .rknn MB, peak RSS, operators left on the CPU); 3) one seeded image encoded by torch FP32 (the
pack's tiling, and whole), ONNX Runtime FP32 (`onnx`) and the simulator (`rknn-sim`): PSNR of the model-space latent
against torch, with the reference latent's peak-to-peak range as the peak (same tiling: the NPU's own error; whole:
with the seams), max |diff|, NaN/Inf. Prints a table, writes OUT/vae_encoder_npu.json.
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
log = logging.getLogger("bench.vae_encoder_npu")
TARGET_PSNR_DB = 40.0


def latent_psnr(got, ref) -> float:
    """PSNR of a latent against the reference, the reference's peak-to-peak range as the peak."""
    ref = np.asarray(ref, np.float64)
    mse = float(np.mean((np.asarray(got, np.float64) - ref) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(float(ref.max() - ref.min()) ** 2 / mse)


def _compiled_rows(pack) -> list:
    rows = []
    for b in pack.manifest["branches"]:
        e = b["rknn"]
        rows.append({"name": b["name"], "calls": b["calls"], "onnx_bytes": b["bytes"], "rknn_bytes": e.get("bytes"),
                     "build_s": e.get("build_s"), "peak_rss_mb": e.get("peak_rss_mb"), "cpu_ops": e.get("cpu_ops")})
    return rows


def one(vae: Path, out: Path, res: tuple, tile: int, overlap: float, threads: int, seed: int) -> dict:
    from models.rknn.compile import compile_pack
    from models.runtime.backends import make_backend
    from models.vae.encode import TorchEncoder
    from models.vae.encoder_pack import build_vae_encoder_pack, calibration_image, load_vae_encoder_pack
    from models.vae.pack_encoder import PackEncoder
    w, h = res
    name = f"vae-enc-{w}x{h}-t{tile}"
    row = {"resolution": f"{w}x{h}", "tile": tile, "overlap": overlap, "pack": str(out / name)}
    t0 = time.perf_counter()
    pack = load_vae_encoder_pack(build_vae_encoder_pack(vae, out / name, (w, h), tile, overlap, overwrite=True,
                                                        threads=threads))
    row["pack_s"], row["fp16"], row["tiling"] = time.perf_counter() - t0, pack.manifest["fp16"], pack.manifest["tiling"]
    t0 = time.perf_counter()
    row["compile"] = compile_pack(pack.dir, target="rk3588", jobs=1)
    row["compile_s"] = time.perf_counter() - t0
    pack = load_vae_encoder_pack(pack.dir)
    row["models"] = _compiled_rows(pack)
    img = calibration_image(seed, h, w)
    tv = TorchEncoder.open(vae, threads=threads)
    t0 = time.perf_counter()
    ref_tiled = tv.encode(img, tile=tile, overlap=overlap).latent
    row["torch_tiled_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref_whole = tv.encode(img, tile=None).latent
    row["torch_whole_s"] = time.perf_counter() - t0
    del tv
    row["tiled_vs_whole_db"] = latent_psnr(ref_tiled, ref_whole)
    for backend, kw in (("onnx", {"threads": threads}), ("rknn-sim", {})):
        t0 = time.perf_counter()
        lat = PackEncoder(pack, make_backend(backend, **kw)).encode(img).latent
        row[backend] = {"s": time.perf_counter() - t0, "psnr_vs_torch_same_tiling_db": latent_psnr(lat, ref_tiled),
                        "psnr_vs_torch_whole_db": latent_psnr(lat, ref_whole),
                        "max_abs_diff": float(np.abs(lat - ref_tiled).max()),
                        "nonfinite": int(lat.size - np.count_nonzero(np.isfinite(lat)))}
        log.info("%s %s: %s", name, backend, row[backend])
    row["ok"] = (row["rknn-sim"]["psnr_vs_torch_same_tiling_db"] >= TARGET_PSNR_DB
                 and row["rknn-sim"]["nonfinite"] == 0)
    return row


def _print(rows: list, vae: Path, out: Path) -> None:
    print(f"\nVAE encoder packs of {vae.name}: rknn-toolkit2 simulator vs FP32 torch (latent PSNR in dB, peak = the "
          f"reference's range), load average {os.getloadavg()[0]:.1f}")
    print(f"{'pack':<18}{'tiles':>6}{'build s':>9}{'rknn MB':>9}{'RSS MB':>8}  {'CPU ops':<9}{'sim dB':>8}"
          f"{'(whole)':>9}{'onnx dB':>9}{'tiled/whole dB':>15}{'NaN/Inf':>8}")
    for r in rows:
        ms = r["models"]
        cpu = sum(len(m["cpu_ops"] or []) for m in ms)
        print(f"{r['resolution'] + ' t' + str(r['tile']):<18}{r['tiling']['count']:>6}"
              f"{sum(m['build_s'] or 0 for m in ms):>9.1f}{sum(m['rknn_bytes'] or 0 for m in ms) / 1e6:>9.1f}"
              f"{max(m['peak_rss_mb'] or 0 for m in ms):>8.0f}  {cpu if cpu else 'none':<9}"
              f"{r['rknn-sim']['psnr_vs_torch_same_tiling_db']:>8.1f}{r['rknn-sim']['psnr_vs_torch_whole_db']:>9.1f}"
              f"{r['onnx']['psnr_vs_torch_same_tiling_db']:>9.1f}{r['tiled_vs_whole_db']:>15.1f}"
              f"{r['rknn-sim']['nonfinite']:>8}")
    ok = all(r["ok"] for r in rows)
    print(f"{'PASS' if ok else 'FAIL'}: simulator PSNR >= {TARGET_PSNR_DB} dB (same tiling), no NaN/Inf; wrote "
          f"{out / 'vae_encoder_npu.json'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "vae_encoder_npu"))
    ap.add_argument("--vae", help="VAE file (default: the synthetic full VAE, written to OUT once)")
    ap.add_argument("--resolutions", default="512x512")
    ap.add_argument("--tile", type=int, default=32)
    ap.add_argument("--overlap", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from models.dit.partition import parse_resolution
    from models.vae.synth import write_vae
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vae = Path(args.vae) if args.vae else out / "qwen_image_vae_full.safetensors"
    if not vae.exists():
        write_vae("full", 0, vae)
    rows = []
    for r in (x for x in args.resolutions.split(",") if x):
        rows.append(one(vae, out, parse_resolution(r), args.tile, args.overlap, args.threads, args.seed))
        (out / "vae_encoder_npu.json").write_text(json.dumps({"rows": rows, "load_average": os.getloadavg(),
                                                              "target_psnr_db": TARGET_PSNR_DB}, indent=1) + "\n")
    _print(rows, vae, out)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
