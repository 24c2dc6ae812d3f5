"""Per-job report: stage wall times and peak RSS, per-branch-kind phase sums, teardown record; and its text table.
(A PNG's text chunks: orchestrator.engine.png_text.)"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from models.base.durable import atomic_write
from models.dit.partition import KINDS, TEXT_TOKENS
from models.runtime.phase_times import PhaseSums
from models.sampling.step_cache import NODE_NAMES
from models.base.schema import base_types
from models.runtime.probes import vm_hwm_kb
from orchestrator.engine.runfolder import ON_DEMAND_STAGES, STAGE_PROGRAMS

# a branch kind's sums in report.json: every PhaseSums field, seconds (float) and counts (int) as the record types them
SUMS = base_types(PhaseSums)

# latent.npy holds the sampler's latent [16, H/8, W/8] f32 in MODEL space: before the VAE's per-channel
# de-normalisation (models.vae.decoder.denormalize). ComfyUI's SaveLatent stores the other side, VAE space
# (its KSampler hands out latent * std + mean), as `latent_tensor` [1, 16, 1, H/8, W/8].
LATENT_SPACE = "model"
LATENT_NOTE = ("latent.npy is the model-space latent, before the VAE's per-channel std/mean; ComfyUI's SaveLatent "
               "stores latent * std + mean (VAE space)")


def peak_rss_mb(pid: int) -> float | None:
    """The process's own high-water RSS (VmHWM) plus its children's current RSS, in MiB; None when it is gone."""
    try:
        proc = psutil.Process(pid)
        own = max((vm_hwm_kb(pid) or 0) * 1024, proc.memory_info().rss)
        kids = sum(c.memory_info().rss for c in descendants(proc) if c.is_running())
        return (own + kids) / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def current_rss_mb(pid: int) -> float | None:
    """RSS of a process and its children now, in MiB."""
    try:
        proc = psutil.Process(pid)
        total = proc.memory_info().rss
        total += sum(c.memory_info().rss for c in descendants(proc))
        return total / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def descendants(proc: psutil.Process) -> list[psutil.Process]:
    """Every process below `proc`. On Linux from each thread's /proc/PID/task/TID/children (a few small files per
    stage) rather than psutil's children(), which reads the stat file of every process on the machine to find their
    parents: at each RSS sample of each stage (sample_interval_s) on a host of a few hundred processes, that scan was
    most of the orchestrator's CPU during a job. psutil's where the kernel has no such files."""
    found, todo = [], [proc.pid]
    while todo:
        kids = _child_pids(todo.pop())
        if kids is None:
            return proc.children(recursive=True)
        for pid in kids:
            try:
                found.append(psutil.Process(pid))
            except psutil.NoSuchProcess:            # gone since its parent listed it
                continue
            todo.append(pid)
    return found


def _child_pids(pid: int) -> list[int] | None:
    """The children of `pid` its threads list ([] when it is gone); None without /proc/PID/task/TID/children."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    kids = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            if os.path.isdir(f"/proc/{pid}/task/{tid}"):
                return None                         # a kernel without CONFIG_PROC_CHILDREN
        except ProcessLookupError:                  # the thread ended as it was read
            continue
    return kids


def text_record(tokens_cond: int, tokens_uncond: int, truncated: bool, rows: int = TEXT_TOKENS) -> dict:
    """The report's `text` entry: T5 token counts (EOS included) and, when a prompt is over the context, what that
    means for matching ComfyUI."""
    d = {"t5_tokens_prompt": int(tokens_cond), "t5_tokens_negative": int(tokens_uncond), "context_rows": rows,
         "truncated": bool(truncated)}
    if truncated:
        over = [f"{name} has {n} T5 tokens" for name, n in (("prompt", tokens_cond), ("negative prompt",
                                                                                     tokens_uncond)) if n > rows]
        need = max(tokens_cond, tokens_uncond)
        d["note"] = (f"{' and '.join(over)}; the pack's cross-attention sees only the first {rows} context rows, "
                     f"while ComfyUI keeps every row, so the picture differs from ComfyUI's; to match it, shorten "
                     f"the prompt to at most {rows} T5 tokens or use a pack built with --context {need} or more "
                     f"(docs/prompts.md)")
    return d


