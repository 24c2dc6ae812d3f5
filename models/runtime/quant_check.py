"""quant-check: a W8A8 pack's branches in the rknn-toolkit2 simulator against the FP32 reference, then a whole job.

1. Every branch, built by the toolkit's hybrid quantization exactly as `anima-models compile` builds it, runs on the
   calibration's held-out inputs (records the quantizer never saw); its output is compared with the FP32 torch
   reference (models/dit/reference.py) of the checkpoint's own, unsmoothed weights on the unsmoothed input: the
   cosine measures everything INT8 and smoothing did to that branch. A sharded pack's branch is its shards (what
   the executor runs), combined in FP32, with a cosine per shard beside it.
2. A whole job (the calibration's first prompt, its negative, a seed; every step computed) runs twice from the same
   noise: on the INT8 pack in the simulator (each branch, or shard, kept built in a slot of one of `jobs` workers,
   so the job costs one build per graph; shards run in turn) and on a FP16 pack of the same checkpoint on ONNX
   Runtime; the final latents' cosine is the job's figure.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np

from models.runtime.backends.base import BackendError, BranchBackend, checked_input

log = logging.getLogger(__name__)


def cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    den = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / den) if den > 0 else float("nan")


def graphs(branch: dict) -> list:
    """(branch, part | None) of what a job runs for a branch: its shard parts when the pack is sharded (the executor
    runs those, never the one graph), else the branch's one graph."""
    parts = (branch.get("shards") or {}).get("parts") or ()
    return [(branch, p) for p in parts] or [(branch, None)]


class ResidentSim(BranchBackend):
    """Every branch of a pack built once in the simulator and kept, each in a slot of one of `jobs` toolkit workers
    (a worker costs a toolkit import, seconds of CPU; a slot's outputs are bitwise those of a context alone): a job's
    branch calls then cost an inference each. load(path) picks the branch; init and release keep it built."""
    name = "rknn-sim-resident"
    device = "npu"
    max_contexts = 1

    def __init__(self, pack, venv=None, target: str = "rk3588", jobs: int = 2, kinds=None):
        """kinds: build only the branches of these kinds (a partial check); default every branch."""
        self.pack, self.venv, self.target = pack, venv, target
        self.workers: dict = {}                      # onnx path -> ToolkitWorker holding its built model
        self.pool: list = []                         # the workers, each building its share of the graphs in turn
        self.build_s: dict = {}
        self._io: dict = {}
        self._path: Optional[str] = None
        self._tmp = tempfile.mkdtemp(prefix="anima-quant-check-")
        units = [u for b in pack.branches if kinds is None or b["kind"] in kinds for u in graphs(b)]
        n = max(1, min(jobs, len(units)))
        try:
            with ThreadPoolExecutor(max_workers=n) as ex:
                list(ex.map(self._build_share, [units[i::n] for i in range(n)]))
        except BaseException:
            self.close()                     # the workers already built, and the scratch folder: nothing leaks
            raise

    def _build_share(self, units: list) -> None:
        """One worker builds `units` one after another."""
        from models.rknn.client import ToolkitWorker
        w = ToolkitWorker(self.venv)
        self.pool.append(w)
        for u in units:
            self._build(w, u)

    def _build(self, w, unit: tuple) -> None:
        """Build one graph (a branch, or a shard part of one) as `compile` would, and keep it in `w` (its slot: its
        path)."""
        from models.rknn.quant import quant_request
        from models.runtime.backends.rknn_sim import _graph_io
        branch, part = unit
        path = os.path.abspath(str(self.pack.dir / (part or branch)["onnx"]))
        work = Path(self._tmp) / Path(path).stem
        work.mkdir(parents=True, exist_ok=True)
        req = quant_request(self.pack.dir, self.pack.manifest, branch, work, part=part)   # None: a float graph
        t0 = time.perf_counter()
        w.request("sim_load", onnx=path, target=self.target, log=str(work / "build.log"), slot=path,
                  **({"quant": req} if req else {}))
        self.workers[path] = w
        self.build_s[path] = time.perf_counter() - t0
        self._io[path] = _graph_io(path)

    def load(self, path) -> None:
        p = os.path.abspath(os.fspath(path))
        if p not in self.workers:
            raise BackendError(f"{p}: not a branch of the pack this simulator holds")
        self._path = p

    def init(self) -> None:
        pass

    def infer(self, inputs: dict) -> dict:
        ins, outs = self._io[self._path]
        d = Path(self._tmp) / Path(self._path).stem
        paths = []
        for i, (name, dt, shape) in enumerate(ins):
            p = d / f"in{i}.npy"
            np.save(p, np.ascontiguousarray(checked_input(self._path, inputs, name, dt, shape)))
            paths.append(str(p))
        r = self.workers[self._path].request("sim_infer", inputs=paths, out_dir=str(d), slot=self._path)
        return {name: np.load(p).reshape(shape).astype(dt) for (name, dt, shape), p in zip(outs, r["outputs"])}

    def release(self) -> None:
        pass

    def close(self) -> None:
        for w in self.pool:
            w.close()
        self.pool.clear()
        self.workers.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)


