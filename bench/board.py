"""Board benchmark (RK3588 only): one DiT forward and one full denoising job through the `rknn` backend (RKNNLite).

    python bench/board.py --pack packs/anima-512 [--steps 20] [--cfg 4.0] [--no-spectrum] [--core-mask auto]
                          [--policy on-demand|prefetch|prefetch2+dual_core|...] [--resident-mb N]
                          [--json bench/out/board.json]
    python bench/board.py --pack packs/anima-512 --calibrate board-cost.toml    # this board's own cost figures

Prints the reference work's tables: per-branch lifecycle sums (load/init/infer/release per kind), pure NPU time per
branch kind (inference calls only), per-step wall time vs pure NPU time, peak process PSS and swap growth; all of it
as JSON too. Then the same per-step rows and policy row as bench/overhead.py prints for the modelled board
(models/board/account.py: one table code), labelled measured, so a board's run compares line by line with
the projection in docs/board.md. (The inference figure here is RKNNLite's inference() wall: NPU plus tensor I/O.)
`bench/overhead.py --backend rknn --pack PACK --models MODELS --policy P` runs the whole pipeline on the board. The pack must be compiled (`anima-models compile PACK --target rk3588`, on an x86 host or the board).
The text context is random (the encoder is not part of this measurement); see docs/board.md.

`--calibrate OUT.toml` measures instead what the board model needs (per-kind NPU time and lifecycle, tensor I/O per
MB in and out, host ops per block, 1 / 2 / 3 contexts inferring at once, MemAvailable per context; every compiled
branch of the pack, each on demand) and writes it in the cost file's format (models/board/calibrate.py);
`[stage.executor] board_cost = "OUT.toml"` then makes board-sim and `auto` use this board's figures.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from models.dit.partition import KINDS  # noqa: E402

log = logging.getLogger("bench.board")
DT_COMPATIBLE = "/proc/device-tree/compatible"


def board_check() -> str:
    """'' on an RK3588 with rknn-toolkit-lite2, else the reason this machine cannot run the benchmark."""
    try:
        compat = Path(DT_COMPATIBLE).read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        compat = ""
    if platform.machine() != "aarch64" or "rk3588" not in compat:
        return (f"this is not an RK3588 board (machine {platform.machine()}, device tree "
                f"{compat.strip() or 'absent'}); bench/board.py measures the NPU and runs only there "
                "(the x86 checks are `anima-models verify --backend rknn-sim` and tests/test_rknn_backend.py)")
    try:
        importlib.import_module("rknnlite.api")
    except ImportError as e:
        return f"rknn-toolkit-lite2 is not importable ({e}); see docs/board.md"
    return ""


class BoardBranches:
    """The runner's branch side: the one lifecycle (models/runtime/lifecycle.py) over RknnLiteBackend contexts under a
    policy; keeps every call's PhaseTimes and the PSS peak."""

    def __init__(self, pack, core_mask: str, policy: str, settings: dict):
        from models.runtime.dit_runner import LocalBranches
        from models.runtime.lifecycle import Lifecycle, context_factory
        from models.board.policy import resolve_policy
        from models.runtime.backends.rknn import RknnLiteBackend
        self.pack = pack
        pol = resolve_policy(policy, "rknn", RknnLiteBackend, settings, (pack.dir,))
        from models.packs.sharded import ShardResolver
        self.local = LocalBranches(Lifecycle(context_factory(RknnLiteBackend, core_mask=core_mask, lite="real"), pol,
                                             shards_of=ShardResolver()))
        self.policy = pol
        self.interleave = pol.interleave
        self.reports: list = []
        self.peak_pss_kb = 0

    def submit(self, call):
        entry = self.pack.branch(call.block, call.kind)
        if not isinstance(entry.get("rknn"), dict):
            raise SystemExit(f"{self.pack.dir}: b{call.block:02d}_{call.kind} is not compiled; run anima-models compile")
        return _Recorded(self, call, self.local.submit(call))

    def npu_s(self, reports=None) -> float:
        return sum(sum(r["times"]["infer_s"]) for r in (reports if reports is not None else self.reports))


