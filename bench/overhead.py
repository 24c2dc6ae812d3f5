"""Board time per image through the REAL pipeline (supervisord, every stage): a Spectrum job at 512x512 per lifecycle
policy and board RAM, and the table a board owner reads.

    .venv/bin/python bench/overhead.py --backend board-sim --policy on-demand --board-ram 8 --steps 2
    .venv/bin/python bench/overhead.py --backend board-sim --policy all --board-ram 8,16,32 --steps 2 --time-scale 0.5
    .venv/bin/python bench/overhead.py --backend rknn --pack packs/anima-512 --models MODELS --policy auto   # a board
    .venv/bin/python bench/overhead.py --analytic --policy all --board-ram 8,16,32     # the timeline only, no runs
    .venv/bin/python bench/overhead.py --analytic --policy auto --board-ram 8 --vae cpu   # the reference's CPU VAE
    .venv/bin/python bench/overhead.py --analytic --policy auto --calls 8 --cfg 1 --warm  # prompts cached

board-sim: the executor's phases and the scheduler's host ops are paced to the MODELLED RK3588 (models/board/cost.toml,
reference board figures) for the full-size model at 512x512, times --time-scale; the tiny pack computes the real
outputs. Every line says what is modelled and the time scale. Per policy: step wall, pure NPU, visible lifecycle,
host, transport per computed step (board seconds; transport and the rest measured here), overhead_ratio = denoise
wall / sum of pure NPU inference, and the projected 20-step Spectrum job (encode estimate + denoise + decode: the
reference's 155.04 s CPU VAE, and the NPU VAE estimate; `--vae npu|cpu`, default npu as the board bundle configures
it, says which one the last line's job_s counts). `--steps N` runs N steps (N < 20: the 20-step projection
follows from the per-step figures). The analytic timeline (models/board/timeline.py, what `auto` evaluates) is
printed beside each run. JSON and a PNG (per-step stacked bars per policy) go to bench/out/; runs of earlier
invocations in the same JSON file are kept (same policy, RAM, steps and time scale: replaced). The last line is
`policy=P board_ram=R overhead_ratio=X job_s=S` (of the last run).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.board import auto as board_auto  # noqa: E402
from bench.board_table import (POLICY_HEADER, format_policy_line, format_rows, projection_notes,  # noqa: E402
                               summary_line)
from models.board.account import VAES, job_figures, project, rows_from_steps  # noqa: E402
from models.board.cost import BOARD_RAMS_GB, LABEL, BoardModel, Shape  # noqa: E402
from models.board.pace import check_time_scale, scale_note  # noqa: E402
from models.board.policy import parse_policy  # noqa: E402
from models.dit.shards import MAX_SHARDS  # noqa: E402

OUT = ROOT / "bench" / "out"
ALL = ("on-demand", "prefetch", "prefetch2", "interleave", "prefetch2+interleave", "dual_core", "resident",
       "prefetch+dual_core", "prefetch2+dual_core", "shards", "prefetch2+shards", "prefetch2+interleave+shards",
       "prefetch+dual_core+shards", "auto")
PROMPT = json.loads((ROOT / "examples" / "prompt.json").read_text())


def policy_shape(name: str, model: BoardModel, budget_mib: float):
    """A policy string -> (models.board.policy.Policy, [stage.executor] settings); `resident` gets the budget the board
    leaves after the policy's contexts in flight; `auto` is resolved by the executor (and here, the same way)."""
    if name == "auto":
        best, _ = board_auto.choose(model, budget_mib)
        return best.policy, {"policy": "auto"}
    shape = parse_policy(name, {"resident_mb": 1.0})           # the budget of `resident` is set below
    settings = {"policy": name}
    if shape.resident_mb:
        e = board_auto.evaluate(model, shape, budget_mib)
        if e is None:
            raise SystemExit(f"policy {name}: nothing to pin on this board ({LABEL})")
        shape = e.policy
        settings["resident_mb"] = shape.resident_mb
    return shape, settings


def executor_log(pipe) -> str:
    p = pipe.rf.logs / "executor.log"
    return p.read_text(errors="replace") if p.exists() else ""