def _reference(kind: str, w: dict, x: np.ndarray, ctx, geom, cfg) -> np.ndarray:
    from models.dit import reference as ref
    if kind == "self":
        cos, sin = ref.rope_cos_sin(geom.h_tokens, geom.w_tokens, cfg.head_dim)
        return ref.ref_self_attn(w, x, cos, sin)
    if kind == "cross":
        return ref.ref_cross_attn(w, x, ctx)
    return ref.ref_ffn(w, x)


def branch_table(pack, sim: ResidentSim, ckpt, calib) -> list:
    """[{branch, samples, cos (worst of its held-out inputs), mean[, shards]}] for every branch, in execution order.
    A sharded branch: its shards' outputs combined as the executor combines them (FP32) against the whole reference,
    and under `shards` each shard's own output against the reference's part of it (rows: its rows; heads: the
    reference computed with the shard's weights, a partial sum)."""
    from models.dit.rope import rope_tables
    from models.quant.smooth import SMOOTH_KEY
    s = pack.host_weights()[SMOOTH_KEY]                                         # [blocks, 3, D]
    np_dt = np.float16 if pack.io_dtype == "f16" else np.float32
    cos, sin = rope_tables(pack.geometry.h_tokens, pack.geometry.w_tokens, pack.config.head_dim)
    rows = []
    for j, b in enumerate(pack.branches):
        units = graphs(b)
        if any(os.path.abspath(str(pack.dir / (p or b)["onnx"])) not in sim.workers for _, p in units):
            continue                                                            # not built (a partial check)
        w = ckpt.branch_weights(b["block"], b["kind"])
        cs, per = [], [[] for _ in units]
        for x, ctx in calib.inputs(f"b{b['block']:02d}_{b['kind']}", held_out=True):
            feed = {"xn": (x / s[b["block"], j % 3][None, :]).astype(np_dt), "rope_cos": cos.astype(np_dt),
                    "rope_sin": sin.astype(np_dt)}
            if ctx is not None:
                feed["context"] = ctx.astype(np_dt)
            ref = _reference(b["kind"], w, x, ctx, pack.geometry, pack.config)
            y, part_cos = _run_graphs(pack, sim, b, units, feed, ref, w, x, ctx)
            cs.append(cosine(y, ref))
            for k, c in enumerate(part_cos):
                per[k].append(c)
        row = {"branch": f"b{b['block']:02d}_{b['kind']}", "samples": len(cs), "cos": min(cs),
               "mean": float(np.mean(cs))}
        if units[0][1] is not None:
            row["shards"] = [{"shard": f"{row['branch']}.s{k}", "cos": min(c), "mean": float(np.mean(c))}
                             for k, c in enumerate(per)]
        rows.append(row)
    return rows


def _run_graphs(pack, sim: ResidentSim, branch: dict, units: list, feed: dict, ref, w, x, ctx) -> tuple:
    """One held-out input through a branch's graphs in the simulator -> (the branch's output, [each shard's cos vs
    its part of the FP32 reference]; empty for a one-graph branch)."""
    if units[0][1] is None:
        sim.load(pack.dir / branch["onnx"])
        return sim.infer(feed)["y"], []
    from models.dit.shards import combine, shard_feed, shard_weights
    from models.packs.sharded import part_specs
    specs, outs, part_cos = part_specs(branch), [], []
    for spec, (_, part) in zip(specs, units):
        sim.load(pack.dir / part["onnx"])
        outs.append(sim.infer(shard_feed(spec, feed))["y"])
        if spec.cut == "rows":
            want = ref[spec.a:spec.b]
        else:                                     # heads: what the shard's own weights compute, a partial sum
            want = _reference(branch["kind"], shard_weights(spec, w), x, ctx, pack.geometry, pack.config)
        part_cos.append(cosine(outs[-1], want))
    return combine(specs, outs), part_cos


