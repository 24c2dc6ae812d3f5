"""A picture of one job: `RUN/jobs/<id>/timing.png`, drawn from its report.json with matplotlib (Agg).

    python -m orchestrator.engine.timing_plot RUN/jobs/<id>/report.json [-o timing.png]

Panels: (1) per sampler step, the scheduler's critical path stacked: the executor's branch inference (the NPU's work
on the board; the legend names the executor backend that ran), the lifecycle it waited for (load/init/release not hidden by a policy), host ops, transport and the
rest (sampler, state file); (2) per branch kind, the executor's load/init/infer/release totals, and a VAE pack's
trunk and tile models the same way (the VAE stage's own figures, measured here); (3) every stage's RSS
over the job, with the encode/denoise/decode phases shaded. Figures are measured on this machine. With the board-sim
executor backend the per-step panel shows the report's `board.steps` instead: board seconds of the MODELLED RK3588
(inference, lifecycle, host ops; transport and the rest measured here, each series says which), and the executor
panel says its phases were paced to the modelled board x time_scale.

The daemon runs this module in a short child process after each job (orchestrator.engine.plan.run), so matplotlib's memory
and import time never enter the long-lived daemon, and every job has its plot whether or not the HTTP front runs.
The PNG carries a `anima-plot` text chunk: the panels and series it drew (what tests check, not pixels).
"""
from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from models.base.durable import atomic_write

STEP_SERIES = (  # report step field -> legend (the critical path of one step, bottom to top); {backend}: the one run
    ("infer_s", "branch inference ({backend})"),
    ("lifecycle_s", "visible lifecycle (load/init/release waited for)"),
    ("host_s", "host ops"),
    ("transport_s", "transport"),
)
PHASES = ("load_s", "init_s", "infer_s", "release_s")
VAE_MODELS = ("trunk", "tile")     # models.vae.pack_decoder: one trunk call, then the tile model for every tile
STAGE_ORDER = ("encoder", "scheduler", "executor", "vae")
PHASE_COLOURS = {"encoding": "#d9e8f5", "denoising": "#f5ecd9", "decoding": "#e1f5d9"}
COLOURS = {"branch inference": "#2ca02c", "visible lifecycle (load/init/release waited for)": "#ff7f0e",
           "host ops": "#1f77b4", "transport": "#d62728", "other (sampler, state file)": "#9467bd",
           "branch inference (MODELLED NPU + tensor I/O)": "#2ca02c", "visible lifecycle (MODELLED)": "#ff7f0e",
           "host ops (MODELLED board CPU)": "#1f77b4", "transport (measured here)": "#d62728",
           "other: sampler, state file (measured here)": "#9467bd",
           "load_s": "#ffbb78", "init_s": "#ff7f0e", "infer_s": "#2ca02c", "release_s": "#c49c94"}


BOARD_SERIES = (  # report board.steps field -> legend, each saying where it comes from
    ("infer_s", "branch inference (MODELLED NPU + tensor I/O)"),
    ("lifecycle_s", "visible lifecycle (MODELLED)"),
    ("host_s", "host ops (MODELLED board CPU)"),
    ("transport_s", "transport (measured here)"),
    ("other_s", "other: sampler, state file (measured here)"),
)


def label_board(board: dict) -> str:
    return (f"MODELLED RK3588 ({board.get('source', 'models/board/cost.toml')}, board-sim); transport and the rest "
            "measured on this machine")


def provenance(report: dict) -> str:
    """How the timing panels' seconds came about: measured here, or paced to the modelled board (board-sim)."""
    board = report.get("board")
    if board:
        return (f"board-sim: executor phases and host ops paced to the MODELLED RK3588 x time_scale "
                f"{board.get('time_scale', 1.0):g} (models/board/cost.toml), transport measured here")
    return "measured on this machine"


