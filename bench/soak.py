"""Soak: tiny jobs back to back on one pipeline; RSS of every stage, file descriptors and /dev/shm segments stay flat.

    .venv/bin/python bench/soak.py --jobs 50 --json bench/out/soak.json
    .venv/bin/python bench/soak.py --jobs 5 --warmup 2                  # the CI size (tests/test_soak.py)

One real pipeline (tests/pipeline_harness.py). After each job, with the encoder and VAE stopped again: RSS and open
file descriptors of the always-on programs (scheduler, executor, orchestrator; psutil on supervisord's pids, which must
not change: a restart would hide a leak), the peak RSS the report gives for the per-job encoder and VAE, and this run's
/dev/shm segments. Drift = (highest - first after warm-up) / first after warm-up, per stage: growth, as a leak
shows (a shrink counts 0). Last line:
`jobs=<n> rss_drift_max=<pct>% (<stage>) fds=<flat|grew> shm=<count> ok=<bool>`.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.pipeline_harness import Pipeline, tiny_assets  # noqa: E402

ALWAYS_ON = ("scheduler", "executor", "orchestrator")
PER_JOB = ("encoder", "vae")
PROMPT = {"prompt": "1girl, soak", "negative_prompt": "lowres", "steps": 2, "cfg": 4.0}
MAX_DRIFT = 0.05             # RSS may move less than 5 % after the warm-up
FD_SLACK = 0                 # open descriptors of an always-on stage after warm-up: no growth at all
JOB_TIMEOUT_S = 900.0


@dataclass
class Sample:
    job: str
    wall_s: float
    rss_mb: dict = field(default_factory=dict)     # stage -> MB (always-on: now; encoder/VAE: the job's peak)
    fds: dict = field(default_factory=dict)        # always-on stage -> open descriptors
    pids: dict = field(default_factory=dict)
    shm: int = 0                                   # this run's /dev/shm segments after the job


@dataclass
class SoakResult:
    samples: list
    warmup: int
    drift: dict                                    # stage -> growth fraction after the warm-up
    fd_growth: dict                                # always-on stage -> descriptors gained after warm-up
    pid_changes: list                              # always-on stages whose process changed
    shm_max: int
    failed: list

    @property
    def ok(self) -> bool:
        return (not self.failed and not self.pid_changes and self.shm_max == 0
                and all(abs(d) < MAX_DRIFT for d in self.drift.values())
                and all(g <= FD_SLACK for g in self.fd_growth.values()))

    def line(self) -> str:
        if not self.drift:
            return f"jobs={len(self.samples)} rss_drift_max=n/a fds=n/a shm={self.shm_max} ok=False"
        worst = max(self.drift, key=lambda s: abs(self.drift[s]))
        fds = "flat" if all(g <= FD_SLACK for g in self.fd_growth.values()) else "grew"
        return (f"jobs={len(self.samples)} rss_drift_max={100 * self.drift[worst]:+.2f}% ({worst}) fds={fds} "
                f"shm={self.shm_max} ok={self.ok}")


def _wait_quiet(pipe: Pipeline) -> None:
    for name in PER_JOB:
        pipe.wait_program(name, ("STOPPED", "EXITED", "FATAL"))


def sample_after(pipe: Pipeline, job: str, wall_s: float) -> Sample:
    s = Sample(job=job, wall_s=wall_s)
    for name in ALWAYS_ON:
        pid = pipe.pid(name)
        proc = psutil.Process(pid)
        s.pids[name], s.rss_mb[name], s.fds[name] = pid, proc.memory_info().rss / 2**20, proc.num_fds()
    stages = pipe.report(job)["stages"]
    for name in PER_JOB:
        s.rss_mb[name] = float(stages[name]["peak_rss_mb"])
    s.shm = len(pipe.leftover_segments())
    return s


def soak(pipe: Pipeline, jobs: int, warmup: int = 2, prompt: dict | None = None, log=print) -> SoakResult:
    """Run `jobs` jobs one after another (seed = index) and measure after each; the first `warmup` are not judged."""
    if jobs <= warmup:
        raise ValueError(f"need more jobs ({jobs}) than warm-up jobs ({warmup})")
    samples, failed = [], []
    try:
        _run_jobs(pipe, jobs, prompt, samples, failed, log)
    except KeyboardInterrupt:            # a cut-short soak is judged on the jobs it finished
        log(f"interrupted after {len(samples)} job(s)")
        failed.append(f"interrupted after {len(samples)} of {jobs} jobs")
    return judge(samples, failed, warmup)


def _run_jobs(pipe: Pipeline, jobs: int, prompt: dict | None, samples: list, failed: list, log) -> None:
    for i in range(jobs):
        t0 = time.monotonic()
        job = pipe.submit({**(prompt or PROMPT), "seed": i})
        info = pipe.wait(job, timeout_s=JOB_TIMEOUT_S)
        if info.state != "done":
            failed.append(f"{job}: {info.state} {info.error_stage}: {info.error}")
            log(f"job {i + 1}/{jobs} {job} {info.state}: {info.error_stage}: {info.error}")
            continue
        _wait_quiet(pipe)
        s = sample_after(pipe, job, time.monotonic() - t0)
        samples.append(s)
        log(f"job {i + 1}/{jobs} {job} {s.wall_s:.1f}s rss " + " ".join(f"{k}={v:.1f}" for k, v in s.rss_mb.items())
            + " fds " + " ".join(f"{k}={v}" for k, v in s.fds.items()) + f" shm={s.shm}")


def judge(samples: list, failed: list, warmup: int) -> SoakResult:
    """Growth per stage after the warm-up, fd growth, pid changes and segments of the measured jobs."""
    if len(samples) <= warmup:
        return SoakResult(samples, warmup, {}, {}, [], max((x.shm for x in samples), default=0),
                          failed + [f"only {len(samples)} job(s) finished; nothing past the warm-up to judge"])
    judged = samples[warmup:]
    first = judged[0]
    # growth is what a leak does: the highest RSS after the warm-up against the first (a shrink, e.g. file-backed
    # pages the kernel took back on a busy machine, is no leak and shows as 0)
    drift = {k: (max(s.rss_mb[k] for s in judged) - first.rss_mb[k]) / first.rss_mb[k] for k in first.rss_mb}
    fd_growth = {k: max(s.fds[k] for s in judged) - first.fds[k] for k in ALWAYS_ON}
    pid_changes = [k for k in ALWAYS_ON if len({s.pids[k] for s in samples}) > 1]
    return SoakResult(samples=samples, warmup=warmup, drift=drift, fd_growth=fd_growth, pid_changes=pid_changes,
                      shm_max=max((s.shm for s in samples), default=0), failed=failed)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3, help="jobs not judged at the start (default 3)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cache", type=Path, help="folder for the tiny bundle and pack (default: a temp folder)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)       # SIGINT too: a shell ignores it for background jobs
    signal.signal(signal.SIGINT, _interrupt)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="anima-soak-"))
    models, pack = tiny_assets(cache)
    t0 = time.monotonic()
    with Pipeline.start(models, pack, threads=1) as pipe:
        result = soak(pipe, args.jobs, args.warmup)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**asdict(result), "ok": result.ok, "summary": result.line(),
                                         "wall_s": round(time.monotonic() - t0, 1)}, indent=1))
    print(result.line(), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
