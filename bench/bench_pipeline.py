"""Benchmark (not a test): one tiny job through the supervisord pipeline vs the in-process loop, side by side.

    .venv/bin/python bench/bench_pipeline.py                  # 128x128, 4 steps, 1 thread -> bench/out/pipeline.json
    .venv/bin/python bench/bench_pipeline.py --resolution 512x512 --steps 8 --threads 2

Pipeline: the harness of tests/pipeline_harness.py (real supervisord, real stages, embedded tiny bundle); the job's
denoising wall time is the scheduler's (report.json stages.scheduler.wall_s), its transport time per branch call is
report.json transport_s / branch_calls. In-process: models.sampling.denoise.denoise with models.runtime.dit_runner.DiTRunner on the
same pack, seed, contexts (the job folder's cond.npy/uncond.npy) and thread count; its final latent must be bitwise the
pipeline's. Bare round trip: pyzmq REQ/REP over ipc with frames of the same sizes as one BRANCH request and its
BRANCH_DONE reply (descriptors only: the tensors stay in shared memory), and, for scale, with the tensors inline.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.sampling.denoise import denoise, make_sampler, start_or_resume  # noqa: E402
from models.sampling.spectrum import SpectrumSettings  # noqa: E402
from models.runtime.dit_runner import DiTRunner  # noqa: E402
from models.packs.pack import load_pack  # noqa: E402
from protocol import codec, messages as m  # noqa: E402
from protocol.tensors import TensorDesc  # noqa: E402
from tests.pipeline_harness import Pipeline, tiny_assets  # noqa: E402

OUT = ROOT / "bench" / "out" / "pipeline.json"


def branch_frames(pack, inline: bool) -> tuple[list[bytes], list[bytes]]:
    """Encoded frames of a representative cross-attention BRANCH request (both passes) and its BRANCH_DONE reply."""
    g, c = pack.geometry, pack.config
    io = pack.io_dtype
    L, D, S, Dc = g.tokens, c.width, g.text_tokens, c.context_dim
    nxt = m.BranchRef(block=13, branch="ffn", model=str(pack.dir / "onnx" / "b13_ffn.onnx"), index=41)
    frames_in: list[np.ndarray] = []

    def desc(name, shape, k):
        if inline:
            frames_in.append(np.zeros(shape, np.float16 if io == "f16" else np.float32))
            return TensorDesc(io, shape, frame=len(frames_in))
        return TensorDesc(io, shape, slot=name, offset=k * 4096)

    passes = tuple(m.BranchPass(name=p, inputs={"xn": desc(f"xn.{p}", (L, D), 2 * i),
                                                 "context": desc(f"context.{i}", (S, Dc), 2 * i + 1)},
                                output=TensorDesc(io, (L, D), slot=f"y.{p}", offset=0))
                   for i, p in enumerate(m.PASS_NAMES))
    req = m.Branch(job="20261130-000000-abcdef", step=3, block=13, branch="cross",
                   model=str(pack.dir / "onnx" / "b13_cross.onnx"), index=40, arena=None if inline else
                   "anima_0123abcd_20261130-000000-abcdef", passes=passes, next=(nxt,), inline=tuple(frames_in))
    outs, frames_out = [], []
    for i, p in enumerate(m.PASS_NAMES):
        if inline:
            frames_out.append(np.zeros((L, D), np.float16 if io == "f16" else np.float32))
            outs.append(TensorDesc(io, (L, D), frame=len(frames_out)))
        else:
            outs.append(TensorDesc(io, (L, D), slot=f"y.{p}"))
    rep = m.BranchDone(id=req.id, job=req.job, step=3, block=13, branch="cross", times=m.PhaseTimes(
        load_s=0.01234, init_s=0.1234, infer_s=(0.01234, 0.01234), release_s=0.0123), outputs=tuple(outs),
        rss_mb=87.5, pss_mb=80.25, inline=tuple(frames_out))
    as_bytes = lambda fs: [bytes(memoryview(f)) for f in fs]   # noqa: E731
    return as_bytes(codec.encode(req)), as_bytes(codec.encode(rep))


def bare_round_trip(req: list[bytes], rep: list[bytes], n: int, warmup: int = 50) -> dict:
    """REQ/REP over ipc with frames of these sizes; decode-free. -> seconds per round trip (median, mean, p90)."""
    ctx = zmq.Context()
    path = Path(tempfile.mkdtemp(prefix="anima-rt-", dir="/tmp")) / "rt.sock"
    server, client = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
    server.bind(f"ipc://{path}")
    client.connect(f"ipc://{path}")
    import threading

    def serve():
        for _ in range(n + warmup):
            server.recv_multipart(copy=False)
            server.send_multipart(rep, copy=False)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    times = []
    for i in range(n + warmup):
        t0 = time.perf_counter()
        client.send_multipart(req, copy=False)
        client.recv_multipart(copy=False)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t.join()
    client.close(0)
    server.close(0)
    ctx.term()
    path.unlink(missing_ok=True)
    path.parent.rmdir()
    times.sort()
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times),
            "p90_s": times[int(0.9 * len(times))], "n": n, "request_bytes": sum(map(len, req)),
            "reply_bytes": sum(map(len, rep)), "frames": [len(req), len(rep)]}


def in_process(pack_dir: Path, job_dir: Path, threads: int) -> dict:
    spec = json.loads((job_dir / "job.json").read_text())["spec"]
    pack = load_pack(pack_dir)
    g, c = pack.geometry, pack.config
    sampler = make_sampler(spec["steps"], spec["cfg"], spec["scheduler"], SpectrumSettings(**spec["spectrum"]))
    state = start_or_resume(sampler, spec["seed"], (c.latent_channels, g.latent_h, g.latent_w))
    cond, uncond = np.load(job_dir / "cond.npy"), np.load(job_dir / "uncond.npy")      # [512, Dc] f32
    runner = DiTRunner(pack, threads=threads)
    t0 = time.perf_counter()
    final = denoise(runner, sampler, state, cond, uncond)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "latent": final.latent, "computed_steps": final.computed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--resolution", default="128x128")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--round-trips", type=int, default=2000)
    p.add_argument("--cache", default=str(ROOT / "bench" / "out" / "pipeline_assets"),
                   help="tiny bundle and packs (kept between runs)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    w, h = (int(v) for v in args.resolution.lower().split("x"))
    models, pack_dir = tiny_assets(Path(args.cache), (w, h))
    pack = load_pack(pack_dir)
    prompt = {"prompt": "1girl, silver hair, blue eyes", "negative_prompt": "worst quality", "seed": 42,
              "steps": args.steps, "cfg": 4.0, "spectrum": {"warmup": 1}}

    # 1) the pipeline: supervisord, five programs, one job
    t0 = time.perf_counter()
    with Pipeline.start(models, pack_dir, threads=args.threads) as pipe:
        up_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        job = pipe.submit(prompt)
        info = pipe.wait(job, timeout_s=3600)
        job_s = time.perf_counter() - t1
        if info.state != "done":
            print(f"pipeline job {info.state}: {info.error_stage}: {info.error}\n{pipe.logs()}", file=sys.stderr)
            return 1
        report = pipe.report(job)
        job_dir = Path(tempfile.mkdtemp(prefix="anima-bench-job-"))
        for name in ("job.json", "cond.npy", "uncond.npy", "latent.npy"):
            (job_dir / name).write_bytes((pipe.job_dir(job) / name).read_bytes())
    # 2) the in-process loop, after the pipeline is down (no competition for the cores)
    ref = in_process(pack_dir, job_dir, args.threads)
    latent = np.load(job_dir / "latent.npy")
    identical = bool(np.array_equal(latent, ref["latent"]))
    # 3) bare pyzmq round trips of the same frame sizes
    rt_desc = bare_round_trip(*branch_frames(pack, inline=False), n=args.round_trips)
    rt_inline = bare_round_trip(*branch_frames(pack, inline=True), n=max(200, args.round_trips // 4))

    calls = report["branch_calls"]
    denoise_s = report["stages"]["scheduler"]["wall_s"]
    per_call = report["transport_s"] / max(calls, 1)
    result = {
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "job": {"resolution": [w, h], "steps": args.steps, "threads": args.threads, "tokens": pack.geometry.tokens,
                "blocks": pack.config.blocks, "computed_steps": report["computed_steps"],
                "forecast_steps": report["forecast_steps"], "branch_calls": calls},
        "pipeline": {"startup_s": up_s, "job_wall_s": job_s, "report_wall_s": report["wall_s"],
                     "denoise_wall_s": denoise_s, "host_s": report["host_s"], "transport_s": report["transport_s"],
                     "transport_per_call_s": per_call, "stages": report["stages"], "branches": report["branches"]},
        "in_process": {"denoise_wall_s": ref["wall_s"]},
        "ratio_denoise_pipeline_over_in_process": denoise_s / ref["wall_s"],
        "latent_bitwise_identical": identical,
        "bare_zmq_round_trip": {"descriptors": rt_desc, "inline_tensors": rt_inline},
        "transport_per_call_over_bare_round_trip": per_call / rt_desc["median_s"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    print(f"tiny job {w}x{h}, {args.steps} steps (computed {report['computed_steps']}), {calls} branch calls, "
          f"{args.threads} thread(s), load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print(f"{'':<36}{'pipeline':>12}{'in-process':>12}{'ratio':>8}")
    print(f"{'denoise wall s':<36}{denoise_s:>12.2f}{ref['wall_s']:>12.2f}{denoise_s / ref['wall_s']:>8.2f}")
    print(f"{'whole job wall s (encode+decode too)':<36}{job_s:>12.2f}{'-':>12}")
    print(f"{'host ops s':<36}{report['host_s']:>12.2f}")
    print(f"{'transport s (total)':<36}{report['transport_s']:>12.2f}")
    print(f"{'transport ms per branch call':<36}{per_call * 1e3:>12.3f}")
    print(f"{'bare zmq REQ/REP ms (same frames)':<36}{rt_desc['median_s'] * 1e3:>12.3f}"
          f"   ({rt_desc['request_bytes']} B request, {rt_desc['reply_bytes']} B reply)")
    print(f"{'bare zmq REQ/REP ms (tensors inline)':<36}{rt_inline['median_s'] * 1e3:>12.3f}"
          f"   ({rt_inline['request_bytes']} B request, {rt_inline['reply_bytes']} B reply)")
    print(f"final latent bitwise identical: {identical}; written {out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