def _step_axis(rows: list) -> list:
    """The steps panel's x: the step numbers, or 1..N over a job of several sampling passes (batch images, a hires
    pass), whose step numbers start again at 1 each pass."""
    steps = [int(r["step"]) for r in rows]
    return steps if len(set(steps)) == len(steps) else list(range(1, len(steps) + 1))


def plot_data(report: dict) -> dict:
    """What the picture shows, as data: {title, provenance, panels: [{name, title, ...series}]}."""
    label = provenance(report)
    spec = report.get("prompt") or {}
    size = f"{spec.get('width', '?')}x{spec.get('height', '?')}"
    title = (f"job {report.get('job', '?')}  {size}, {spec.get('steps', '?')} steps, "
             f"{report.get('branch_calls', 0)} branch calls, {report.get('wall_s', 0.0):.1f} s")
    panels = []
    steps = report.get("steps") or []
    board = report.get("board") or {}
    if board.get("steps"):         # board-sim: the same steps in modelled board seconds (models/board/account.py rows)
        rows = board["steps"]
        series = {name: [float(r.get(key, 0.0)) for r in rows] for key, name in BOARD_SERIES}
        panels.append({"name": "steps", "title": f"per step in board seconds: {label_board(board)}",
                       "x": _step_axis(rows), "computed": [bool(r.get("computed", True)) for r in rows],
                       "series": series})
    elif steps:
        backend = report.get("executor_backend") or "executor"
        series = {name.format(backend=backend): [float(s.get(key, 0.0)) for s in steps] for key, name in STEP_SERIES}
        other = [max(0.0, float(s.get("wall_s", 0.0)) - sum(float(s.get(k, 0.0)) for k, _ in STEP_SERIES))
                 for s in steps]
        series["other (sampler, state file)"] = other
        panels.append({"name": "steps", "title": f"per step ({label})", "x": _step_axis(steps),
                       "computed": [bool(s.get("computed", True)) for s in steps], "series": series})
    branches = {k: {p: float(v.get(p, 0.0)) for p in PHASES} for k, v in (report.get("branches") or {}).items()
                if v.get("calls")}
    labels = {k: f"{k} ({int(report['branches'][k]['calls'])} calls)" for k in branches}
    notes = {}
    for k in branches:               # the lifecycle policy's split (models.runtime.phase_times.PhaseSums), when reported
        b = report["branches"][k]
        if "visible_s" in b:
            notes[k] = (f"lifecycle {float(b['visible_s']):.2f} s visible, {float(b.get('hidden_s', 0.0)):.2f} s "
                        f"hidden; {int(b.get('cached', 0))} cached")
    vae = report.get("vae_timings") or {}
    for model in VAE_MODELS:         # a VAE pack's models (DECODED's flat per-model phases); torch has none
        if any(f"{model}_{p}" in vae for p in PHASES):
            branches[f"vae {model}"] = {p: float(vae.get(f"{model}_{p}", 0.0)) for p in PHASES}
            labels[f"vae {model}"] = f"VAE pack {model} (VAE stage, measured here)"
    if branches:
        what = "executor per branch kind" + (", VAE pack models" if any(k.startswith("vae ") for k in branches)
                                             else "")
        panels.append({"name": "branches", "title": f"{what} ({label})", "labels": labels, "notes": notes,
                       "series": branches})
    memory = (report.get("memory") or {}).get("series") or {}
    if memory:
        ordered = {s: memory[s] for s in STAGE_ORDER if memory.get(s)}
        ordered.update({s: v for s, v in memory.items() if s not in ordered and v})
        panels.append({"name": "memory", "title": "RSS of each stage (measured on this machine)",
                       "series": ordered, "phases": report.get("phases") or []})
    return {"title": title, "provenance": label, "panels": panels}


def colour_of(name: str) -> str | None:
    """A series' colour: its own, else its kind's (the backend in "branch inference (onnx)" varies by run)."""
    return COLOURS.get(name, COLOURS.get(name.split(" (")[0]))