class _Recorded:
    """A call's handle that records its PhaseTimes and the PSS once its result is taken."""

    def __init__(self, board: BoardBranches, call, handle):
        self.board, self.call, self.handle, self.value = board, call, handle, None

    def result(self):
        if self.value is None:
            from models.runtime import probes
            self.value = outs, t = self.handle.result()
            self.board.reports.append({"block": self.call.block, "kind": self.call.kind,
                                       "passes": list(self.call.passes), "times": t.to_dict()})
            self.board.peak_pss_kb = max(self.board.peak_pss_kb, probes.pss_kb() or 0)
        return self.value


def lifecycle_table(reports: list) -> tuple:
    """Per kind: count and sums of load/init/infer/release and visible lifecycle seconds; NPU seconds per pass."""
    rows, data = [f"{'kind':<6}{'n':>5}{'load s':>10}{'init s':>10}{'infer s':>10}{'release s':>11}{'visible s':>11}"
                  f"{'NPU/pass s':>12}"], {}
    for kind in KINDS:
        rs = [r for r in reports if r["kind"] == kind]
        if not rs:
            continue
        s = {ph: sum(r["times"][f"{ph}_s"] for r in rs) for ph in ("load", "init", "release", "visible")}
        calls = [x for r in rs for x in r["times"]["infer_s"]]
        data[kind] = {"calls": len(rs), **{f"{k}_s": v for k, v in s.items()}, "infer_s": float(np.sum(calls)),
                      "npu_per_pass_s": float(np.mean(calls)), "npu_s": float(np.sum(calls))}
        rows.append(f"{kind:<6}{len(rs):>5}{s['load']:>10.2f}{s['init']:>10.2f}{np.sum(calls):>10.2f}"
                    f"{s['release']:>11.2f}{s['visible']:>11.2f}{data[kind]['npu_per_pass_s']:>12.3f}")
    return "\n".join(rows), data


def board_ram_gb(mem_total_kb) -> int | str:
    """The board's size (4, 8, 16 or 32 GB) from MemTotal (models/board/ram: a 7.75 GiB ROCK 5C is an 8 GB board),
    "?" unknown."""
    from models.board.ram import board_size_gb
    return board_size_gb(mem_total_kb) or "?"


def shared_table(steps: list, policy: str, ram_gb, vae: str = "cpu") -> tuple:
    """The rows bench/overhead.py prints (one table code), from this run's measured steps -> (lines, row dicts).
    The denoise is measured; the job's encode/decode are bench/overhead.py's figures (reference sd.cpp CPU VAE and
    the encoder estimate), said so; the last line is the interface line both benches end with."""
    from bench.board_table import POLICY_HEADER, format_policy_line, format_rows, projection_notes, summary_line
    from models.board.account import job_figures, project, rows_from_steps
    from models.board.cost import BoardModel
    rows = rows_from_steps(steps)                       # no model: every figure as measured on this board
    lines = ["== the rows of bench/overhead.py, measured on this board"] + format_rows("measured", rows)
    if any(r.computed for r in rows):
        p = project(rows, **job_figures(BoardModel()), vae=vae)
        lines += [POLICY_HEADER, format_policy_line(policy, ram_gb, p, "measured")]
        lines += projection_notes(p, "measured denoise; encode/decode as in bench/overhead.py (modelled)")
        lines.append(summary_line(policy, ram_gb, p))
    return lines, [r.to_dict() for r in rows]


def _random_feed(entry: dict, rng) -> dict:
    return {i["name"]: rng.standard_normal(i["shape"]).astype(np.float16 if i["dtype"] == "f16" else np.float32)
            for i in entry["inputs"]}


class _NoBranches:
    """The runner's branch side answering every call with zeros at once: a forward then times the host ops alone
    (embedding, AdaLN modulation, LayerNorm, gates, residual, final layer), whatever the pack has compiled."""
    interleave = False

    def __init__(self, pack):
        self.pack = pack

    def submit(self, call):
        from models.runtime.dit_runner import _Done
        from models.runtime.phase_times import PhaseTimes
        out = self.pack.branch(call.block, call.kind)["outputs"][0]
        y = np.zeros(out["shape"], np.float16 if out["dtype"] == "f16" else np.float32)
        return _Done(([{out["name"]: y} for _ in call.passes], PhaseTimes()))


