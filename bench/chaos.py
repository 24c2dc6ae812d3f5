"""Chaos trials: SIGKILL one stage at a random moment of a tiny job; the job must finish, bitwise as undisturbed, clean.

    .venv/bin/python bench/chaos.py --stage scheduler --trials 20 --json bench/out/chaos_scheduler.json
    .venv/bin/python bench/chaos.py --stage all --trials 20 --seed 7       # 20 per stage, one supervisord session
    .venv/bin/anima-models synth lora --preset tiny --seed 1 --rank 4 --groups blocks,host,adapter,te --out style.safetensors
    .venv/bin/python bench/chaos.py --stage all --trials 2 --sampler euler_ancestral --lora style.safetensors:0.8:1.2

One real pipeline (tests/pipeline_harness.py: supervisord, the five real programs, the embedded tiny bundle, a 128x128
FP16 pack) serves every trial. The first job runs undisturbed: its final latent is the reference and its phase times
place the kills. Each trial submits the same job and SIGKILLs the chosen program at a moment drawn from a seeded RNG
(recorded per trial): encoder / VAE a random fraction into their lifetime, scheduler / executor at a random branch
call of the denoise, orchestrator a random fraction into the whole job. Then: the job is `done` (supervisord restarted
the program; the orchestrator retried or resumed), `latent.npy` is bitwise the reference, no /dev/shm segment of the run
is left, and no process of the run lives outside supervisord's programs nor as a child of one. A draw that comes too
late (the stage already gone) is drawn again over a shorter span, so every counted trial killed something.
`--sampler` a stochastic one (euler_ancestral, dpmpp_2m_sde, er_sde): its noise must resume bitwise from the job's
sampler state. `--lora FILE[:STRENGTH[:CLIP_STRENGTH]]` (repeatable): the file is copied into the models folder's
loras/, the pack is built LoRA-ready (`--lora-rank`, default the sum of the files' ranks) and every job names it. The last
line printed is `survived=<k>/<n> identical=<k>/<n> shm_leaked=<count> orphans=<count>`.
"""
from __future__ import annotations

import argparse
import json
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

from models.dit.partition import KINDS, branch_index  # noqa: E402
from models.lora.file import LoraError, LoraFile  # noqa: E402
from models.lora.plan import parse_lora_arg  # noqa: E402
from orchestrator.cli import CliError  # noqa: E402
from tests.pipeline_harness import Pipeline, tiny_assets  # noqa: E402

STAGES = ("encoder", "scheduler", "executor", "vae", "orchestrator")
# 4 steps, Spectrum warm-up 1: computed [1, 2, 4], forecast [3] (a resumed scheduler must restore Spectrum history)
PROMPT = {"prompt": "1girl, chaos, (red eyes:1.2)", "negative_prompt": "lowres", "seed": 4242, "steps": 4,
          "cfg": 4.0, "sampler": "euler", "scheduler": "sgm_uniform", "spectrum": {"warmup": 1}}
JOB_TIMEOUT_S = 900.0
POLL_S = 0.02
SETTLE_S = 15.0              # after a job: how long leftovers may take to go (arena close, supervisord reaping)
MAX_REDRAWS = 3              # a kill moment that came too late is drawn again this often
LIFE_FRACTION = 0.8          # encoder/VAE/orchestrator kills land in the first 80 % of the measured span


@dataclass
class Baseline:
    """The undisturbed job: reference latent and where the time goes (seconds, measured by polling)."""
    job: str
    latent: np.ndarray
    computed: list
    blocks: int
    encoder_life_s: float        # encoder pid seen .. job leaves `encoding`
    vae_life_s: float            # VAE pid seen .. job leaves `decoding`
    job_s: float                 # submit .. done

    def public(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "latent"}
        d["latent_shape"] = list(self.latent.shape)
        return d


@dataclass
class Trial:
    stage: str
    index: int
    seed: int                    # the trial's RNG seed (base seed, stage, index)
    moment: dict = field(default_factory=dict)   # the draw and where the kill landed
    job: str = ""
    killed_pid: int = 0
    redraws: int = 0
    state: str = ""
    error: str = ""
    identical: bool = False
    shm_leaked: list = field(default_factory=list)
    orphans: list = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def survived(self) -> bool:
        return self.state == "done"

    def line(self) -> str:
        where = " ".join(f"{k}={v}" for k, v in self.moment.items())
        err = f" error={self.error[:300]!r}" if self.error else ""
        return (f"[{self.stage} #{self.index}] seed={self.seed} {where} pid={self.killed_pid} redraws={self.redraws} "
                f"-> {self.state} identical={self.identical} shm={len(self.shm_leaked)} orphans={len(self.orphans)} "
                f"{self.wall_s:.1f}s{err}")