def run_one(args, assets, model: BoardModel, policy: str, ram: int) -> dict:
    from tests.pipeline_harness import Pipeline
    models, pack = assets
    budget = model.context_budget_mib(ram)
    shape, settings = policy_shape(policy, model, budget)
    executor = dict(settings)
    if args.backend == "board-sim":
        executor.update(time_scale=args.time_scale, board_ram_gb=ram)
    prompt = dict(PROMPT, steps=args.steps, width=args.width, height=args.height, seed=args.seed)
    timeout = args.steps * 200 * args.time_scale + 900
    t0 = time.monotonic()
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in executor.items())     # [stage.executor]
    pipe = Pipeline.start(models, pack, threads=args.threads, branch_timeout_s=600, backend=args.backend,
                          executor_toml=lines)
    try:
        job = pipe.submit(prompt)
        info = pipe.wait(job, ("done", "failed", "cancelled"), timeout_s=timeout, poll_s=0.5)
        if info.state != "done":
            raise SystemExit(f"{policy} {ram} GB: job {info.state}: {info.error}\n{pipe.logs()}")
        report = pipe.report(job)
        trace = pipe.trace(job)
        log = executor_log(pipe)
    finally:
        pipe.stop()
    board = args.backend == "board-sim"
    rows = rows_from_steps(report["steps"], args.time_scale, model if board else None)
    proj = project(rows, **job_figures(model), vae=args.vae)
    chosen = re.findall(r"auto \(.*?\): .*? -> (\S+);", log)
    analytic = board_auto.evaluate(model, shape, budget, transport_s=proj.transport_step_s / 84)
    ledger = trace[-1].get("board", [{}])[0] if trace else {}
    return {"policy": policy, "resolved": chosen[-1] if chosen else shape.name, "board_ram_gb": ram,
            "backend": args.backend, "time_scale": args.time_scale, "steps": args.steps,
            "label": LABEL if board else "measured", "rows": [r.to_dict() for r in rows],
            "projection": proj.to_dict(), "executor_settings": executor,
            "analytic": None if analytic is None else {"step_s": analytic.warm.wall_s,
                                                       "first_step_s": analytic.cold.wall_s,
                                                       "overhead_ratio": analytic.warm.overhead_ratio,
                                                       "denoise_s": analytic.denoise_s,
                                                       "contexts": analytic.contexts},
            "ledger": ledger, "report": {k: report.get(k) for k in ("stages", "branches", "host_s", "host_work_s",
                                                                    "transport_s", "wall_s", "computed_steps",
                                                                    "forecast_steps", "board")},
            "run_wall_s": time.monotonic() - t0}


def print_run(r: dict) -> None:
    from models.board.account import StepRow
    note = f"[{r['label']}, {scale_note(r['time_scale'])}]"
    rows = [StepRow(**{k: v for k, v in d.items() if k != "overhead_ratio"}) for d in r["rows"]]
    print(f"== {r['policy']} (resolved: {r['resolved']}), {r['board_ram_gb']} GB board, {r['steps']} steps  {note}")
    for line in format_rows(r["label"], rows, r["time_scale"]):
        print(line)
    led = r.get("ledger") or {}
    if led:
        ph = led.get("phases", {})
        over = sum(p.get("overrun_s", 0.0) for p in ph.values())
        n = sum(p.get("overruns", 0) for p in ph.values())
        print(f"pacing: {n} of {sum(p.get('phases', 0) for p in ph.values())} paced phases overran their scaled "
              f"board time by {over:.3f} s in all (real work here took longer); peak contexts "
              f"{led.get('peak_contexts')}, peak busy NPU cores {led.get('peak_busy_cores')}  {note}")
    a = r.get("analytic")
    if a:
        print(f"analytic timeline ({LABEL}, models/board/timeline.py): step {a['step_s']:.2f} s "
              f"(first {a['first_step_s']:.2f}), overhead_ratio {a['overhead_ratio']:.3f}, {a['contexts']} contexts "
              f" {note}")