def calibrate(pack_dir, out_path, lite: str = "real", core_mask: str = "auto", contexts=(1, 2, 4, 8),
              repeats: int = 4, seed: int = 0):
    """Measure this board's cost figures on the compiled branches of a pack and write them to `out_path` (the cost
    file's format) -> the Calibration. `lite` "standin" runs it on x86 against the labelled stand-in (tests)."""
    import threading
    from models.runtime import probes
    from models.runtime.backends.rknn import RknnLiteBackend, installed_lite_version
    from models.board.calibrate import Calibration, write_cost
    from models.board.cost import Shape
    from models.dit.partition import KINDS
    from models.runtime.dit_runner import DiTRunner
    from models.base.durable import atomic_write
    from models.packs.pack import load_pack
    pack = load_pack(pack_dir, check=False)
    rng = np.random.default_rng(seed)
    compiled = [b for b in pack.branches if isinstance(b.get("rknn"), dict) and b["rknn"].get("file")]
    missing = [k for k in KINDS if not any(b["kind"] == k for b in compiled)]
    if missing:
        raise SystemExit(f"bench/board.py --calibrate: {pack.dir} has no compiled {', '.join(missing)} branch "
                         "(anima-models compile PACK --target rk3588)")
    new = lambda mask=core_mask: RknnLiteBackend(core_mask=mask, lite=lite)      # noqa: E731
    # 1) every compiled branch on demand: load, init, two passes (tensor I/O in, NPU, I/O out apart), release
    life = {k: {"load": [], "init": [], "release": []} for k in KINDS}
    npu, infer = {k: [] for k in KINDS}, {k: [] for k in KINDS}
    io_in = io_out = mb_in = mb_out = 0.0
    split_ok, per_call = True, {}
    for b in compiled:
        kind = b["kind"]
        be = new()
        t0 = time.perf_counter()
        be.load(pack.dir / b["rknn"]["file"])
        t1 = time.perf_counter()
        be.init()
        t2 = time.perf_counter()
        for _ in range(2):
            _, split = be.infer_timed(_random_feed(b, rng))
            rep = be.report["passes"][-1]
            infer[kind].append(rep["s"])
            per_call[kind] = [rep["bytes_in"], rep["bytes_out"]]
            if split is None:
                split_ok = False
                npu[kind].append(rep["s"])
                continue
            npu[kind].append(split["npu_s"])
            io_in, io_out = io_in + split["in_s"], io_out + split["out_s"]
            mb_in, mb_out = mb_in + rep["bytes_in"] / 1e6, mb_out + rep["bytes_out"] / 1e6
        t3 = time.perf_counter()
        be.release()
        life[kind]["load"].append(t1 - t0)
        life[kind]["init"].append(t2 - t1)
        life[kind]["release"].append(time.perf_counter() - t3)
    mean = lambda xs: float(sum(xs) / len(xs))                        # noqa: E731
    if not split_ok:          # the wrapper ran inference() whole: the NPU figure carries the I/O
        npu = infer
    # 2) 1, 2, 3 contexts inferring at once (one per core) on the first FFN branch: throughput over one's
    ffn = next(b for b in compiled if b["kind"] == "ffn")
    feed = _random_feed(ffn, rng)
    speed = []
    for k in (1, 2, 3):
        ctxs = [new(str(i)) for i in range(k)]
        for be in ctxs:
            be.load(pack.dir / ffn["rknn"]["file"])
            be.init()
            be.infer(feed)                                              # warm
        gate = threading.Barrier(k)

        def work(be):
            gate.wait()
            for _ in range(repeats):
                be.infer(feed)
        threads = [threading.Thread(target=work, args=(be,)) for be in ctxs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        speed.append(k * repeats / (time.perf_counter() - t0))
        for be in ctxs:
            be.release()
    speedup = [1.0] + [max(1.0, v / speed[0]) if speed[0] else 1.0 for v in speed[1:]]
    for i in range(1, len(speedup)):                                    # the cost model wants it never to fall
        speedup[i] = max(speedup[i], speedup[i - 1])
    # 3) MemAvailable with N contexts resident (branches in the fixed cycle's order, repeated)
    avail0, pss0 = probes.mem_available_mib(), probes.pss_kb()
    held, drops, extra = [], [], []
    for n in sorted(set(int(x) for x in contexts if int(x) > 0)):
        while len(held) < n:
            b = compiled[len(held) % len(compiled)]
            be = new()
            be.load(pack.dir / b["rknn"]["file"])
            be.init()
            held.append(be)
        avail, pss = probes.mem_available_mib(), probes.pss_kb()
        drops.append(max(0.0, (avail0 or 0.0) - (avail or 0.0)))
        extra.append(max(0.0, ((pss or 0) - (pss0 or 0)) / 1024))
    for be in held:
        be.release()
    counts = sorted(set(int(x) for x in contexts if int(x) > 0))
    # 4) host ops per block: a forward whose branches answer zeros at once
    runner = DiTRunner(pack, branches=_NoBranches(pack))
    g, c = pack.geometry, pack.config
    x = rng.standard_normal((c.latent_channels, g.latent_h, g.latent_w), dtype=np.float32)
    ctx = rng.standard_normal((g.text_tokens, c.context_dim), dtype=np.float32)
    runner.forward_cfg(x, 0.6, ctx, np.zeros_like(ctx))
    host_block = runner.last_timing.host_s / c.blocks
    mem = probes.meminfo_kb()
    api = RknnLiteBackend(lite=lite).api
    dram = probes.dram_devfreq() or {}
    board = {"machine": platform.machine(), "runtime": installed_lite_version(api) or "?",
             "standin": bool(getattr(api, "IS_STANDIN", False)), "driver": probes.npu_driver_version(),
             "dram_governor": dram.get("governor"), "dram_mhz": dram.get("cur_mhz"),
             "date": time.strftime("%Y-%m-%d %H:%M:%S"), "pack": str(pack.dir)}
    cal = Calibration(
        shape=Shape(c.width, c.heads, c.head_dim, c.ffn_width, c.context_dim, c.blocks, g.tokens, g.text_tokens),
        npu_pass_s={k: mean(npu[k]) for k in KINDS}, io_split=split_ok,
        in_ms_per_mb=1000 * io_in / mb_in if split_ok and mb_in else 0.0,
        out_ms_per_mb=1000 * io_out / mb_out if split_ok and mb_out else 0.0,
        lifecycle_s={k: {ph: mean(v) for ph, v in life[k].items()} for k in KINDS}, host_block_s=host_block,
        speedup=speedup, mem_contexts=counts, mem_drop_mib=drops, extra_pss_mib=extra,
        baseline_gib=((mem.get("MemTotal", 0) - mem.get("MemAvailable", 0)) / 2**20) if mem else 0.0,
        mem_total_gib=mem.get("MemTotal", 0) / 2**20, board=board,
        models={k: len(life[k]["load"]) for k in KINDS}, bytes_per_call=per_call)
    atomic_write(out_path, write_cost(cal))
    return cal


def print_calibration(out_path) -> None:
    """The calibrated board as the cost model reads it back, and auto's choice on it (modelled from it)."""
    from models.board import auto as board_auto
    from models.board.cost import BoardModel
    model = BoardModel.for_pack(None, cost_path=out_path)
    for line in model.describe():
        print(line)
    for ram in (8, 16, 32):
        try:
            best, _ = board_auto.choose(model, model.context_budget_mib(ram))
            print(f"auto on a {ram} GB board with these figures: {best.line()}")
        except ValueError as e:                 # this board's baseline leaves no room on a board of that size
            print(f"auto on a {ram} GB board with these figures: {e}")
    print(f"calibration: {out_path}  (set [stage.executor] board_cost = \"{out_path}\")")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=4.0)
    ap.add_argument("--no-spectrum", action="store_true")
    ap.add_argument("--core-mask", default="auto")
    ap.add_argument("--policy", default="on-demand",
                    help="lifecycle policy (models/board/policy.py): on-demand, prefetch, prefetch2, dual_core, resident, "
                         "interleave joined by '+', or auto")
    ap.add_argument("--resident-mb", type=float, default=None, help="budget for the resident policy (MiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--calibrate", metavar="OUT.toml", help="measure this board's cost figures and write them in "
                    "the cost file's format (then [stage.executor] board_cost = \"OUT.toml\")")
    ap.add_argument("--vae", default="npu", choices=("npu", "cpu"), help="which VAE the last line's job_s counts "
                    "(as bench/overhead.py: npu = the VAE pack estimate, cpu = the reference's sd.cpp decode)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    why = board_check()
    if why:
        print(f"bench/board.py: refusing: {why}", file=sys.stderr)
        return 2
    if args.calibrate:
        calibrate(args.pack, args.calibrate, core_mask=args.core_mask)
        print_calibration(args.calibrate)
        return 0
    from models.sampling.denoise import make_sampler, start_or_resume
    from models.sampling.spectrum import SpectrumSettings
    from models.runtime.dit_runner import DiTRunner
    from models.packs.pack import load_pack
    from models.runtime import probes

    pack = load_pack(args.pack)
    board = BoardBranches(pack, args.core_mask, args.policy,
                          {} if args.resident_mb is None else {"resident_mb": args.resident_mb})
    runner = DiTRunner(pack, branches=board)
    g, c = pack.geometry, pack.config
    rng = np.random.default_rng(args.seed)
    cond = np.zeros((g.text_tokens, c.context_dim), np.float32)                 # [S, Dc]
    cond[:60] = rng.standard_normal((60, c.context_dim), dtype=np.float32)
    uncond = np.zeros_like(cond)
    out = {"pack": str(pack.dir), "driver": probes.npu_driver_version(), "core_mask": args.core_mask,
           "policy": board.policy.name, "swap_before_kb": probes.swap_used_kb()}
    # 1) one forward (both CFG passes)
    x = rng.standard_normal((c.latent_channels, g.latent_h, g.latent_w), dtype=np.float32)
    t0 = time.perf_counter()
    runner.forward_cfg(x, 0.6, cond, uncond)
    fwd_reports = list(board.reports)
    table, data = lifecycle_table(fwd_reports)
    out["forward"] = {"wall_s": time.perf_counter() - t0, "npu_s": board.npu_s(fwd_reports), "kinds": data,
                      "host_s": runner.last_timing.host_s}
    print("== one forward (cond + uncond), per-branch lifecycle sums\n" + table)
    print(f"forward wall {out['forward']['wall_s']:.1f} s, pure NPU {out['forward']['npu_s']:.1f} s, "
          f"host ops {out['forward']['host_s']:.1f} s")
    # 2) one full job: the whole sampler run
    sampler = make_sampler(args.steps, args.cfg, spectrum=SpectrumSettings(enabled=not args.no_spectrum))
    state = start_or_resume(sampler, args.seed, x.shape, job_dir=None)
    steps, mark = [], [time.perf_counter(), len(board.reports)]

    def on_step(st):
        from stages.step_account import step_times       # the scheduler's per-step account, in process here
        now, n = time.perf_counter(), len(board.reports)
        reps = board.reports[mark[1]:n]
        row = step_times(st.step, now - mark[0], runner.last_timing if reps else None, calls=len(reps)).to_wire()
        steps.append({**row, "npu_s": board.npu_s(reps)})  # every pass's inference() wall (NPU + tensor I/O)
        mark[:] = [now, n]
    t0 = time.perf_counter()
    from models.sampling.denoise import denoise
    denoise(runner, sampler, state, cond, uncond, on_step=on_step)
    out["job"] = {"steps": steps, "wall_s": time.perf_counter() - t0, "npu_s": sum(s["npu_s"] for s in steps)}
    print("== full job: per-step wall vs pure NPU")
    print(f"{'step':>5}{'wall s':>10}{'NPU s':>10}  kind")
    for s in steps:
        print(f"{s['step']:>5}{s['wall_s']:>10.2f}{s['npu_s']:>10.2f}  {'computed' if s['computed'] else 'forecast'}")
    out["peak_pss_mb"] = board.peak_pss_kb / 1024
    after = probes.swap_used_kb()
    out["swap_growth_mb"] = None if after is None or out["swap_before_kb"] is None else \
        (after - out["swap_before_kb"]) / 1024
    print(f"job wall {out['job']['wall_s']:.1f} s, pure NPU {out['job']['npu_s']:.1f} s; peak PSS "
          f"{out['peak_pss_mb']:.0f} MB; swap growth {out['swap_growth_mb']} MB; RKNPU driver {out['driver']}")
    out["board_ram_gb"] = board_ram_gb(probes.meminfo_kb().get("MemTotal"))
    lines, out["rows"] = shared_table(steps, board.policy.name, out["board_ram_gb"], args.vae)
    text = json.dumps(out, indent=1, default=float)
    if args.json:
        from models.base.durable import atomic_write
        atomic_write(args.json, text + "\n")
        print(f"json: {args.json}")
    else:
        print(text)
    for line in lines:                     # last: policy=P board_ram=R overhead_ratio=X job_s=S
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
