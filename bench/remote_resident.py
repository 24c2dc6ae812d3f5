"""Benchmark (not a test): what a bigger host gains as the executor (docs/remote-executor.md). MEASURED here.

    .venv/bin/python bench/remote_resident.py --pack PACK [--threads 2] [--resident-mb 14000] [--json OUT]

1) One DiT forward (one pass, all blocks) through the lifecycle with ONNX Runtime (`--threads`), side by side in one
   run: `on-demand` (load, init, infer, release per branch: what the board does) and `resident` (first forward loads
   and pins the contexts that fit `--resident-mb`; the second one is inference only for those: what the bigger host
   does per forward from the second step on). Outputs must be bitwise equal. Per-forward wall, the lifecycle and
   inference sums, peak RSS, and each kind's memory per context after init and after its first inference (ONNX
   Runtime allocates a session's activation arena then: the lifecycle's `context_mb` sees only the first part).
   When not every context fits here, the all-resident forward is also DERIVED from the same run: the on-demand
   forward minus its measured load/init/release.
2) The link: one branch call's tensors (both passes of `xn` out, both `y` back, at the pack's shapes) over ZeroMQ
   REQ/REP on tcp loopback with CURVE, as the scheduler and a remote executor exchange them; per call and per
   forward (84 calls), and what a 1 Gbit/s LAN would add (bytes / 117 MB/s).
Use the full-size FP16 pack (`anima-models synth dit --preset full`, `anima-models pack ... --dtype fp16`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.runtime.dit_runner import DiTRunner  # noqa: E402
from models.packs.pack import load_pack  # noqa: E402
from models.dit.partition import KINDS  # noqa: E402
from models.base.durable import atomic_write  # noqa: E402
from models.board.policy import Policy  # noqa: E402
from protocol.security import read_keypair, write_keypair  # noqa: E402

OUT = ROOT / "bench" / "out" / "remote_resident.json"
LAN_BYTES_S = 117e6           # 1 Gbit/s Ethernet, payload


class PeakRss:
    """This process's RSS sampled every 0.2 s on a thread (MiB)."""

    def __init__(self):
        self.peak, self._stop = 0.0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        p = psutil.Process()
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, p.memory_info().rss / 2**20)

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return self.peak


def forward_row(runner: DiTRunner, inputs, label: str) -> tuple:
    x, sigma, ctx = inputs
    t0 = time.perf_counter()
    v = runner.forward(x, sigma, ctx)
    wall = time.perf_counter() - t0
    t = runner.last_timing
    sums = {k: s.to_dict() for k, s in t.per_kind.items()}
    tot = lambda key: sum(s[key] for s in sums.values())      # noqa: E731
    row = {"run": label, "wall_s": wall, "load_s": tot("load_s"), "init_s": tot("init_s"), "infer_s": tot("infer_s"),
           "release_s": tot("release_s"), "visible_s": tot("visible_s"), "host_s": t.host_s,
           "rss_mb": psutil.Process().memory_info().rss / 2**20, "per_kind": sums}
    print(f"{label:<26}{wall:>9.1f}{row['load_s']:>9.1f}{row['init_s']:>9.1f}{row['infer_s']:>9.1f}"
          f"{row['release_s']:>10.1f}{row['host_s']:>8.1f}{row['rss_mb']:>9.0f}   [measured here]", flush=True)
    return v, row


def context_memory(pack, threads: int) -> dict:
    """RSS growth per kind over load+init and over the first inference (MiB), block 0's three branches."""
    from models.runtime.backends.onnx import OnnxBackend
    p, rng, out, held = psutil.Process(), np.random.default_rng(1), {}, []
    for kind in KINDS:
        e = pack.branch(0, kind)
        r0 = p.memory_info().rss / 2**20
        be = OnnxBackend(threads)
        be.load(pack.dir / e["onnx"])
        be.init()
        r1 = p.memory_info().rss / 2**20
        be.infer({i["name"]: rng.standard_normal(i["shape"]).astype(np.float16 if pack.io_dtype == "f16"
                                                                       else np.float32) for i in e["inputs"]})
        out[kind] = {"init_mb": r1 - r0, "first_infer_mb": p.memory_info().rss / 2**20 - r1}
        held.append(be)
    for be in held:
        be.release()
    return out


