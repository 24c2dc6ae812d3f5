"""VAE decoder backends, side by side: a whole 512x512 decode through torch (today's decoder, tiled 32 / 0.5 as the
stage runs it) and through a VAE pack on ONNX Runtime, each in its own process (wall, CPU seconds, load, peak RSS,
whether torch was imported), the NPU decode ESTIMATE of the same pack, and the decoder's conv shapes one by one.

    .venv/bin/python bench/bench_vae_backends.py [--threads 2] [--vae FILE] [--vae-pack DIR] [--skip-convs]
                                                 [--out bench/out/vae_backends.json]

Decode: the full-size synthetic VAE and its 512x512 pack (bench/out/vae_npu/ when bench/vae_npu.py made them, so
the pack is compiled and the lifecycle estimate uses its real .rknn bytes; else written here), one seeded latent.
The NPU figures are an ESTIMATE (models/vae/npu_estimate.py: FLOPs / the reference FFN branch's throughput +
lifecycle per byte), modelled from the reference board's figures, not measured.
Convs (~97% of the FLOPs): each of the decoder's conv shapes timed best of 3 after a warm-up, in wall and CPU seconds
(the CPU figure is less sensitive to other processes on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NPU_OUT = os.path.join(HERE, "out", "vae_npu")                 # what bench/vae_npu.py leaves behind
RESOLUTION = (512, 512)
# (cin, cout, kernel, side): the decoder's conv families at a 64x64 latent (512x512 image)
SHAPES = [(384, 384, 3, 64), (384, 384, 3, 128), (192, 384, 3, 128), (192, 192, 3, 256), (96, 96, 3, 512),
          (384, 768, 2, 129), (192, 384, 2, 257)]   # the last two: the sub-pixel upsample convs (4 phases)
REPEATS = 3


def _best(fn) -> tuple:
    fn()
    ws, cs = [], []
    for _ in range(REPEATS):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        ws.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    return min(ws), min(cs)


def _ort_session(w: np.ndarray, b: np.ndarray, side: int, pad: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    cout, cin, k, _ = w.shape
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[pad] * 4)
    out_side = side + 2 * pad - k + 1
    g = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, side, side])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cout, out_side, out_side])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


# -- whole decodes, one process each -------------------------------------------------------------------------------
def worker(kind: str, vae: str, pack: str, latent: str, out: str, threads: int) -> dict:
    """One decode in this process: torch (VAE file, tile 32 / 0.5), torch-whole (untiled) or onnx (the VAE pack)."""
    lat = np.load(latent)
    t0 = time.perf_counter()
    if kind == "onnx":
        from models.runtime.backends import make_backend
        from models.vae.pack import load_vae_pack
        from models.vae.pack_decoder import PackDecoder
        dec = PackDecoder(load_vae_pack(pack), make_backend("onnx", threads=threads))
        decode = dec.decode
    else:
        from models.vae import VAE
        vae_ = VAE.open(vae, threads=threads)
        decode = (lambda x: vae_.decode(x, tile=32, overlap=0.5)) if kind == "torch" else \
            (lambda x: vae_.decode(x, tile=None))
    load_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    res = decode(lat)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    np.save(out, res.array)
    return {"backend": kind, "decode_s": wall, "decode_cpu_s": cpu, "load_s": load_s,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "torch_imported": "torch" in sys.modules, "timings": res.timings}


def _run_worker(kind: str, vae: str, pack: str, latent: str, out: str, threads: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--vae", vae, "--vae-pack", pack,
           "--latent-file", latent, "--array-out", out, "--threads", str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def decodes(args, tmp: str) -> dict:
    sys.path.insert(0, ROOT)
    from models.vae.npu_estimate import describe, estimate
    from models.vae.pack import build_vae_pack, load_vae_pack
    from models.vae.synth import write_vae
    vae = args.vae or os.path.join(NPU_OUT, "qwen_image_vae_full.safetensors")
    if not os.path.exists(vae):
        vae = os.path.join(tmp, "qwen_image_vae_full.safetensors")
        write_vae("full", 0, vae)
    pack = args.vae_pack or os.path.join(NPU_OUT, "vae-512x512-t32")
    if not os.path.exists(os.path.join(pack, "manifest.json")):
        pack = str(build_vae_pack(vae, os.path.join(tmp, "vae-512"), RESOLUTION, threads=args.threads))
    manifest = load_vae_pack(pack).manifest
    lat = os.path.join(tmp, "latent.npy")
    np.save(lat, np.random.default_rng(0).standard_normal((16, RESOLUTION[1] // 8, RESOLUTION[0] // 8),
                                                          dtype=np.float32))
    runs = {}
    for kind in ("torch", "onnx", "torch-whole"):
        arr = os.path.join(tmp, f"{kind}.npy")
        runs[kind] = _run_worker(kind, vae, pack, lat, arr, args.threads)
        runs[kind]["array"] = arr
        print(f"decode {kind}: {runs[kind]['decode_s']:.1f} s", flush=True)
    ref = np.load(runs["torch"]["array"])
    for r in runs.values():
        a = np.load(r.pop("array"))
        mse = float(np.mean((a.astype(np.float64) - ref) ** 2))
        r["psnr_vs_torch_db"] = float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)
    est = estimate(manifest)
    return {"vae": vae, "pack": pack, "resolution": list(RESOLUTION), "runs": runs, "npu_estimate": est,
            "npu_estimate_line": describe(est, "512x512, the same pack")}


def print_decodes(d: dict, threads: int) -> None:
    print(f"\nVAE decode {d['resolution'][0]}x{d['resolution'][1]} ({os.path.basename(d['vae'])}), {threads} threads, "
          f"each in its own process; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'backend':<34}{'decode s':>9}{'CPU s':>8}{'load s':>8}{'peak RSS MB':>12}{'PSNR dB':>9}  torch")
    names = {"torch": "torch, tiled 32/0.5 (today)", "onnx": "ONNX Runtime, VAE pack 32/0.5",
             "torch-whole": "torch, whole (no tiles)"}
    for k, r in d["runs"].items():
        print(f"{names[k]:<34}{r['decode_s']:>9.1f}{r['decode_cpu_s']:>8.1f}{r['load_s']:>8.1f}"
              f"{r['peak_rss_mb']:>12.0f}{r['psnr_vs_torch_db']:>9.1f}  {'yes' if r['torch_imported'] else 'no'}")
    t, o = d["runs"]["torch"], d["runs"]["onnx"]
    print(f"ONNX Runtime / torch (tiled, the same plan): {o['decode_s'] / t['decode_s']:.2f}x wall, "
          f"{o['decode_cpu_s'] / t['decode_cpu_s']:.2f}x CPU, {o['peak_rss_mb'] / t['peak_rss_mb']:.2f}x peak RSS")
    print(d["npu_estimate_line"])


def convs(threads: int) -> list:
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    rows = []
    print(f"\n{'conv':<26}{'GFLOP':>7}  GFLOP/s wall (per CPU-s): torch NCHW | torch channels_last | ONNX Runtime")
    for cin, cout, k, side in SHAPES:
        pad = 1
        out_side = side + 2 * pad - k + 1
        flops = 2 * cin * cout * k * k * out_side * out_side
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, cin, side, side, generator=g)
        w = torch.randn(cout, cin, k, k, generator=g) * 0.02
        b = torch.zeros(cout)
        res = {}
        with torch.inference_mode():
            res["torch_nchw"] = _best(lambda: F.conv2d(x, w, b, padding=pad))
            xc, wc = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
            res["torch_channels_last"] = _best(lambda: F.conv2d(xc, wc, b, padding=pad))
        sess, xn = _ort_session(w.numpy(), b.numpy(), side, pad, threads), x.numpy()
        res["onnxruntime"] = _best(lambda: sess.run(None, {"x": xn}))
        row = {"cin": cin, "cout": cout, "kernel": k, "side": side, "gflop": flops / 1e9,
               "gflops_wall": {n: flops / t[0] / 1e9 for n, t in res.items()},
               "gflops_per_cpu_s": {n: flops / t[1] / 1e9 for n, t in res.items()}}
        rows.append(row)
        cells = " | ".join(f"{row['gflops_wall'][n]:6.1f} ({row['gflops_per_cpu_s'][n]:5.1f})" for n in res)
        print(f"{cin}->{cout} {k}x{k} at {side}x{side}".ljust(26) + f"{flops / 1e9:>7.1f}  {cells}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "vae_backends.json"))
    ap.add_argument("--vae", help="VAE file (default: bench/out/vae_npu's, else a synthetic full one)")
    ap.add_argument("--vae-pack", help="its 512x512 VAE pack (default: bench/out/vae_npu's, else built here)")
    ap.add_argument("--skip-convs", action="store_true", help="only the whole decodes")
    ap.add_argument("--skip-decode", action="store_true", help="only the conv shapes")
    ap.add_argument("--worker", choices=("torch", "torch-whole", "onnx"), help=argparse.SUPPRESS)
    ap.add_argument("--latent-file", help=argparse.SUPPRESS)
    ap.add_argument("--array-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, ROOT)
        print(json.dumps(worker(args.worker, args.vae, args.vae_pack, args.latent_file, args.array_out,
                                args.threads)))
        return 0
    result = {"threads": args.threads}
    if not args.skip_decode:
        with tempfile.TemporaryDirectory(prefix="bench-vae-backends-") as tmp:
            result["decode"] = decodes(args, tmp)
        print_decodes(result["decode"], args.threads)
    if not args.skip_convs:
        result["rows"] = convs(args.threads)
    import onnxruntime as ort
    result["load_average"] = os.getloadavg()
    result["versions"] = {"onnxruntime": ort.__version__}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
