"""bench/fuzz_http.py's run: the kinds' next distinct cases in turn (bench/fuzz_cases.py), `workers` requests in
flight (bench/fuzz_send.py), the pipeline looked at every CHECK_EVERY_S (a probe, the programs' pids and peak
memory), the state saved after every look, and the report: the outcomes per kind, the peaks, one line per kind
`KIND cases=N/100000 ... 5xx=0 tracebacks=0 hangs=0 over_memory=0`, and the run's rate with the load average.

    run = fuzz(pipe, url, state, makers, n, timeout_s, secrets, workers=4, save=lambda: state.save(path))
    ok = report(state, run, path)
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

import requests

from bench.fuzz_cases import FAILURES, Cases, FuzzState
from bench.fuzz_send import FUZZ_ENCODER, Answer, Sender

PROGRAMS = ("orchestrator", "scheduler", "executor", "http")     # always on: a pid change is a death
CHECK_EVERY_S = 15.0                                             # a probe, the pids and peak memory this often
WORKERS = 4                                                      # requests in flight
MAX_RSS_MB = 1000                                                # a program's peak RSS above this fails the run


def _pids(pipe) -> dict:
    return {name: (info.state, info.pid) for name in PROGRAMS for info in (pipe.sup.info(name),)}


def _vm_hwm_mb(pipe) -> dict:
    """Each program's peak resident memory so far (/proc/PID/status VmHWM, MB)."""
    out = {}
    for name in PROGRAMS:
        try:
            text = Path(f"/proc/{pipe.sup.info(name).pid}/status").read_text()
        except OSError:
            continue
        out[name] = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("VmHWM:")), 0) // 1024
    return out


class Watch:
    """The pipeline looked at every CHECK_EVERY_S (not per case): a probe (`GET /system_stats` must answer 200), the
    programs' pids against the start (a change is a death), their peak memory against the bound. A program whose
    peak first passes the bound counts over_memory for every kind sent since the last look."""

    def __init__(self, pipe, url: str, timeout_s: float, state: FuzzState, max_rss_mb: int):
        self.pipe, self.url, self.timeout_s, self.state, self.max_rss_mb = pipe, url, timeout_s, state, max_rss_mb
        self.pids, self.over = _pids(pipe), set()
        self.start_rss_mb = self.peak_rss_mb = _vm_hwm_mb(pipe)
        self.kinds: set = set()                  # kinds sent since the last look
        self.last = time.monotonic()
        self.probes = 0

    def due(self) -> bool:
        return time.monotonic() - self.last >= CHECK_EVERY_S

    def look(self) -> None:
        self.last, self.probes = time.monotonic(), self.probes + 1
        try:
            ok = requests.get(self.url + "system_stats", timeout=self.timeout_s).status_code == 200
        except requests.RequestException:
            ok = False
        if not ok:
            self.state.fail("pipeline", "probe", None, "GET /system_stats did not answer 200")
        now = _pids(self.pipe)
        for name in PROGRAMS:
            if now[name] != self.pids[name]:
                self.state.fail("pipeline", "death", None, f"{name}: {self.pids[name]} -> {now[name]}")
        self.pids = now
        self.peak_rss_mb = _vm_hwm_mb(self.pipe)
        self.state.peaks(self.peak_rss_mb)
        for name, mb in self.peak_rss_mb.items():
            if mb > self.max_rss_mb and name not in self.over:
                self.over.add(name)
                for kind in sorted(self.kinds) or ["pipeline"]:
                    self.state.fail(kind, "over_memory", None, f"{name} peak {mb} MB > {self.max_rss_mb} MB")
        self.kinds = set()


def _take(state: FuzzState, watch: Watch, a: Answer, jobs: dict) -> None:
    state.add(a.kind, a.index, a.outcome, a.busy_s, a.busy)
    for what, detail in a.failures:
        state.fail(a.kind, what, a.index, detail)
    watch.kinds.add(a.kind)
    if a.job:
        jobs[a.job] = (a.kind, a.index)


def _end(rec: dict) -> str | None:
    """A job record's clean end (what check_ends counts), or None."""
    err = rec.get("error") or {}
    message = str(err.get("message", ""))
    if rec.get("state") == "cancelled":
        return "cancelled"
    if rec.get("state") != "failed":
        return None
    if err.get("stage") == "encoder" and FUZZ_ENCODER in message:
        return "failed at the encoder"
    if err.get("stage") == "orchestrator" and message.startswith("prompt.json field '"):
        return "failed naming a field"        # checked again at its start (a LoRA file changed since submit)
    return None


def check_ends(jobs_dir: Path, jobs: dict, state: FuzzState) -> Counter:
    """Every job an answer queued ({job: (kind, index)}), once the queue is settled, read from its job.json: a clean
    end is `failed` at the encoder naming the fuzz's missing text encoder (FUZZ_ENCODER: no job gets further),
    `failed` naming a field, or `cancelled`; any other (a job the daemon failed itself, a missing record) is the
    case's `bad_ends` failure. -> the ends counted ({"failed at the encoder": n, ...})."""
    ends: Counter = Counter()
    for job, (kind, index) in jobs.items():
        try:
            rec = json.loads((jobs_dir / job / "job.json").read_text())
            end, why = _end(rec), f"job {job} ended {rec.get('state')}: {json.dumps(rec.get('error'))[:400]}"
        except (OSError, ValueError, AttributeError) as e:
            end, why = None, f"job {job}: no readable job.json ({e})"
        ends[end or "other"] += 1
        if end is None:
            state.fail(kind, "bad_ends", index, why)
    return ends