def link_bench(pack, calls: int = 12) -> dict:
    """Both passes' xn out, both y back, per call, over CURVE tcp loopback (REQ/REP, as Lazy Pirate and the stage)."""
    g, c = pack.geometry, pack.config
    dt = np.float16 if pack.io_dtype == "f16" else np.float32
    xn = np.random.default_rng(0).standard_normal((g.tokens, c.width)).astype(dt)            # [L, D] io
    ctx_in = np.zeros((g.text_tokens, c.context_dim), dt)                                      # [S, Dc] io
    folder = Path(tempfile.mkdtemp(prefix="anima-link-"))
    write_keypair(folder, "server")
    write_keypair(folder, "client")
    spub, ssec = read_keypair(folder / "server.key_secret")
    cpub, csec = read_keypair(folder / "client.key_secret")
    zctx = zmq.Context()
    rep = zctx.socket(zmq.REP)
    rep.curve_server, rep.curve_secretkey, rep.curve_publickey = True, ssec, spub
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    req = zctx.socket(zmq.REQ)
    req.curve_serverkey, req.curve_publickey, req.curve_secretkey = spub, cpub, csec
    req.connect(f"tcp://127.0.0.1:{port}")

    def serve():
        for _ in range(calls + 1):
            frames = rep.recv_multipart(copy=False)
            rep.send_multipart([b"hdr", frames[1], frames[2]], copy=False)       # two y of xn's shape back
    th = threading.Thread(target=serve)
    th.start()
    out = [b"hdr", xn, xn, ctx_in, ctx_in]                                      # cross: xn and context per pass
    req.send_multipart(out, copy=False)
    req.recv_multipart()                                                         # handshake and warm-up
    t0 = time.perf_counter()
    for _ in range(calls):
        req.send_multipart(out, copy=False)
        req.recv_multipart()
    per_call = (time.perf_counter() - t0) / calls
    th.join()
    for s in (req, rep):
        s.close(0)
    zctx.term()
    shutil.rmtree(folder, ignore_errors=True)
    nbytes, forward_calls = 4 * xn.nbytes + 2 * ctx_in.nbytes, len(KINDS) * c.blocks
    return {"per_call_s": per_call, "bytes_per_call": nbytes, "per_forward_s": per_call * forward_calls,
            "lan_1gbit_per_forward_s": forward_calls * nbytes / LAN_BYTES_S}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resident-mb", type=float, default=3000.0,
                    help="pin budget in the lifecycle's context_mb units (about half the real memory: see above)")
    ap.add_argument("--rounds", type=int, default=2, help="on-demand / resident forwards, alternated")
    ap.add_argument("--json", default=str(OUT))
    args = ap.parse_args(argv)
    pack = load_pack(args.pack)
    g, c = pack.geometry, pack.config
    rng = np.random.default_rng(0)
    ctx = np.zeros((g.text_tokens, c.context_dim), np.float32)                 # [S, Dc]
    ctx[:60] = rng.standard_normal((60, c.context_dim), dtype=np.float32)
    inputs = (rng.standard_normal((c.latent_channels, g.latent_h, g.latent_w), dtype=np.float32), 0.6, ctx)
    print(f"MEASURED on this host ({platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}): "
          f"pack {pack.dir} (D={c.width}, {c.blocks} blocks, {g.tokens} tokens, {pack.dtype}), ONNX Runtime "
          f"{args.threads} threads, one forward = one pass; on-demand and resident alternated {args.rounds}x")
    mem = context_memory(pack, args.threads)              # first, while the heap is fresh (RSS growth is visible)
    per_block = sum(m["init_mb"] + m["first_infer_mb"] for m in mem.values())
    print(f"{'run':<26}{'wall s':>9}{'load s':>9}{'init s':>9}{'infer s':>9}{'release s':>10}{'host s':>8}"
          f"{'RSS MB':>9}")
    rows, rss, outs = [], PeakRss(), []
    od = DiTRunner(pack, threads=args.threads, policy="on-demand")
    res = DiTRunner(pack, threads=args.threads, policy=Policy(resident_mb=args.resident_mb))
    try:
        v, row = forward_row(res, inputs, "resident, first forward")       # loads and pins what fits
        outs.append(v)
        rows.append(row)
        for r in range(args.rounds):
            for runner, label in ((od, "on-demand"), (res, "resident")):
                v, row = forward_row(runner, inputs, f"{label} #{r + 1}")
                row["policy"] = label
                outs.append(v)
                rows.append(row)
        lc = res.branches.lifecycle
        pinned, pinned_mb = len(lc.resident_paths), lc.resident_mb
    finally:
        od.close()
        res.close()
    peak = rss.stop()
    equal = all(np.array_equal(outs[0], v) for v in outs)
    mean = lambda label, key: float(np.mean([r[key] for r in rows if r.get("policy") == label]))   # noqa: E731
    w_od, w_res = mean("on-demand", "wall_s"), mean("resident", "wall_s")
    life = {lab: mean(lab, "load_s") + mean(lab, "init_s") + mean(lab, "release_s") for lab in ("on-demand", "resident")}
    derived = w_od - life["on-demand"]
    link = link_bench(pack)
    n_models = len(KINDS) * c.blocks
    print(f"resident: {pinned} of {n_models} branch models pinned ({pinned_mb:.0f} MiB by the lifecycle's count); "
          f"peak RSS {peak:.0f} MiB; outputs bitwise equal: {equal}   [measured here]")
    print(f"per forward (mean of {args.rounds}, alternated): on-demand {w_od:.1f} s (lifecycle {life['on-demand']:.1f} s), "
          f"resident with {pinned} pinned {w_res:.1f} s (lifecycle {life['resident']:.1f} s): {w_od / w_res:.2f}x   "
          "[measured here]")
    print(f"all {n_models} resident: {derived:.1f} s per forward, {w_od / derived:.2f}x   [derived from the on-demand "
          "forwards above minus their measured load/init/release]")
    print("memory per context (MiB, RSS growth; block 0): " + ", ".join(
        f"{k} {m['init_mb']:.0f} after init + {m['first_infer_mb']:.0f} on the first inference" for k, m in mem.items())
        + f"; all {n_models} resident ~{c.blocks * per_block / 1024:.1f} GiB   [measured here]")
    print(f"link (CURVE tcp loopback, both passes' tensors of one call: {link['bytes_per_call'] / 2**20:.1f} MiB): "
          f"{1000 * link['per_call_s']:.1f} ms per call, {link['per_forward_s']:.1f} s per forward ({n_models} "
          f"calls) [measured here]; a 1 Gbit/s LAN adds >= {link['lan_1gbit_per_forward_s']:.1f} s per forward "
          "[bytes / 117 MB/s]")
    out = {"pack": str(pack.dir), "threads": args.threads, "load_avg": os.getloadavg(), "rows": rows,
           "peak_rss_mb": peak, "bitwise_equal": equal, "pinned": pinned, "pinned_mb": pinned_mb,
           "mean_wall_s": {"on-demand": w_od, "resident": w_res}, "mean_lifecycle_s": life,
           "all_resident_forward_s_derived": derived, "context_memory_mb": mem, "link": link, "measured": True}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.json, json.dumps(out, indent=1) + "\n")
    print(f"JSON -> {args.json}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
