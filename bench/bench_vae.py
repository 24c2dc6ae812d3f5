"""VAE decode benchmark: ours vs diffusers AutoencoderKLQwenImage at full size, and against the conv2d floor.

    .venv/bin/python bench/bench_vae.py [--latent-size 64] [--threads 2] [--out bench/out/vae.json]

Writes a synthetic full-size VAE (random weights, seed 0), decodes one random model-space latent [16, 64, 64]
(a 512x512 image) with each implementation in its own subprocess (so peak RSS is each one's own), compares the
images (PSNR), counts the decoder's FLOPs analytically and measures a plain conv2d (384->384, 3x3, 128x128) on the
same threads to give the physical floor = FLOPs / conv GFLOP/s. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FLOOR_SHAPE = (384, 384, 128)         # cin, cout, side of the floor's conv2d
FLOOR_REPEATS = 3                     # best of


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0      # Linux: KiB


# -- workers (each runs in its own process) ------------------------------------------------------------------------
def worker(kind: str, vae_path: str, latent_path: str, out_path: str, threads: int, tile: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    latent = np.load(latent_path)
    rss_import = _peak_rss_mb()
    if kind == "ours":
        from models.vae import VAE
        t0 = time.perf_counter()
        vae = VAE.open(vae_path, threads=threads)
        load_s = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
        img = vae.decode_raw(latent, tile=tile if tile > 0 else None)          # [3, H, W]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out = img.clamp(-1, 1).numpy()
    else:
        from diffusers import AutoencoderKLQwenImage
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
        from models.base.safetensors_io import SafeTensorsFile
        from models.vae.checkpoint import load_vae
        cfg = load_vae(vae_path).config
        t0 = time.perf_counter()
        st = SafeTensorsFile(vae_path)
        sd = convert_wan_vae_to_diffusers({k: torch.from_numpy(st.get(k)) for k in st.keys()})
        model = AutoencoderKLQwenImage(base_dim=cfg.base_dim, z_dim=cfg.z_dim).eval()
        model.load_state_dict(sd, strict=True)
        del sd
        load_s = time.perf_counter() - t0
        mean = torch.tensor(model.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(model.config.latents_std).view(1, -1, 1, 1, 1)
        z = torch.from_numpy(latent)[None, :, None] * std + mean                 # [1, 16, 1, h, w]
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.decode(z).sample[0, :, 0].numpy()                        # [3, H, W] in [-1, 1]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    np.save(out_path, out)
    return {"impl": kind, "decode_s": wall, "decode_cpu_s": cpu, "load_s": load_s, "peak_rss_mb": _peak_rss_mb(),
            "rss_after_imports_mb": rss_import, "threads": threads}


def _run_worker(kind, vae, lat, out, threads, tile) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--vae", vae, "--latent-file", lat,
           "--array-out", out, "--threads", str(threads), "--tile", str(tile)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# -- floor -----------------------------------------------------------------------------------------------------------
def conv_floor(threads: int) -> dict:
    """GFLOP/s of one plain 3x3 conv2d (best of NCHW and channels_last, best of FLOOR_REPEATS runs)."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    cin, cout, side = FLOOR_SHAPE
    flops = 2 * cin * cout * 9 * side * side
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, cin, side, side, generator=g)
    w = torch.randn(cout, cin, 3, 3, generator=g) * 0.02
    best, best_cpu = {}, {}
    with torch.inference_mode():
        for name, fmt in (("nchw", torch.contiguous_format), ("channels_last", torch.channels_last)):
            xf, wf = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
            F.conv2d(xf, wf, padding=1)
            ts, cs = [], []
            for _ in range(FLOOR_REPEATS):
                t0, c0 = time.perf_counter(), time.process_time()
                F.conv2d(xf, wf, padding=1)
                ts.append(time.perf_counter() - t0)
                cs.append(time.process_time() - c0)
            best[name] = flops / min(ts) / 1e9
            best_cpu[name] = flops / min(cs) / 1e9
    return {"shape": f"{cin}->{cout} 3x3 at {side}x{side}", "gflops_by_layout": best,
            "gflops": max(best.values()), "gflops_per_cpu_s_by_layout": best_cpu,
            "gflops_per_cpu_s": max(best_cpu.values())}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean(((a - b) / 2.0) ** 2))              # [-1, 1] images -> [0, 1] scale
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latent-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "vae.json"))
    ap.add_argument("--vae", help="use this VAE file instead of writing a synthetic full-size one")
    ap.add_argument("--skip-tiled", action="store_true", help="skip our default tiled decode")
    ap.add_argument("--worker", choices=("ours", "diffusers"), help=argparse.SUPPRESS)
    ap.add_argument("--latent-file", help=argparse.SUPPRESS)
    ap.add_argument("--array-out", help=argparse.SUPPRESS)
    ap.add_argument("--tile", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.vae, args.latent_file, args.array_out, args.threads, args.tile)))
        return 0

    sys.path.insert(0, ROOT)
    from models.vae.checkpoint import load_vae
    from models.vae.flops import decoder_flops
    from models.vae.synth import write_vae

    n = args.latent_size
    with tempfile.TemporaryDirectory(prefix="bench-vae-") as tmp:
        vae = args.vae
        if vae is None:
            vae = os.path.join(tmp, "qwen_image_vae.safetensors")
            t0 = time.perf_counter()
            write_vae("full", 0, vae, "original")
            print(f"wrote synthetic full VAE in {time.perf_counter() - t0:.1f} s", flush=True)
        cfg = load_vae(vae).config
        lat = os.path.join(tmp, "latent.npy")
        np.save(lat, np.random.default_rng(0).standard_normal((cfg.z_dim, n, n)).astype(np.float32))
        fl = decoder_flops(cfg, n, n)
        floor_before = conv_floor(args.threads)
        print(f"conv2d floor: {floor_before['gflops']:.1f} GFLOP/s", flush=True)
        runs = {}
        for kind, tile in (("ours", 0), ("diffusers", 0)) + (() if args.skip_tiled else (("ours", 32),)):
            name = kind if tile == 0 else f"{kind}-tiled{tile}"
            arr = os.path.join(tmp, f"{name}.npy")
            runs[name] = _run_worker(kind, vae, lat, arr, args.threads, tile)
            runs[name]["array"] = arr
            print(f"{name}: {runs[name]['decode_s']:.1f} s", flush=True)
        floor_after = conv_floor(args.threads)
        ref = np.load(runs["diffusers"]["array"])
        for name, r in runs.items():
            r["psnr_vs_diffusers_db"] = psnr(np.load(r.pop("array")), ref)
    gflops = max(floor_before["gflops"], floor_after["gflops"])
    floor_s = fl["total"] / (gflops * 1e9)
    gflops_cpu = max(floor_before["gflops_per_cpu_s"], floor_after["gflops_per_cpu_s"])
    floor_cpu_s = fl["total"] / (gflops_cpu * 1e9)
    ours, diff = runs["ours"], runs["diffusers"]
    result = {
        "latent": [cfg.z_dim, n, n], "image": [3, n * cfg.upscale, n * cfg.upscale], "threads": args.threads,
        "config": cfg.to_dict(), "flops": fl, "conv_floor": {"before": floor_before, "after": floor_after,
                                                              "gflops_used": gflops},
        "floor_s": floor_s, "floor_cpu_s": floor_cpu_s, "runs": runs,
        "speedup_vs_diffusers": diff["decode_s"] / ours["decode_s"],
        "speedup_vs_diffusers_cpu": diff["decode_cpu_s"] / ours["decode_cpu_s"],
        "ours_vs_floor": ours["decode_s"] / floor_s,
        "ours_vs_floor_cpu": ours["decode_cpu_s"] / floor_cpu_s,
        "load_average": os.getloadavg(),
        "ours_achieved_gflops": fl["total"] / ours["decode_s"] / 1e9,
        "targets": {"psnr_db_min": 40.0, "speedup_min": 2.0, "vs_floor_max": 1.3},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nVAE decode {n}x{n} latent -> {n * cfg.upscale}x{n * cfg.upscale}, {args.threads} threads, "
          f"{fl['total'] / 1e12:.3f} TFLOP (2D convs + attention)")
    print(f"conv2d floor {gflops:.1f} GFLOP/s -> floor {floor_s:.1f} s wall; "
          f"{gflops_cpu:.1f} GFLOP per CPU-second -> floor {floor_cpu_s:.1f} CPU-s "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"{'impl':<16}{'decode s':>10}{'CPU s':>8}{'load s':>9}{'peak RSS MB':>13}{'PSNR dB':>10}{'GFLOP/s':>10}")
    for name, r in runs.items():
        print(f"{name:<16}{r['decode_s']:>10.1f}{r['decode_cpu_s']:>8.1f}{r['load_s']:>9.1f}{r['peak_rss_mb']:>13.0f}"
              f"{r['psnr_vs_diffusers_db']:>10.1f}{fl['total'] / r['decode_s'] / 1e9:>10.1f}")
    print(f"speedup vs diffusers {result['speedup_vs_diffusers']:.2f}x wall, "
          f"{result['speedup_vs_diffusers_cpu']:.2f}x CPU (target >= 2); ours / floor "
          f"{result['ours_vs_floor']:.2f} wall, {result['ours_vs_floor_cpu']:.2f} CPU (target <= 1.3)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