@dataclass
class StageRecord:
    wall_s: float = 0.0
    peak_rss_mb: float | None = None
    remote: bool = False

    def see_rss(self, mb: float | None) -> None:
        if mb is not None:
            self.peak_rss_mb = mb if self.peak_rss_mb is None else max(self.peak_rss_mb, mb)


@dataclass
class TeardownRecord:
    """Whether encoder/VAE processes were alive while the scheduler denoised, from supervisord samples."""

    encoder_running_during_denoise: bool = False
    vae_running_during_denoise: bool = False
    samples: int = 0
    encoder_remote: bool = False
    vae_remote: bool = False
    sightings: list = field(default_factory=list)   # [[t, program, state, pid]] of any live sample (first few)

    def sample(self, infos: dict) -> None:
        """One supervisord sample: `infos` maps "encoder"/"vae" to a ProcInfo (None for a remote stage)."""
        self.samples += 1
        for program in ON_DEMAND_STAGES:
            info = infos.get(program)
            if info is None or not info.live:
                continue
            setattr(self, f"{program}_running_during_denoise", True)
            if len(self.sightings) < 16:
                self.sightings.append([round(time.time(), 3), program, info.state, info.pid])


MEMORY_POINTS = 600          # per stage; past it every other sample is dropped and the spacing doubles


@dataclass
class MemoryTrace:
    """RSS of each stage over the job (measured: psutil on supervisord's pids), for the timing plot: {stage: [[t_s,
    rss_mb], ...]} with t_s from the job's start, thinned to at most MEMORY_POINTS samples per stage."""

    series: dict = field(default_factory=dict)
    spacing_s: dict = field(default_factory=dict)     # per stage: the thinnest spacing kept so far

    def add(self, stage: str, t_s: float, mb: float | None) -> None:
        if mb is None:
            return
        points = self.series.setdefault(stage, [])
        gap = self.spacing_s.get(stage, 0.0)
        if points and t_s - points[-1][0] < gap:
            return
        points.append([round(t_s, 3), round(mb, 1)])
        if len(points) > MEMORY_POINTS:
            del points[1::2]
            self.spacing_s[stage] = max(2 * gap, points[1][0] - points[0][0] if len(points) > 1 else 0.0)