class TooLate(Exception):
    """The drawn moment passed before it could be hit (the stage already gone): draw again."""


def _progress_pos(info, blocks: int, computed: list) -> int | None:
    """A job's progress as an index into the denoise's branch calls (computed steps only), or None before any.
    A forecast step counts as the end of the computed steps before it."""
    p = info.progress if info is not None else None
    if p is None:
        return None
    if p.step in computed:
        return computed.index(p.step) * blocks * len(KINDS) + branch_index(p.block, p.branch)
    return sum(s < p.step for s in computed) * blocks * len(KINDS) - 1


class Chaos:
    """Trials on one pipeline: `baseline()` once, then `trial(stage, index)` as often as wanted."""

    def __init__(self, pipe: Pipeline, seed: int = 0, prompt: dict | None = None, log=print):
        self.pipe, self.seed, self.prompt, self.log = pipe, seed, dict(prompt or PROMPT), log
        self.base: Baseline | None = None
        self.life: dict[str, float] = {}         # span the encoder/VAE/orchestrator draws spread over (shrinks
                                                 # when a draw came too late)

    # ------------------------------------------------------------ the undisturbed run

    def baseline(self) -> Baseline:
        p, t0 = self.pipe, time.monotonic()
        job = p.submit(self.prompt)
        seen: dict[str, float] = {}
        enc_pid_at = vae_pid_at = None
        while True:
            info = p.status(job)
            now = time.monotonic() - t0
            if info is not None:
                seen.setdefault(info.state, now)
                if info.state in ("done", "failed", "cancelled"):
                    break
            if enc_pid_at is None and p.sup.info("encoder").pid:
                enc_pid_at = now
            if vae_pid_at is None and p.sup.info("vae").pid:
                vae_pid_at = now
            if now > JOB_TIMEOUT_S:
                raise AssertionError(f"the undisturbed job {job} did not finish in {JOB_TIMEOUT_S:.0f} s\n{p.logs()}")
            time.sleep(POLL_S)
        if info.state != "done":
            raise AssertionError(f"the undisturbed job failed: {info.error_stage}: {info.error}\n{p.logs()}")
        report = p.report(job)
        self.base = Baseline(
            job=job, latent=np.load(p.job_dir(job) / "latent.npy"), computed=list(report["computed_steps"]),
            blocks=report["branch_calls"] // (3 * len(report["computed_steps"])),
            encoder_life_s=seen.get("denoising", now) - (enc_pid_at or seen.get("encoding", 0.0)),
            vae_life_s=seen.get("done", now) - (vae_pid_at or seen.get("decoding", now)),
            job_s=seen["done"])
        self.log(f"baseline {job}: {self.base.job_s:.1f} s (encoder up {self.base.encoder_life_s:.1f} s, "
                 f"VAE up {self.base.vae_life_s:.1f} s), computed {self.base.computed}, {self.base.blocks} blocks")
        return self.base

    # ------------------------------------------------------------ one trial

    def trial(self, stage: str, index: int) -> Trial:
        if stage not in STAGES:
            raise ValueError(f"stage {stage!r}: choose one of {', '.join(STAGES)}")
        if self.base is None:
            self.baseline()
        seed = self.seed * 1_000_003 + STAGES.index(stage) * 10_007 + index
        rng = random.Random(seed)
        t = Trial(stage=stage, index=index, seed=seed)
        t0 = time.monotonic()
        info = None
        for attempt in range(MAX_REDRAWS + 1):
            t.redraws = attempt
            self._quiet()
            try:
                t.job = self.pipe.submit(self.prompt)
            except CliError as e:                   # refused: a failed trial, and the next one is still tried
                t.state, t.error, t.wall_s = "refused", str(e), time.monotonic() - t0
                return t
            try:
                t.moment, t.killed_pid = self._kill(stage, t.job, rng)
            except TooLate as e:
                self.log(f"[{stage} #{index}] too late ({e}); drawing again")
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
        latent = self.pipe.job_dir(t.job) / "latent.npy"
        t.identical = info.state == "done" and latent.exists() and np.array_equal(np.load(latent), self.base.latent)
        t.shm_leaked, t.orphans = self._leftovers()
        t.wall_s = time.monotonic() - t0
        return t

    def _quiet(self) -> None:
        """Between jobs: encoder and VAE stopped, every program that should run is RUNNING."""
        for name in ("scheduler", "executor", "orchestrator"):
            self.pipe.wait_program(name, ("RUNNING",))
        for name in ("encoder", "vae"):
            self.pipe.wait_program(name, ("STOPPED", "EXITED", "FATAL"))

    def _kill(self, stage: str, job: str, rng: random.Random) -> tuple[dict, int]:
        """Wait for the drawn moment of `job` and SIGKILL `stage` there; -> (the moment, the pid killed)."""
        p, b, u = self.pipe, self.base, rng.random()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        if stage in ("encoder", "vae"):
            phase = "encoding" if stage == "encoder" else "decoding"
            life = self.life.setdefault(stage, b.encoder_life_s if stage == "encoder" else b.vae_life_s)
            delay = u * LIFE_FRACTION * life
            pid = 0
            while not pid:                           # the process exists (supervisord started it for this job)
                info = p.status(job)
                if info is not None and info.state in ("done", "failed", "cancelled"):
                    raise TooLate(f"job {info.state} before {stage} started")
                pid = p.sup.info(stage).pid
                self._deadline(deadline, job)
                time.sleep(POLL_S)
            time.sleep(delay)
            info = p.status(job)
            if p.sup.info(stage).pid != pid or (info is not None and info.state != phase):
                self.life[stage] = delay / LIFE_FRACTION * 0.9      # the machine got faster: draw within less
                raise TooLate(f"{stage} gone after {delay:.2f} s")
            p.kill(stage)
            return {"u": round(u, 4), "delay_s": round(delay, 3), "state": phase}, pid
        if stage == "orchestrator":
            delay = u * LIFE_FRACTION * self.life.setdefault(stage, b.job_s)
            time.sleep(delay)
            info = p.status(job)
            if info is None or info.state in ("done", "failed", "cancelled"):
                self.life[stage] = delay / LIFE_FRACTION * 0.9
                raise TooLate(f"job {getattr(info, 'state', '?')} after {delay:.2f} s")
            pos = _progress_pos(info, b.blocks, b.computed)
            pid = p.kill("orchestrator")
            return {"u": round(u, 4), "delay_s": round(delay, 3), "state": info.state, "call": pos}, pid
        # scheduler / executor: a random branch call of the denoise
        total = len(b.computed) * b.blocks * len(KINDS)
        target = min(total - 1, int(u * total))
        while True:
            info = p.status(job)
            if info is not None and info.state in ("decoding", "done", "failed", "cancelled"):
                raise TooLate(f"denoise over before call {target}")
            pos = _progress_pos(info, b.blocks, b.computed) if info is not None and info.state == "denoising" \
                else None
            if pos is not None and pos >= target:
                break
            self._deadline(deadline, job)
            time.sleep(POLL_S)
        pid = p.kill(stage)
        step = b.computed[target // (len(KINDS) * b.blocks)]
        block, kind = (target // len(KINDS)) % b.blocks, KINDS[target % len(KINDS)]
        return {"u": round(u, 4), "target": f"step{step}/b{block}/{kind}", "call": pos}, pid

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


def run_trials(pipe: Pipeline, stages: list[str], trials: int, seed: int = 0, log=print,
               after=None, prompt: dict | None = None) -> tuple[Chaos, list[Trial]]:
    """`trials` per stage, interleaved (encoder, scheduler, …, encoder, …) on one pipeline; one line per trial;
    `after(chaos, trials so far)` after each (the script saves its JSON there, so a cut-short run keeps its trials)."""
    chaos = Chaos(pipe, seed, prompt=prompt, log=log)
    chaos.baseline()
    out = []
    for i in range(trials):
        for stage in stages:
            t = chaos.trial(stage, i)
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
        "stages": stages, "trials_per_stage": per_stage, "seed": chaos.seed, "prompt": chaos.prompt,
        "baseline": chaos.base.public(), "trials": [{**asdict(t), "survived": t.survived} for t in trials],
        "summary": summary_line(trials), "complete": end_shm is not None, "end_shm": end_shm,
        "wall_s": round(wall_s, 1)}, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", required=True, choices=STAGES + ("all",))
    ap.add_argument("--trials", type=int, default=20, help="trials per stage (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="base seed of the kill moments (recorded per trial)")
    ap.add_argument("--json", type=Path, help="write every trial and the summary here")
    ap.add_argument("--cache", type=Path, help="folder for the tiny bundle and pack (default: a temp folder)")
    ap.add_argument("--threads", type=int, default=1)
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
    models, pack = tiny_assets(cache, lora_rank=args.lora_rank)
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
    with Pipeline.start(models, pack, threads=args.threads) as pipe:
        try:
            prompt = {**PROMPT, "sampler": args.sampler, "scheduler": args.scheduler}
            if args.loras:
                prompt["loras"] = [entry for _, entry in args.loras]
            chaos, trials = run_trials(pipe, stages, args.trials, args.seed, after=save, prompt=prompt)
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
    if args.json:
        write_json(args.json, chaos, trials, stages, args.trials, time.monotonic() - t0, end_shm)
    print(line, flush=True)
    ok = not end_shm and all(t.survived and t.identical and not t.shm_leaked and not t.orphans for t in trials)
    return 0 if ok and not interrupted else 1


if __name__ == "__main__":
    sys.exit(main())