def plot(runs: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rams = sorted({r["board_ram_gb"] for r in runs})
    fig, axes = plt.subplots(len(rams), 1, figsize=(max(8, 1.1 * len(runs) / max(1, len(rams)) * 3), 4 * len(rams)),
                             squeeze=False)
    parts = (("npu_s", "pure NPU", "#1f77b4"), ("io_s", "tensor I/O", "#aec7e8"),
             ("lifecycle_s", "visible lifecycle", "#d62728"), ("host_s", "host ops", "#2ca02c"),
             ("transport_s", "transport (here)", "#ff7f0e"), ("other_s", "rest (here)", "#7f7f7f"))
    for ax, ram in zip(axes[:, 0], rams):
        x, labels, ticks = 0.0, [], []
        for r in [r for r in runs if r["board_ram_gb"] == ram]:
            rows = [d for d in r["rows"] if d["computed"]]
            start = x
            for d in rows:
                bottom = 0.0
                infer_rest = max(0.0, d["infer_s"] - d["npu_s"] - d["io_s"]) if r["label"] == LABEL else 0.0
                for key, name, color in parts:
                    v = d[key]
                    if key == "npu_s" and r["label"] == LABEL and d["infer_s"] < d["npu_s"] + d["io_s"]:
                        v = d["infer_s"] * d["npu_s"] / (d["npu_s"] + d["io_s"])   # dual_core: passes overlap
                    if key == "io_s" and r["label"] == LABEL and d["infer_s"] < d["npu_s"] + d["io_s"]:
                        v = d["infer_s"] * d["io_s"] / (d["npu_s"] + d["io_s"])
                    ax.bar(x, v, bottom=bottom, color=color, width=0.8, label=name if not labels else None)
                    bottom += v
                if infer_rest:
                    ax.bar(x, infer_rest, bottom=bottom, color="#9467bd", width=0.8)
                labels.append(d["step"])
                x += 1
            ticks.append(((start + x - 1) / 2, f"{r['resolved']}\n{r['time_scale']:g}x"))
            x += 0.8
        ax.set_xticks([t for t, _ in ticks], [s for _, s in ticks], fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("board s per computed step")
        ax.set_title(f"{ram} GB board: per-step wall ({LABEL} board time; transport and rest measured here)",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pack_note(n: int, cuts: dict) -> str:
    if n <= 1:
        return "pack: one graph per branch"
    word = lambda k, c: "token rows" if c == "rows" else "heads" if k != "ffn" else "hidden units"    # noqa: E731
    return f"pack --shards {n}: " + ", ".join(f"{k} by {word(k, c)}" for k, c in cuts.items())


def model_for(pol: str, model: BoardModel, budget: float, shards, memory=None) -> tuple:
    """The modelled pack a policy runs on: `--shards N` (cuts chosen by the model), else a sharded pack of the
    NPU's cores for a policy with the `shards` term, else the pack as it is -> (model, N, cuts)."""
    n = shards or (MAX_SHARDS if "shards" in pol.split("+") else model.shape.shards)
    if n > 1 and model.shape.shards != n:
        cuts, _ = board_auto.choose_cuts(model, n, budget, memory=memory)
        return board_auto.sharded_model(model, n, cuts), n, cuts
    return model, model.shape.shards, dict(model.shape.cuts)


def projection(model: BoardModel, e, calls: int, vae: str, budget: float, warm: bool = False, ram: float = 8,
               passes: int = 2) -> tuple:
    """(Projection, whether the VAE stays up) of the job a policy's evaluation `e` runs (MODELLED): cold, or `warm`
    (prompts cached; the VAE up from the last job through this one's denoise where
    account.stays_up_while_denoising allows it on a `ram` GB board: never on 8 GB). The encoder runs the texts the
    job's CFG `passes` need (account.encoder_s)."""
    from models.board.account import Projection, stays_up_while_denoising
    up = warm and stays_up_while_denoising(model, ram, budget, e.memory_mib)
    j = job_figures(model, warm=warm, vae_up=up, passes=passes)
    w, c, denoise = e.warm, e.cold, e.denoise_s
    return Projection(c.wall_s, w.wall_s, w.npu_s, w.lifecycle_s, w.host_s, w.transport_s, 0.0, denoise,
                      j["encode_s"], j["decode_s"], j["encode_s"] + denoise + j["decode_s"], j["decode_npu_s"],
                      j["encode_s"] + denoise + j["decode_npu_s"], computed=calls, vae=vae), up


def analytic_table(model: BoardModel, policies: list, rams: list, vae: str = "npu", shards=None,
                   calls: int = board_auto.COMPUTED_STEPS, passes: int = 2, size: tuple = (512, 512),
                   warm: bool = False) -> list:
    """The projection from the analytic timeline alone (what `auto` evaluates), in the bench's table rows. `auto`
    without --shards weighs the sharded packs too (board_auto.choose_pack) and says which pack it needs. The job is
    priced by its model calls (`calls`, `passes` CFG passes each: 1 at cfg 1). Every policy must also fit beside
    the largest branch call's activation memory at `size` (models/packs/memory_fit); auto says which did not."""
    from models.packs.memory_fit import for_auto
    memory = for_auto(size)
    kw = {"computed_steps": calls, "passes": passes}
    lines, last = [POLICY_HEADER + "  contexts  pack"], ""
    for ram in rams:
        budget = model.context_budget_mib(ram)
        for pol in policies:
            why = ""
            if pol == "auto" and not shards:
                n, cuts, e = board_auto.choose_pack(model, budget, memory=memory, **kw)
            else:
                m, n, cuts = model_for(pol, model, budget, shards, memory)
                if pol == "auto":
                    e = board_auto.choose(m, budget, memory=memory, **kw)[0]
                else:
                    shape, _ = policy_shape(pol, m, budget)
                    fit = memory(m, budget)
                    e = board_auto.evaluate(m, shape, budget, resident_contexts=None, fit=fit, **kw)
                    why = board_auto.memory_problem(shape, n, fit) if e is None and fit is not None else ""
            if e is None:
                lines.append(f"{pol:<28} {ram:>4} does not fit{': ' + why if why else ''}  [{LABEL}]")
                continue
            lines += [f"  {ram} GB, ruled out by memory: {why}" for why in e.ruled_out]
            p, up = projection(model, e, calls, vae, budget, warm, ram, passes)
            if warm:
                lines.append(f"  {ram} GB, warm: prompts cached (encoder 0 s); the VAE "
                             + ("stays up between jobs" if up else "loads (on 8 GB it is down while the DiT denoises; "
                                                             "else it does not fit beside the contexts)")
                             + f"  [{LABEL}]")
            name = f"auto: {e.policy.name}" if pol == "auto" else e.policy.name
            lines.append(format_policy_line(name, ram, p, f"{LABEL}, analytic")
                         + f"  {e.contexts}  {pack_note(n, cuts)}")
            last = summary_line(pol, ram, p)
    return lines + [last] if lines[1:] else lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="board-sim", choices=("board-sim", "rknn", "onnx"))
    ap.add_argument("--policy", action="append", help="a policy (repeat, or comma list; 'all' = " + ",".join(ALL) + ")")
    ap.add_argument("--board-ram", default="8", help="8, 16, 32 or a comma list (board-sim)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--resolution", default="512x512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=PROMPT.get("seed", 42))
    ap.add_argument("--pack", help="a real pack (rknn / onnx backends); default: the tiny pack at the resolution")
    ap.add_argument("--models", help="the models folder that goes with --pack")
    ap.add_argument("--cache", default="/tmp/anima-bench-overhead", help="where the tiny bundle and pack are kept")
    ap.add_argument("--json", default=None, help="default bench/out/overhead-BACKEND.json (runs are merged); with "
                    "--analytic: the printed table, only when given")
    ap.add_argument("--plot", default=None, help="default: the JSON's path with .png")
    ap.add_argument("--quant", choices=("w8a8",), default=None, help="--analytic: model a W8A8 pack of the "
                    "default INT8 layers (fc1, qkv, q; docs/quant.md)")
    ap.add_argument("--analytic", action="store_true", help="print the analytic timeline's table only (no runs)")
    ap.add_argument("--shards", type=int, choices=range(1, MAX_SHARDS + 1), default=None,
                    help="model a pack built with --shards N (cuts chosen by the model; a run builds the tiny "
                    "pack so); --analytic default: the pack's, or the NPU's cores for policies with the shards term, "
                    "and auto weighs every N")
    ap.add_argument("--vae", default="npu", choices=VAES, help="where the job's VAE decodes (the last line's job_s): "
                    "npu = a VAE pack on the NPU (estimate; the board bundle's default), cpu = the reference's "
                    "stable-diffusion.cpp (R11)")
    ap.add_argument("--calls", type=int, default=board_auto.COMPUTED_STEPS,
                    help="--analytic: the job's model calls (a run's report.json model_calls: a step cache's reused "
                    "calls make none; default the 20-step Spectrum job's 11)")
    ap.add_argument("--warm", action="store_true", help="--analytic: a warm job: its prompts' conditioning cached "
                    "in the run folder (no encoder start, load or run), the VAE up between jobs where the board's "
                    "memory allows it beside the contexts")
    ap.add_argument("--cfg", type=float, default=4.0, help="--analytic: the job's cfg (1: one CFG pass per call)")
    args = ap.parse_args(argv)
    try:
        args.time_scale = check_time_scale(args.time_scale)
        args.width, args.height = (int(v) for v in args.resolution.lower().split("x"))
        rams = [int(v) for v in args.board_ram.split(",")]
        if any(r not in BOARD_RAMS_GB for r in rams):
            raise ValueError(f"--board-ram {args.board_ram}: choose from {BOARD_RAMS_GB}")
        if not 1 <= args.steps <= 200:
            raise ValueError(f"--steps {args.steps}: 1..200")
        if not 1 <= args.calls <= 1000:
            raise ValueError(f"--calls {args.calls}: 1..1000")
        if not (math.isfinite(args.cfg) and 0.0 <= args.cfg <= 100.0):
            raise ValueError(f"--cfg {args.cfg}: a number in 0..100")
    except ValueError as e:
        print(f"bench/overhead.py: {e}", file=sys.stderr)
        return 2
    policies = [p for v in (args.policy or ["on-demand"]) for p in v.split(",")]
    policies = list(ALL) if policies == ["all"] else policies
    if args.quant and not args.analytic:      # a run builds the tiny FP16 pack: it would silently not be INT8
        print("bench/overhead.py: --quant models a W8A8 pack with --analytic only (runs use the tiny FP16 pack)",
              file=sys.stderr)
        return 2
    if args.backend != "board-sim" and args.time_scale != 1:
        print("bench/overhead.py: --time-scale paces board-sim only", file=sys.stderr)
        return 2
    if args.analytic:
        # the size asked for (the reference's own is 512x512); a pack's own size when one is given
        model = BoardModel(Shape.of_pack(args.pack, "full") if args.pack else Shape.at_resolution(args.width,
                                                                                               args.height))
        if args.quant:                      # the same model as a W8A8 pack of the default INT8 layers
            import dataclasses
            from models.quant.smooth import DEFAULT_INT8
            model = BoardModel(dataclasses.replace(model.shape, int8=DEFAULT_INT8))
            print(f"W8A8 pack: INT8 {', '.join(DEFAULT_INT8)} at the reference's measured "
                  f"{float(model.cost['quant']['int8_speedup']):.2f}x (R13), the rest FP16; sharded or not as "
                  f"--shards / auto choose  [{LABEL}]")
        passes = 1 if math.isclose(args.cfg, 1.0) else 2
        try:
            lines = analytic_table(model, policies, rams, args.vae, args.shards, args.calls, passes,
                                   (args.width, args.height), warm=args.warm)
        except ValueError as e:             # nothing fits this size on this board: say so, no traceback
            print(f"bench/overhead.py: --resolution {args.resolution}: {e}", file=sys.stderr)
            return 2
        for line in model.describe() + lines:
            print(line)
        if args.json:                       # the printed table, kept (a run's JSON holds runs; this is a projection)
            from models.base.durable import atomic_write
            doc = {"label": LABEL, "analytic": True, "resolution": [args.width, args.height], "quant": args.quant,
                   "shards": args.shards, "warm": args.warm, "policies": policies, "board_ram_gb": rams, "lines": model.describe() + lines}
            atomic_write(Path(args.json), (json.dumps(doc, indent=1) + "\n").encode())
            print(f"json: {args.json}  [{LABEL}]")
        return 0
    if args.pack:
        assets = (Path(args.models), Path(args.pack))
    else:
        from tests.pipeline_harness import tiny_assets
        n, cuts = args.shards or 1, {}
        if n > 1:                   # the cuts the model picks for the full-size pack (the tiny one computes them)
            full = BoardModel()
            cuts, _ = board_auto.choose_cuts(full, n, full.context_budget_mib(rams[0]))
        assets = tiny_assets(Path(args.cache), (args.width, args.height), shards=n, cuts=cuts)
    model = BoardModel(Shape.of_pack(assets[1], "full"))
    for line in model.describe():
        print(f"{line}  [{scale_note(args.time_scale)}]")
    for ram in rams:
        print(f"{LABEL} {ram} GB board: {model.contexts_fit(model.context_budget_mib(ram))} contexts fit "
              f"resident  [{scale_note(args.time_scale)}]")
    out = Path(args.json) if args.json else OUT / f"overhead-{args.backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()).get("runs", []) if out.exists() else []
    runs = []
    for ram in rams:
        for pol in policies:
            r = run_one(args, assets, model, pol, ram)
            print_run(r)
            runs.append(r)
            key = lambda x: (x["policy"], x["board_ram_gb"], x["steps"], x["time_scale"])     # noqa: E731
            old = [o for o in old if key(o) != key(r)] + [r]
            from models.base.durable import atomic_write
            atomic_write(out, (json.dumps({"runs": old}, indent=1) + "\n").encode())
    from models.board.account import Projection
    print(POLICY_HEADER)
    for r in runs:
        p = Projection(**{k: v for k, v in r["projection"].items() if k != "overhead_ratio"})
        print(format_policy_line(r["resolved"] if r["policy"] == "auto" else r["policy"], r["board_ram_gb"], p,
                                 r["label"], r["time_scale"]))
    last = Projection(**{k: v for k, v in runs[-1]["projection"].items() if k != "overhead_ratio"})
    for line in projection_notes(last, runs[-1]["label"]):
        print(f"{line}  [{scale_note(args.time_scale)}]")
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(old, png)
    print(f"json: {out}  plot: {png}  [{runs[-1]['label']}, {scale_note(args.time_scale)}]")
    r = runs[-1]
    print(summary_line(r["policy"], r["board_ram_gb"], last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