@dataclass
class JobReport:
    job: str
    spec: dict
    stages: dict = field(default_factory=lambda: {s: StageRecord() for s in STAGE_PROGRAMS})
    teardown: TeardownRecord = field(default_factory=TeardownRecord)
    passes: list = field(default_factory=list)          # per DENOISE: where it ran in the job, its DENOISED fields
    encoder_timings: dict = field(default_factory=dict)
    encoder_started: bool = False      # this job started the encoder (False: its contexts were cached or kept)
    stage_starts: dict = field(default_factory=lambda: {"encoder": 0, "vae": 0})   # supervisord starts this run
    keep_up: str = "never"             # orchestrator/engine/keep_up.py: the job's policy, as resolved
    text: dict = field(default_factory=dict)            # T5 token counts of both prompts, truncated or not
    vae_timings: dict = field(default_factory=dict)
    vae_encode_timings: dict = field(default_factory=dict)     # img2img: VAE_ENCODE's timings ({} otherwise)
    image: str | None = None
    images: list = field(default_factory=list)         # a batch: per image {batch_index, seed, image, latent}
    base_images: list = field(default_factory=list)    # hires.keep_base: where each first-pass image is
    delivery: dict | None = None                       # {output, written, note?}: the copy to the prompt's `output`
    started: float = field(default_factory=time.time)
    finished: float | None = None
    board: dict | None = None        # board-sim: {pack_dir, time_scale, board_ram_gb, board_model} (modelled board)
    memory: MemoryTrace = field(default_factory=MemoryTrace)
    phases: list = field(default_factory=list)         # [[state, start_s, end_s]] from the job's start (this run)
    loras: list = field(default_factory=list)          # per LoRA: file, strengths, layers per place, where applied
    estimate: dict | None = None     # the job priced before it ran (orchestrator/engine/estimate.py; modelled seconds)
    plan: list = field(default_factory=list)           # per plan step: {step, stage, phase, ran (in this run)}

    def since_start(self) -> float:
        return time.time() - self.started

    def add_pass(self, where, denoised: dict) -> None:
        """One DENOISE's reply (DENOISED's wire fields) as the job's next sampling pass; `where` is its
        protocol.messages.DenoisePass (image of the batch, first or hires pass). The board-sim settings in force
        for it are kept with it (a hires pass's pack is another)."""
        self.passes.append({"image": where.image, "images": where.images, "pass": where.name,
                            "denoised": denoised, "board": self.board})

    def to_dict(self) -> dict:
        d = sum_passes(self.passes)
        branches = {k: {name: cast(d.get("branches", {}).get(k, {}).get(name, 0)) for name, cast in SUMS.items()}
                    for k in KINDS}
        t = self.teardown
        return {
            "job": self.job,
            "image": self.image,
            "images": self.images,
            **({"base_images": self.base_images} if self.base_images else {}),
            "delivery": self.delivery,
            "prompt": self.spec,
            "computed_steps": list(d.get("computed_steps", [])),
            "forecast_steps": list(d.get("forecast_steps", [])),
            "branch_calls": int(d.get("branch_calls", 0)),
            "nfe": sum(int(s.get("nfe", 1)) for s in d.get("steps", [])),      # model calls, both CFG passes each
            # the whole job's model calls run and those the step cache (EasyCache, LazyCache) answered
            "model_calls": int(d.get("model_calls", 0)),
            "reused_calls": int(d.get("reused_calls", 0)),
            "resumed_from": int(d.get("resumed_from", 0)),
            "resends": int(d.get("resends", 0)),
            # the backend the executor ran the branches on, as its READY said ("" from a scheduler that does not say)
            "executor_backend": next((p["denoised"].get("executor_backend") for p in reversed(self.passes)
                                      if p["denoised"].get("executor_backend")), ""),
            "passes": [pass_summary(p) for p in self.passes],
            "teardown": {"encoder_running_during_denoise": t.encoder_running_during_denoise,
                         "vae_running_during_denoise": t.vae_running_during_denoise,
                         "samples": t.samples, "encoder_remote": t.encoder_remote, "vae_remote": t.vae_remote,
                         "sightings": t.sightings},
            "stages": {n: {"wall_s": round(s.wall_s, 4),
                           "peak_rss_mb": None if s.peak_rss_mb is None else round(s.peak_rss_mb, 1),
                           "remote": s.remote} for n, s in self.stages.items()},
            "branches": branches,
            "host_s": float(d.get("host_s", 0.0)),
            "host_hidden_s": float(d.get("host_hidden_s", 0.0)),
            "host_work_s": float(d.get("host_work_s", 0.0)),
            "transport_s": float(d.get("transport_s", 0.0)),
            "steps": list(d.get("steps", [])),
            **({"board": self._board_section()} if any(p["board"] for p in self.passes) and d.get("steps") else {}),
            "encoder_timings": self.encoder_timings,
            "encoder_started": self.encoder_started,
            "stage_starts": dict(self.stage_starts),
            "keep_up": self.keep_up,
            "text": self.text,
            "loras": self.loras,
            "latent": {"file": "latent.npy", "space": LATENT_SPACE, "note": LATENT_NOTE},
            "vae_timings": self.vae_timings,
            "vae_encode_timings": self.vae_encode_timings,
            "phases": self.phases,
            "memory": {"unit": "MiB RSS", "measured": True, "series": self.memory.series},
            "wall_s": round((self.finished or time.time()) - self.started, 4),
            **({"estimate": self.estimate} if self.estimate else {}),
            "warnings": job_warnings(self.spec),
            "plan": self.plan,
        }

    def _board_section(self) -> dict:
        """The modelled board's figures (board seconds) apart from what was measured here (models/board/account.py)."""
        from models.board.account import board_section
        from models.board.cost import BoardModel
        priced = [(list(p["denoised"].get("steps", [])), p["board"]) for p in self.passes if p["board"]]
        b = priced[-1][1]
        return board_section([(steps, BoardModel.for_pack(pb["pack_dir"], pb.get("board_model", "full"),
                                                          pb.get("board_cost"))) for steps, pb in priced],
                             float(b.get("time_scale", 1.0)), b)

    def write(self, path: Path) -> Path:
        return atomic_write(path, json.dumps(self.to_dict(), indent=1))


