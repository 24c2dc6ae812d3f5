"""Chaos trials: SIGKILL one stage at a random moment of a tiny job; the job must finish, bitwise as undisturbed, clean.

    .venv/bin/python bench/chaos.py --stage scheduler --trials 20 --json bench/out/chaos_scheduler.json
    .venv/bin/python bench/chaos.py --stage all --trials 20 --seed 7       # 20 per stage, one supervisord session
    .venv/bin/python bench/chaos.py --stage all --kind all --trials 4      # 4 per stage and job kind: 120 trials
    .venv/bin/anima-models synth lora --preset tiny --seed 1 --rank 4 --groups blocks,host,adapter,te --out style.safetensors
    .venv/bin/python bench/chaos.py --stage all --trials 2 --sampler euler_ancestral --lora style.safetensors:0.8:1.2

One real pipeline (tests/pipeline_harness.py: supervisord, the five real programs, the embedded tiny bundle, a 128x128
FP16 pack, and a 160x160 one for the hires kinds) serves every trial. Job kinds (`--kind`, JOB_KINDS): txt2img; img2img
(an uploaded init image, denoise 0.6: the VAE encodes it first); hires_latent and hires_pixel (a second pass at 1.25x
on the 160x160 pack from the first latent upscaled by bislerp, or from the first image decoded, scaled by lanczos and
encoded again); batch (two images from one seed, one DENOISE each); split (split sampling: the first half of the steps
returning its leftover noise, a second DENOISE at cfg 1.5 chained on that latent without noise). Per kind the first job runs undisturbed: its final
latents and images are the reference, its times place the kills. Each trial submits the same job and SIGKILLs the
chosen program at a moment drawn from a seeded RNG (recorded per trial): encoder / VAE a random fraction into the time
their processes were up during the job (the VAE of img2img and hires_pixel is up twice), scheduler / executor at a
random branch call of all the job's denoise passes (counted in the executor's trace), orchestrator a random fraction
into the whole job. Then: the job is `done` (supervisord restarted the program; the orchestrator retried or resumed),
every latent (`latent*.npy`, `hires_latent*.npy`) and image's pixels (`image*.png`) bitwise the reference, no /dev/shm
segment of the run is left, and no process of the run lives outside supervisord's programs nor as a child of one. A
draw that comes too late (the stage already gone) is drawn again over a shorter span, so every counted trial killed
something. `--sampler` a stochastic one (euler_ancestral, dpmpp_2m_sde, er_sde): its noise must resume bitwise from the
job's sampler state. `--lora FILE[:STRENGTH[:CLIP_STRENGTH]]` (repeatable): the file is copied into the models
folder's loras/, the packs are built LoRA-ready (`--lora-rank`, default the sum of the files' ranks) and every job
names it. `--board-encoder`: the board's text encoder (ONNX Runtime, `anima-models bundle --target none`) instead of
torch, a second or so less per job. The last lines printed are a table of identical/trials per kind and stage and
`survived=<k>/<n> identical=<k>/<n> shm_leaked=<count> orphans=<count>`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.lora.file import LoraError, LoraFile  # noqa: E402
from models.lora.plan import parse_lora_arg  # noqa: E402
from orchestrator.terminal.cli import CliError  # noqa: E402
from bench.chaos_jobs import (HIRES_SCALE, INIT_IMAGE, JOB_KINDS, PACK_SIZE, TraceCount, differing,  # noqa: E402
                              hires_size, init_png, job_outputs, job_prompt, trace_size)
from orchestrator.engine.inputs import save_upload  # noqa: E402
from tests.pipeline_harness import TRACE_FILE, Pipeline, board_stage_toml, tiny_assets  # noqa: E402
from tests.signals import signal_process  # noqa: E402

STAGES = ("encoder", "scheduler", "executor", "vae", "orchestrator")
# 4 steps, Spectrum warm-up 1: computed [1, 2, 4], forecast [3] (a resumed scheduler must restore Spectrum history)
PROMPT = {"prompt": "1girl, chaos, (red eyes:1.2)", "negative_prompt": "lowres", "seed": 4242, "steps": 4,
          "cfg": 4.0, "sampler": "euler", "scheduler": "sgm_uniform", "spectrum": {"warmup": 1}}
JOB_TIMEOUT_S = 900.0
POLL_S = 0.02
SETTLE_S = 15.0              # after a job: how long leftovers may take to go (arena close, supervisord reaping)
MAX_REDRAWS = 3              # a kill moment that came too late is drawn again this often
LIFE_FRACTION = 0.8          # encoder/VAE/orchestrator kills land in the first 80 % of the measured span
END_STATES = ("done", "failed", "cancelled")


@dataclass
class Baseline:
    """A kind's undisturbed job: its results and where the time goes (seconds, measured by polling)."""
    kind: str
    job: str
    outputs: dict                # job_outputs: {file name: array}
    calls: int                   # branch calls the executor served (all denoise passes)
    alive_s: dict                # encoder / vae: seconds their processes were up during the job
    job_s: float                 # submit .. done

    @property
    def latent(self) -> np.ndarray:
        return self.outputs["latent.npy"]

    def public(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        d["outputs"] = {k: list(v.shape) for k, v in self.outputs.items()}
        return d


@dataclass
class Trial:
    stage: str
    index: int
    seed: int                    # the trial's RNG seed (base seed, kind, stage, index)
    kind: str = "txt2img"
    moment: dict = field(default_factory=dict)   # the draw and where the kill landed
    job: str = ""
    killed_pid: int = 0
    redraws: int = 0
    state: str = ""
    error: str = ""
    identical: bool = False
    differs: list = field(default_factory=list)  # results not bitwise the reference's
    shm_leaked: list = field(default_factory=list)
    orphans: list = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def survived(self) -> bool:
        return self.state == "done"

    def line(self) -> str:
        where = " ".join(f"{k}={v}" for k, v in self.moment.items())
        err = f" error={self.error[:300]!r}" if self.error else ""
        diff = f" differs={self.differs}" if self.differs else ""
        return (f"[{self.kind} {self.stage} #{self.index}] seed={self.seed} {where} pid={self.killed_pid} "
                f"redraws={self.redraws} -> {self.state} identical={self.identical}{diff} shm={len(self.shm_leaked)} "
                f"orphans={len(self.orphans)} {self.wall_s:.1f}s{err}")


class TooLate(Exception):
    """The drawn moment passed before it could be hit (the stage already gone): draw again."""


class Chaos:
    """Trials on one pipeline: `baseline(kind)` once per job kind, then `trial(stage, index, kind)` as often as
    wanted. `hires_scale`: the hires kinds' scale (its second-pass pack must be the pipeline's)."""

    def __init__(self, pipe: Pipeline, seed: int = 0, prompt: dict | None = None, log=print,
                 hires_scale: float = HIRES_SCALE):
        self.pipe, self.seed, self.prompt, self.log = pipe, seed, dict(prompt or PROMPT), log
        self.prompts = {k: job_prompt(k, self.prompt, hires_scale) for k in JOB_KINDS}
        self.bases: dict[str, Baseline] = {}
        self.life: dict[tuple, float] = {}       # (kind, stage) -> span the encoder/VAE/orchestrator draws spread
                                                 # over (shrinks when a draw came too late)

    @property
    def base(self) -> Baseline | None:
        """The txt2img baseline."""
        return self.bases.get("txt2img")

    # ------------------------------------------------------------ the undisturbed run

    def baseline(self, kind: str = "txt2img") -> Baseline:
        if kind not in JOB_KINDS:
            raise ValueError(f"job kind {kind!r}: choose one of {', '.join(JOB_KINDS)}")
        p, t0 = self.pipe, time.monotonic()
        if kind == "img2img":
            save_upload(p.rf.root, "input", INIT_IMAGE[0], INIT_IMAGE[1], init_png(), overwrite=True)
        self._quiet()
        at = trace_size(p.root / TRACE_FILE)
        job = p.submit(self.prompts[kind])
        alive = {"encoder": 0.0, "vae": 0.0}
        last = time.monotonic()
        while True:
            info = p.status(job)
            now = time.monotonic()
            for stage in alive:
                if p.sup.info(stage).pid:
                    alive[stage] += now - last
            last = now
            if info is not None and info.state in END_STATES:
                break
            if now - t0 > JOB_TIMEOUT_S:
                raise AssertionError(f"the undisturbed {kind} job {job} did not finish in {JOB_TIMEOUT_S:.0f} s\n"
                                     f"{p.logs()}")
            time.sleep(POLL_S)
        if info.state != "done":
            raise AssertionError(f"the undisturbed {kind} job failed: {info.error_stage}: {info.error}\n{p.logs()}")
        b = Baseline(kind=kind, job=job, outputs=job_outputs(p.job_dir(job)), calls=TraceCount(p.root / TRACE_FILE,
                     job, at)(), alive_s={k: round(v, 3) for k, v in alive.items()}, job_s=time.monotonic() - t0)
        self.bases[kind] = b
        self.log(f"baseline {kind} {job}: {b.job_s:.1f} s (encoder up {b.alive_s['encoder']:.1f} s, VAE up "
                 f"{b.alive_s['vae']:.1f} s), {b.calls} branch calls, results {sorted(b.outputs)}")
        return b

    # ------------------------------------------------------------ one trial

    def trial(self, stage: str, index: int, kind: str = "txt2img") -> Trial:
        if stage not in STAGES:
            raise ValueError(f"stage {stage!r}: choose one of {', '.join(STAGES)}")
        if kind not in self.bases:
            self.baseline(kind)
        base = self.bases[kind]
        seed = self.seed * 1_000_003 + JOB_KINDS.index(kind) * 100_003 + STAGES.index(stage) * 10_007 + index
        rng = random.Random(seed)
        t = Trial(stage=stage, index=index, seed=seed, kind=kind)
        t0 = time.monotonic()
        info = None
        for attempt in range(MAX_REDRAWS + 1):
            t.redraws = attempt
            self._quiet()
            at = trace_size(self.pipe.root / TRACE_FILE)
            try:
                t.job = self.pipe.submit(self.prompts[kind])
            except CliError as e:                   # refused: a failed trial, and the next one is still tried
                t.state, t.error, t.wall_s = "refused", str(e), time.monotonic() - t0
                return t
            try:
                t.moment, t.killed_pid = self._kill(stage, kind, t.job, rng, TraceCount(self.pipe.root / TRACE_FILE,
                                                                                        t.job, at))
            except TooLate as e:
                self.log(f"[{kind} {stage} #{index}] too late ({e}); drawing again")
                self.pipe.wait(t.job, timeout_s=JOB_TIMEOUT_S)
                continue
            info = self.pipe.wait(t.job, timeout_s=JOB_TIMEOUT_S)
            break
        else:
            t.state, t.error = "not-killed", f"every draw came too late ({MAX_REDRAWS + 1} jobs)"
            t.wall_s = time.monotonic() - t0
            return t
        t.state = info.state
        if info.state != "done":
            t.error = f"{info.error_stage}: {info.error}"
        else:
            t.differs = differing(job_outputs(self.pipe.job_dir(t.job)), base.outputs)
            t.identical = not t.differs
        t.shm_leaked, t.orphans = self._leftovers()
        t.wall_s = time.monotonic() - t0
        return t

    def _quiet(self) -> None:
        """Between jobs: encoder and VAE stopped, every program that should run is RUNNING."""
        for name in ("scheduler", "executor", "orchestrator"):
            self.pipe.wait_program(name, ("RUNNING",))
        for name in ("encoder", "vae"):
            self.pipe.wait_program(name, ("STOPPED", "EXITED", "FATAL"))

    def _kill(self, stage: str, kind: str, job: str, rng: random.Random, served: TraceCount) -> tuple[dict, int]:
        """Wait for the drawn moment of `job` and SIGKILL `stage` there; -> (the moment, the pid killed)."""
        u = rng.random()
        if stage in ("encoder", "vae"):
            return self._kill_on_demand(stage, kind, job, u)
        if stage == "orchestrator":
            p = self.pipe
            delay = u * LIFE_FRACTION * self.life.setdefault((kind, stage), self.bases[kind].job_s)
            time.sleep(delay)
            info = p.status(job)
            if info is None or info.state in END_STATES:
                self.life[(kind, stage)] = delay / LIFE_FRACTION * 0.9
                raise TooLate(f"job {getattr(info, 'state', '?')} after {delay:.2f} s")
            call = served()
            pid = p.kill("orchestrator")
            return {"u": round(u, 4), "delay_s": round(delay, 3), "state": info.state, "call": call}, pid
        return self._kill_at_call(stage, job, u, served, self.bases[kind].calls)

    def _kill_on_demand(self, stage: str, kind: str, job: str, u: float) -> tuple[dict, int]:
        """Encoder / VAE: once their processes have been up `u` x LIFE_FRACTION of the baseline's time (summed over
        each time the flow brought them up)."""
        p, deadline = self.pipe, time.monotonic() + JOB_TIMEOUT_S
        delay = u * LIFE_FRACTION * self.life.setdefault((kind, stage), self.bases[kind].alive_s[stage])
        up, last = 0.0, time.monotonic()
        while True:
            info = p.status(job)
            if info is not None and info.state in END_STATES:
                self.life[(kind, stage)] = max(up, POLL_S) / LIFE_FRACTION * 0.9   # the machine got faster
                raise TooLate(f"job {info.state} after {stage} was up {up:.2f} s of {delay:.2f}")
            now, pid = time.monotonic(), p.sup.info(stage).pid
            if pid:
                up += now - last
            last = now
            if pid and up >= delay:
                try:
                    signal_process(pid)
                except ProcessLookupError:
                    raise TooLate(f"{stage} {pid} gone as it was killed") from None
                return {"u": round(u, 4), "delay_s": round(delay, 3),
                        "state": getattr(info, "state", "?")}, pid
            self._deadline(deadline, job)
            time.sleep(POLL_S)

    def _kill_at_call(self, stage: str, job: str, u: float, served: TraceCount, total: int) -> tuple[dict, int]:
        """Scheduler / executor: once the executor has served `u` x the baseline's branch calls of `job` (any pass)."""
        p, deadline = self.pipe, time.monotonic() + JOB_TIMEOUT_S
        target = min(total - 1, int(u * total))
        while True:
            info = p.status(job)
            if info is not None and info.state in ("decoding",) + END_STATES:
                raise TooLate(f"denoise over before call {target}")
            n = served()
            if info is not None and info.state == "denoising" and n >= target:
                break
            self._deadline(deadline, job)
            time.sleep(POLL_S)
        pid = p.kill(stage)
        last = served.last
        after = f"step{last['step']}/b{last['block']}/{last['branch']}" if last else "-"
        return {"u": round(u, 4), "target": target, "call": n, "after": after}, pid

    def _deadline(self, deadline: float, job: str) -> None:
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job}: nothing happened in {JOB_TIMEOUT_S:.0f} s\n{self.pipe.logs()}")

    def _leftovers(self) -> tuple[list, list]:
        """(segments of the run, stray/child processes), given SETTLE_S to go away (arena close, reaping)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            shm = self.pipe.leftover_segments()
            procs = [f"{q.pid}:{' '.join(q.cmdline()[:3]) if q.is_running() else '?'}"
                     for q in self.pipe.strays() + self.pipe.stage_children()]
            if (not shm and not procs) or time.monotonic() > deadline:
                return shm, procs
            time.sleep(0.2)


def summary_line(trials: list[Trial]) -> str:
    n = len(trials)
    return (f"survived={sum(t.survived for t in trials)}/{n} identical={sum(t.identical for t in trials)}/{n} "
            f"shm_leaked={sum(len(t.shm_leaked) for t in trials)} orphans={sum(len(t.orphans) for t in trials)}")


def table(trials: list[Trial]) -> str:
    """identical/trials per job kind (rows) and stage (columns), a Markdown table."""
    kinds = [k for k in JOB_KINDS if any(t.kind == k for t in trials)]
    stages = [s for s in STAGES if any(t.stage == s for t in trials)]
    rows = ["| kind | " + " | ".join(stages) + " | all |", "|---" * (len(stages) + 2) + "|"]
    for kind in kinds + ["all"]:
        cells = []
        for stage in stages + ["all"]:
            ts = [t for t in trials if kind in ("all", t.kind) and stage in ("all", t.stage)]
            cells.append(f"{sum(t.identical for t in ts)}/{len(ts)}")
        rows.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run_trials(pipe: Pipeline, stages: list[str], trials: int, seed: int = 0, log=print,
               after=None, prompt: dict | None = None, kinds=("txt2img",),
               hires_scale: float = HIRES_SCALE) -> tuple[Chaos, list[Trial]]:
    """`trials` per stage and job kind, interleaved (txt2img encoder, txt2img scheduler, …, img2img encoder, …) on one
    pipeline, the kinds' baselines first; one line per trial; `after(chaos, trials so far)` after each (the script
    saves its JSON there, so a cut-short run keeps its trials)."""
    chaos = Chaos(pipe, seed, prompt=prompt, log=log, hires_scale=hires_scale)
    for kind in kinds:
        chaos.baseline(kind)
    out = []
    for i in range(trials):
        for kind in kinds:
            for stage in stages:
                t = chaos.trial(stage, i, kind)
                log(t.line())
                out.append(t)
                if after is not None:
                    after(chaos, out)
    return chaos, out


def write_json(path: Path, chaos: Chaos, trials: list[Trial], stages: list[str], per_stage: int, wall_s: float,
               end_shm: list | None = None) -> None:
    """Every trial so far and the summary line; `complete` once the pipeline has been shut down and checked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({
        "stages": stages, "kinds": list(chaos.bases), "trials_per_stage_and_kind": per_stage, "seed": chaos.seed,
        "prompts": {k: chaos.prompts[k] for k in chaos.bases},
        "baselines": {k: b.public() for k, b in chaos.bases.items()},
        "trials": [{**asdict(t), "survived": t.survived} for t in trials],
        "table": table(trials), "summary": summary_line(trials), "complete": end_shm is not None, "end_shm": end_shm,
        "wall_s": round(wall_s, 1)}, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", required=True, choices=STAGES + ("all",))
    ap.add_argument("--kind", nargs="+", choices=JOB_KINDS + ("all",), default=["txt2img"],
                    help="job kinds (default txt2img)")
    ap.add_argument("--trials", type=int, default=20, help="trials per stage and kind (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="base seed of the kill moments (recorded per trial)")
    ap.add_argument("--json", type=Path, help="write every trial and the summary here")
    ap.add_argument("--cache", type=Path, help="folder for the tiny bundle and pack (default: a temp folder)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--board-encoder", action="store_true",
                    help="the board's ONNX text encoder instead of torch's (quicker stage starts)")
    ap.add_argument("--sampler", default=PROMPT["sampler"],
                    help="the job's sampler (e.g. er_sde: its history and noise position must survive every kill)")
    ap.add_argument("--scheduler", default=PROMPT["scheduler"])
    ap.add_argument("--lora", action="append", default=[], metavar="FILE[:STRENGTH[:CLIP_STRENGTH]]",
                    help="a LoRA every job uses (repeatable; e.g. from `anima-models synth lora`)")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="rank of the LoRA-ready pack (default: the sum of the --lora files' ranks)")
    args = ap.parse_args(argv)
    if args.trials < 1:
        ap.error("--trials must be at least 1")
    try:
        args.loras, args.lora_rank = lora_jobs(args.lora, args.lora_rank)
    except ValueError as e:
        ap.error(str(e))
    stages = list(STAGES) if args.stage == "all" else [args.stage]
    args.kinds = list(JOB_KINDS) if "all" in args.kind else list(dict.fromkeys(args.kind))
    cache = args.cache or Path(tempfile.mkdtemp(prefix="anima-chaos-"))
    try:
        return _run(args, stages, cache)
    finally:
        if args.cache is None:
            shutil.rmtree(cache, ignore_errors=True)


def lora_jobs(specs: list[str], rank: int) -> tuple[list, int]:
    """--lora values -> ([(file, prompt.json's loras entry)], the pack's LoRA rank); ValueError naming the flag."""
    out, need = [], 0
    for spec in specs:
        use = parse_lora_arg(spec)
        path = Path(use.path)
        if not path.is_file():
            raise ValueError(f"--lora {spec!r}: no such file {path}")
        try:
            pairs = LoraFile(path).pairs.values()
        except LoraError as e:
            raise ValueError(f"--lora {spec!r}: {e}") from None
        need += max((p.rank for p in pairs), default=0)
        entry = {"name": path.name, "strength": use.strength}
        if use.clip_strength is not None:
            entry["clip_strength"] = use.clip_strength
        out.append((path, entry))
    if len({e["name"] for _, e in out}) < len(out):
        raise ValueError("--lora: two files with the same name (each is copied to loras/ under its name)")
    if rank < 0 or (out and rank and rank < need):
        raise ValueError(f"--lora-rank {rank}: the --lora files need at least {need} (their ranks summed)")
    return out, (rank or need) if out else 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _run(args, stages: list[str], cache: Path) -> int:
    # SIGTERM (and SIGINT, which a shell ignores for background jobs) end the run cleanly: pipeline shut down,
    # the trials so far summed up
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    models, pack = tiny_assets(cache, PACK_SIZE, lora_rank=args.lora_rank)
    hires = any(k.startswith("hires_") for k in args.kinds)
    packs = (tiny_assets(cache, hires_size(), lora_rank=args.lora_rank)[1],) if hires else ()
    extra = board_stage_toml(models, cache, PACK_SIZE, stages=("encoder",)) if args.board_encoder else ""
    for path, entry in args.loras:
        (models / "loras").mkdir(exist_ok=True)
        shutil.copyfile(path, models / "loras" / entry["name"])
    t0 = time.monotonic()
    so_far: dict = {}

    def save(chaos, done):
        so_far.update(chaos=chaos, trials=list(done))
        if args.json:
            write_json(args.json, chaos, done, stages, args.trials, time.monotonic() - t0)
    interrupted = False
    with Pipeline.start(models, pack, threads=args.threads, packs=packs, extra_toml=extra) as pipe:
        try:
            prompt = {**PROMPT, "sampler": args.sampler, "scheduler": args.scheduler}
            if args.loras:
                prompt["loras"] = [entry for _, entry in args.loras]
            chaos, trials = run_trials(pipe, stages, args.trials, args.seed, after=save, prompt=prompt,
                                       kinds=args.kinds)
        except CliError as e:                       # the undisturbed job refused: nothing to compare with
            print(f"the undisturbed job was refused: {e}", file=sys.stderr, flush=True)
            return 2
        except KeyboardInterrupt:
            if "chaos" not in so_far:
                raise
            interrupted, chaos, trials = True, so_far["chaos"], so_far["trials"]
            print(f"interrupted after {len(trials)} trial(s)", flush=True)
    end_shm = pipe.leftover_segments()          # after supervisord's shutdown: nothing of the run may remain
    line = summary_line(trials)
    print(table(trials), flush=True)
    if args.json:
        write_json(args.json, chaos, trials, stages, args.trials, time.monotonic() - t0, end_shm)
    print(line, flush=True)
    ok = not end_shm and all(t.survived and t.identical and not t.shm_leaked and not t.orphans for t in trials)
    return 0 if ok and not interrupted else 1


if __name__ == "__main__":
    sys.exit(main())