def _job(runner, calib, steps: int, seed: int, cfg_scale: float) -> np.ndarray:
    """The final latent of one job on `runner`: the calibration's first prompt (context 0) and its negative
    (context 1), every step computed (Euler, no Spectrum)."""
    from models.dit.partition import LATENT_SCALE
    from models.sampling.denoise import denoise, make_sampler, start_or_resume
    g = runner.geom
    sampler = make_sampler(steps, cfg_scale, spectrum=None)
    state = start_or_resume(sampler, seed, (runner.cfg.latent_channels, g.height // LATENT_SCALE,
                                            g.width // LATENT_SCALE))
    state = denoise(runner, sampler, state, calib.context(0), calib.context(1))
    return sampler.result(state)


def quant_check(pack_dir, ckpt_path, calib_dir, steps: int = 20, seed: int = 0, cfg_scale: float = 4.0,
                venv=None, jobs: int = 2, fp16_pack=None) -> dict:
    """The report: per-branch cosines, worst and mean, the job's final-latent cosine vs the FP16 pack's."""
    from models.dit.checkpoint import DiTCheckpoint
    from models.records.manifest import quant_info
    from models.packs.pack import PackError, build_pack, load_pack
    from models.quant.calib import CalibError, read_calib
    from models.runtime.dit_runner import DiTRunner
    pack = load_pack(pack_dir)
    q = quant_info(pack.manifest)
    if q is None:
        raise PackError(f"{pack_dir}: not a W8A8 pack (no 'quant' in its manifest); build one with "
                        "`anima-models pack --quant w8a8`")
    calib, ckpt = read_calib(calib_dir), DiTCheckpoint.open(ckpt_path)
    if calib.info["source_sha256"] != pack.source["sha256"] or ckpt.sha256() != pack.source["sha256"]:
        raise CalibError(f"--calib / --checkpoint: the pack {pack_dir} was built from sha256 "
                         f"{pack.source['sha256'][:12]}…; give its checkpoint and a calibration of it")
    t0 = time.perf_counter()
    sim = ResidentSim(pack, venv=venv, jobs=jobs)
    tmp = Path(tempfile.mkdtemp(prefix="anima-quant-fp16-"))
    try:
        rows = branch_table(pack, sim, ckpt, calib)
        t1 = time.perf_counter()
        runner = DiTRunner(pack, backend=sim)
        z_int8 = _job(runner, calib, steps, seed, cfg_scale)
        fp16 = fp16_pack or build_pack(ckpt_path, tmp / "fp16", (pack.geometry.width, pack.geometry.height), "fp16")
        ref_runner = DiTRunner(fp16, "onnx")
        try:
            z_fp16 = _job(ref_runner, calib, steps, seed, cfg_scale)
        finally:
            ref_runner.close()
    finally:
        sim.close()
        shutil.rmtree(tmp, ignore_errors=True)
    cs = [r["cos"] for r in rows]
    return {"pack": str(pack.dir), "quant": q, "branches": rows, "worst_cos": min(cs),
            "mean_cos": float(np.mean([r["mean"] for r in rows])), "final_cos": cosine(z_int8, z_fp16),
            "steps": steps, "seed": seed, "cfg": cfg_scale, "build_s": round(sum(sim.build_s.values()), 1),
            "branch_check_s": round(t1 - t0, 1), "job_s": round(time.perf_counter() - t1, 1),
            "what": "measured in the rknn-toolkit2 simulator (bit-level NPU arithmetic, not board speed)"}


def describe(rep: dict) -> str:
    lines = [f"{'branch':<10} {'held-out':>8} {'worst cos':>12} {'mean cos':>12}"]
    for r in rep["branches"]:
        lines.append(f"{r['branch']:<10} {r['samples']:>8} {r['cos']:>12.6f} {r['mean']:>12.6f}"
                     + ("  (its shards combined)" if r.get("shards") else ""))
        lines += [f"  {p['shard']:<12} {'':>6} {p['cos']:>12.6f} {p['mean']:>12.6f}" for p in r.get("shards", ())]
    lines.append(f"job: {rep['steps']} steps, seed {rep['seed']}, CFG {rep['cfg']:g}: final latent cos vs the FP16 "
                 f"pack {rep['final_cos']:.6f} ({rep['what']})")
    lines.append(f"quant-check branches={len(rep['branches'])} worst_cos={rep['worst_cos']:.6f} "
                 f"mean_cos={rep['mean_cos']:.6f} final_cos={rep['final_cos']:.6f}")
    return "\n".join(lines)