PASS_LISTS = ("computed_steps", "forecast_steps")
PASS_COUNTS = ("branch_calls", "model_calls", "reused_calls", "resends")
PASS_SECONDS = ("host_s", "host_hidden_s", "host_work_s", "transport_s", "wall_s")


def sum_passes(passes: list) -> dict:
    """The job's sampling as one DENOISED-like dict over all its passes (every batch image, a hires pass): counts,
    seconds and branch sums added, step lists and step rows one after another (a job of several passes tags each
    step row with its image and pass), resumed_from the furthest any pass went on from."""
    if len(passes) == 1:
        return passes[0]["denoised"]
    out = {k: [] for k in PASS_LISTS + ("steps",)}
    out.update({k: 0 for k in PASS_COUNTS + PASS_SECONDS + ("resumed_from",)})
    branches: dict = {}
    for p in passes:
        d = p["denoised"]
        for k in PASS_LISTS:
            out[k] += list(d.get(k, []))
        out["steps"] += [{**row, "image": p["image"], "pass": p["pass"]} for row in d.get("steps", [])]
        for k in PASS_COUNTS + PASS_SECONDS:
            out[k] += d.get(k, 0)
        out["resumed_from"] = max(out["resumed_from"], int(d.get("resumed_from", 0)))
        for kind, sums in d.get("branches", {}).items():
            mine = branches.setdefault(kind, {})
            for name, value in sums.items():
                mine[name] = mine.get(name, 0) + value
    out["branches"] = branches
    return out


def pass_summary(p: dict) -> dict:
    """report.json's `passes` entry: one DENOISE of the job, where it ran and what it counted."""
    d = p["denoised"]
    return {"image": p["image"], "images": p["images"], "pass": p["pass"],
            "computed_steps": list(d.get("computed_steps", [])), "forecast_steps": list(d.get("forecast_steps", [])),
            **{k: int(d.get(k, 0)) for k in ("branch_calls", "model_calls", "reused_calls", "resumed_from")},
            "wall_s": round(float(d.get("wall_s", 0.0)), 4)}


def job_warnings(spec: dict) -> list:
    """What the job record tells its user about settings that do nothing: a negative prompt at cfg 1 (ComfyUI runs
    no unconditional pass there, so it is not encoded)."""
    if not str(spec.get("negative_prompt") or "").strip():
        return []
    from models.sampling.sampler import cfg_passes
    hires = spec.get("hires") or {}
    cfgs = [spec.get("cfg", 4.0)] + ([hires.get("cfg") or spec.get("cfg", 4.0)] if hires else [])
    if any(cfg_passes(float(c)) > 1 for c in cfgs):
        return []
    return ["cfg 1: the negative prompt changes nothing (no unconditional pass runs, as in ComfyUI) and was not "
            "encoded; raise cfg above 1 for it to count"]