def series_colours(data: dict) -> dict:
    """Every colour a drawing of `data` (plot_data's) needs, by the names its panels use."""
    names = {n for p in data["panels"] for n in (p.get("series") or {})}
    return {**COLOURS, **{n: c for n in names if (c := colour_of(n)) is not None}}


def _steps_panel(ax, p: dict) -> None:
    x = p["x"]
    bottom = [0.0] * len(x)
    for name, values in p["series"].items():
        ax.bar(x, values, bottom=bottom, label=name, width=0.8, color=colour_of(name))
        bottom = [b + v for b, v in zip(bottom, values)]
    for xi, computed, top in zip(x, p["computed"], bottom):
        if not computed:
            ax.annotate("forecast", (xi, top), ha="center", va="bottom", fontsize=7, rotation=90)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("sampler step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _branches_panel(ax, p: dict) -> None:
    kinds = list(p["series"])
    left = [0.0] * len(kinds)
    for phase in PHASES:
        values = [p["series"][k][phase] for k in kinds]
        ax.barh(kinds, values, left=left, label=phase[:-2], color=COLOURS[phase])
        left = [a + b for a, b in zip(left, values)]
    ax.set_yticks(range(len(kinds)), [p["labels"][k] + (f"\n{p['notes'][k]}" if k in p["notes"] else "")
                                      for k in kinds], fontsize=8)
    ax.set_xlabel("seconds (sums over the job)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _memory_panel(ax, p: dict) -> None:
    for state, t0, t1 in p["phases"]:
        ax.axvspan(t0, t1, color=PHASE_COLOURS.get(state, "#eeeeee"), zorder=0)
        ax.annotate(state, ((t0 + t1) / 2, 1.0), xycoords=("data", "axes fraction"), ha="center", va="top",
                    fontsize=7)
    for stage, points in p["series"].items():
        ax.plot([t for t, _ in points], [mb for _, mb in points], label=stage, marker="." if len(points) < 3 else None)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


DRAW = {"steps": _steps_panel, "branches": _branches_panel, "memory": _memory_panel}


def render(report: dict) -> tuple[bytes, dict]:
    """-> (PNG bytes, plot_data). Uses matplotlib's Figure and Agg canvas directly (no pyplot global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    data = plot_data(report)
    n = max(1, len(data["panels"]))
    fig = Figure(figsize=(12, 3.2 * n + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(data["title"], fontsize=10)
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for ax, p in zip(axes, data["panels"]):
        DRAW[p["name"]](ax, p)
        ax.set_title(p["title"], fontsize=9)
    if not data["panels"]:
        axes[0].text(0.5, 0.5, "no timing data in this report", ha="center", va="center")
    summary = {"provenance": data["provenance"],
               "panels": {p["name"]: sorted(p["series"]) for p in data["panels"]}}
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": "anima-npu orchestrator.engine.timing_plot",
                                             "anima-plot": json.dumps(summary)})
    return buf.getvalue(), data


def write_plot(report_path: Path, out: Path | None = None) -> Path:
    report = json.loads(Path(report_path).read_text())
    png, _ = render(report)
    return atomic_write(out or Path(report_path).with_name("timing.png"), png)


def _die_with(parent: int) -> None:
    """Linux: be killed when the process that started us dies (no plot outlives a SIGKILLed daemon)."""
    import ctypes
    import os
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:                                            # it died before the prctl
        sys.exit(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.engine.timing_plot", description=__doc__.split("\n")[0])
    ap.add_argument("report", help="a job's report.json")
    ap.add_argument("-o", "--out", help="the PNG (default: timing.png next to the report)")
    ap.add_argument("--parent", type=int, help=argparse.SUPPRESS)        # the daemon's pid: die with it
    args = ap.parse_args(argv)
    if args.parent:
        _die_with(args.parent)
    try:
        path = write_plot(Path(args.report), Path(args.out) if args.out else None)
    except ImportError as e:
        print(f"timing plot: matplotlib is missing ({e}); pip install matplotlib", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"timing plot: {args.report}: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
