"""Backend choice for the VAE decoder: the decoder's conv shapes through torch (NCHW, channels_last) and ONNX Runtime.

    .venv/bin/python bench/bench_vae_backends.py [--threads 2] [--out bench/out/vae_backends.json]

Convs are ~97% of the decoder's FLOPs, so the fastest conv backend decides. Each shape is timed best of 3 after a
warm-up, in wall and CPU seconds (the CPU figure is less sensitive to other processes on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "vae_backends.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'conv':<26}{'GFLOP':>7}  GFLOP/s wall (per CPU-s): torch NCHW | torch channels_last | ONNX Runtime")
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
        sess, xn = _ort_session(w.numpy(), b.numpy(), side, pad, args.threads), x.numpy()
        res["onnxruntime"] = _best(lambda: sess.run(None, {"x": xn}))
        row = {"cin": cin, "cout": cout, "kernel": k, "side": side, "gflop": flops / 1e9,
               "gflops_wall": {n: flops / t[0] / 1e9 for n, t in res.items()},
               "gflops_per_cpu_s": {n: flops / t[1] / 1e9 for n, t in res.items()}}
        rows.append(row)
        cells = " | ".join(f"{row['gflops_wall'][n]:6.1f} ({row['gflops_per_cpu_s'][n]:5.1f})" for n in res)
        print(f"{cin}->{cout} {k}x{k} at {side}x{side}".ljust(26) + f"{flops / 1e9:>7.1f}  {cells}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"threads": args.threads, "load_average": os.getloadavg(), "rows": rows,
                   "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__}}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