def estimate_rows(report: dict) -> list:
    """The estimate made before the job ran beside what was measured: encode, denoise, decode and the job, seconds
    (the modelled row in board seconds; the measured row on this machine, or the board-sim's modelled board
    denoise where the run was paced)."""
    e = report.get("estimate")
    if not e:
        return []
    st = report.get("stages", {})
    wall = lambda n: float(st.get(n, {}).get("wall_s", 0.0))     # noqa: E731
    board = report.get("board")
    denoise = float(board["denoise_board_s"]) if board else wall("scheduler")
    what = "board-sim run (denoise: its modelled board)" if board else "this run"
    head = f"{'':<22} {'encode s':>9} {'denoise s':>10} {'decode s':>9} {'job s':>9} {'calls':>6} {'passes':>6}"
    return [head,
            f"{'estimate (modelled)':<22} {e['encode_s']:>9.1f} {e['denoise_s']:>10.1f} {e['decode_s']:>9.1f} "
            f"{e['job_s']:>9.1f} {e['calls']:>6} {e['passes']:>6}",
            f"{'measured':<22} {wall('encoder'):>9.1f} {denoise:>10.1f} {wall('vae'):>9.1f} "
            f"{float(report.get('wall_s', 0.0)):>9.1f} {int(report.get('model_calls') or report.get('nfe') or 0):>6} "
            f"{'':>6}  ({what})"]


def format_table(report: dict) -> str:
    """The timing table `orchestrator submit --wait` prints: per stage, then per branch kind and phase."""
    lines = [f"{'stage':<10} {'wall s':>9} {'peak RSS MB':>12}"]
    for name, s in report.get("stages", {}).items():
        rss = "remote" if s.get("remote") else ("-" if s.get("peak_rss_mb") is None else f"{s['peak_rss_mb']:.0f}")
        lines.append(f"{name:<10} {s.get('wall_s', 0.0):>9.2f} {rss:>12}")
    lines.append("")
    board = report.get("board")
    paced = f"  (paced: modelled board x time_scale {board['time_scale']:g})" if board else ""
    lines.append(f"{'branch':<10} {'calls':>6} {'load s':>9} {'init s':>9} {'infer s':>9} {'release s':>10} "
                 f"{'visible s':>10} {'cached':>7}{paced}")
    for kind, b in report.get("branches", {}).items():
        lines.append(f"{kind:<10} {b.get('calls', 0):>6} {b.get('load_s', 0):>9.2f} {b.get('init_s', 0):>9.2f} "
                     f"{b.get('infer_s', 0):>9.2f} {b.get('release_s', 0):>10.2f} {b.get('visible_s', 0):>10.2f} "
                     f"{b.get('cached', 0):>7}")
    lines.append("")
    steps = report.get("computed_steps", [])
    if board:
        from models.board.account import format_board_section
        lines += format_board_section(board)
    lines.append(f"host ops {report.get('host_s', 0.0):.2f} s{' (paced)' if board else ''} "
                 f"({report.get('host_hidden_s', 0.0):.2f} s behind inference), transport "
                 f"{report.get('transport_s', 0.0):.2f} s (measured), "
                 f"{report.get('branch_calls', 0)} branch calls, {len(steps)} computed steps "
                 f"({len(report.get('forecast_steps', []))} forecast), {report.get('nfe', len(steps))} model calls"
                 f"{_reused(report)}, "
                 f"total {report.get('wall_s', 0.0):.1f} s")
    text = report.get("text") or {}
    if text.get("truncated"):
        lines.append(f"prompt truncated: {text.get('note', '')}")
    rows = estimate_rows(report)
    if rows:
        lines += [""] + rows
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    td = report.get("teardown", {})
    lines.append(f"encoder running during denoise: {td.get('encoder_running_during_denoise')}, "
                 f"vae running during denoise: {td.get('vae_running_during_denoise')} "
                 f"({td.get('samples', 0)} supervisord samples)")
    return "\n".join(lines)


def _reused(report: dict) -> str:
    """' (N reused by EasyCache|LazyCache)' when the job ran a step cache."""
    cache = (report.get("prompt") or {}).get("cache") if isinstance(report.get("prompt"), dict) else None
    n = int(report.get("reused_calls", 0))
    if not n and not cache:
        return ""
    name = NODE_NAMES.get((cache or {}).get("kind"), "the step cache")
    return f" ({n} reused by {name})"