def fuzz(pipe, url: str, state: FuzzState, makers: dict, n: int, timeout_s: float, secrets: tuple,
         workers: int = WORKERS, max_s: float | None = None, max_rss_mb: int = MAX_RSS_MB,
         save=lambda: None, jobs: dict | None = None) -> dict:
    """Up to `n` distinct cases (fewer when `max_s` passes, or every kind has its state.target), `workers` requests
    in flight; -> this run's record (also appended to state.runs). `save()` after every look; `jobs` gets the jobs
    the answers queued ({job: (kind, index)}, for check_ends). Each kind has its own
    lanes (workers / open kinds, at least one): a slow kind (an A1111 call waiting for its job, ~17 s) never holds
    every worker, so the fast kinds' counts grow at their own pace; a free lane takes the kind with fewest cases."""
    cases, sender = Cases(makers, state), Sender(url, timeout_s, workers, secrets)
    jobs = {} if jobs is None else jobs
    watch = Watch(pipe, url, timeout_s, state, max_rss_mb)
    run = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "workers": workers,
           "load_start": [round(x, 1) for x in os.getloadavg()], "cases": 0, "interrupted": False}
    state.runs.append(run)
    t0, sent, flying = time.monotonic(), 0, {}          # flying: future -> kind
    try:
        while True:
            open_kinds = [k for k in makers if cases.open(k)]
            stop = sent >= n or not open_kinds or (max_s is not None and time.monotonic() - t0 > max_s)
            lanes = -(-workers // max(len(open_kinds), 1))
            while not stop and len(flying) < workers:
                busy = Counter(flying.values())
                free = [k for k in open_kinds if busy[k] < lanes]
                if not free:
                    break
                kind = min(free, key=lambda k: state.kind(k)["cases"] + busy[k])
                nxt = cases.next_case(kind)
                if nxt is None:                  # exhausted: its distinct cases are all sent
                    open_kinds.remove(kind)
                    continue
                flying[sender.send(kind, nxt[0], *nxt[1])] = kind
                sent += 1
                stop = sent >= n
            if not flying:
                break
            done, _ = wait(flying, timeout=1.0, return_when=FIRST_COMPLETED)
            for f in done:
                del flying[f]
                _take(state, watch, f.result(), jobs)
                run["cases"] += 1
            if watch.due():
                _progress(state, watch, run, t0, save)
    except KeyboardInterrupt:                    # SIGINT/SIGTERM: what is in flight is answered, then reported
        run["interrupted"] = True
        print(f"interrupted after {run['cases']} cases; waiting for {len(flying)} in flight", flush=True)
        for f in flying:
            _take(state, watch, f.result(), jobs)
            run["cases"] += 1
    sender.close()
    _progress(state, watch, run, t0, save)
    return run


def _progress(state: FuzzState, watch: Watch, run: dict, t0: float, save) -> None:
    watch.look()
    run["wall_s"] = round(time.monotonic() - t0, 1)
    run["per_s"] = round(run["cases"] / max(run["wall_s"], 1e-9), 2)
    run["load_end"] = [round(x, 1) for x in os.getloadavg()]
    run["peak_rss_mb"], run["start_rss_mb"], run["probes"] = watch.peak_rss_mb, watch.start_rss_mb, watch.probes
    save()
    print(f"  {run['cases']} cases, {run['wall_s']:.0f} s, {run['per_s']}/s, load {run['load_end'][0]}, "
          f"failures {len(state.open_failures())}", flush=True)


def report(state: FuzzState, run: dict, out: Path, max_rss_mb: int = MAX_RSS_MB, ends: Counter | None = None) -> bool:
    """The outcome table per kind (all runs), the programs' peaks, one `cases=N/target` line per kind, the run."""
    outcomes = sorted({o for k in state.kinds.values() for o in k["outcomes"]})
    print(f"{'kind':<22}" + "".join(f"{o:>8}" for o in outcomes) + f"{'cases':>8}{'ms/case':>9}{'503_RA':>8}")
    for kind, k in sorted(state.kinds.items()):
        print(f"{kind:<22}" + "".join(f"{k['outcomes'].get(o, 0):>8}" for o in outcomes) + f"{k['cases']:>8}"
              f"{1000 * k['busy_s'] / max(k['cases'], 1):>9.0f}{k['retried_503']:>8}")
    print("peak RSS MB (measured, VmHWM; this run's start -> end, all runs' peak): " + ", ".join(
        f"{p} {run['start_rss_mb'].get(p, '?')} -> {mb} ({state.peak_rss_mb.get(p, mb)})"
        for p, mb in sorted(run["peak_rss_mb"].items())) + f"; bound {max_rss_mb}")
    for line in state.summary():
        print(line)
    if ends is not None:
        print("accepted jobs' ends (job.json, after the queue settled): " +
              (", ".join(f"{what} {n}" for what, n in sorted(ends.items())) or "none"))
    others = [f for f in state.open_failures() if f["what"] not in FAILURES]
    print(f"run: cases={run['cases']} wall_s={run['wall_s']:.0f} per_s={run['per_s']} workers={run['workers']} "
          f"load {run['load_start']} -> {run['load_end']} probes={run['probes']} deaths+probe_failures={len(others)}"
          f" runs={len(state.runs)} {'ok' if state.ok() else 'FAILED'}")
    print(f"state: {out}")
    return state.ok() and not run["interrupted"]
