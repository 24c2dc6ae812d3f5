"""Fuzz the protocol decoder: >= 100k mutated frames per message kind; prints counts per kind and the rate. With
`--live`, the same mutations also go as requests to the real processes (a tiny pipeline under supervisord,
bench/fuzz_live.py): the VAE's DECODE, the daemon's SUBMIT (and the prompt JSON inside it) and STATUS; each must be
answered by the same process, none may hang, and a valid request after every 200 frames and at the end must work.

    .venv/bin/python bench/fuzz_protocol.py                     # 100000 frames per kind, every kind
    .venv/bin/python bench/fuzz_protocol.py --frames 2000 --kinds BRANCH DENOISE --jobs 2 --json out.json
    .venv/bin/python bench/fuzz_protocol.py --kinds --live SUBMIT STATUS DECODE --live-frames 100000 --json out.json

Exit status 1 when any frame crashed the decoder (anything but a ProtocolError or a valid, round-tripping message)
or a live target crashed, hung or stopped serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # bench.*, tests.* when run as a script

from protocol import messages as m  # noqa: E402
from tests.fuzzing import FuzzCounts, fuzz_kind  # noqa: E402


def _run(args: tuple[str, int, int]) -> tuple[str, FuzzCounts, float]:
    kind, frames, seed = args
    t0 = time.perf_counter()
    counts = fuzz_kind(kind, frames, seed)
    return kind, counts, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100_000, help="frames per kind (default 100000)")
    parser.add_argument("--kinds", nargs="*", default=sorted(m.KINDS), choices=sorted(m.KINDS), metavar="KIND",
                        help="decoder kinds (default: every kind; none with a bare --kinds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--json", help="write the counts here too")
    parser.add_argument("--live", nargs="*", default=[], choices=LIVE_KINDS, metavar="KIND",
                        help=f"also fuzz the real processes: {', '.join(LIVE_KINDS)}")
    parser.add_argument("--live-frames", type=int, help="requests per live kind (default: --frames)")
    parser.add_argument("--keep", action="store_true", help="keep the live pipeline's run folder (logs)")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    work = [(kind, args.frames, args.seed) for kind in args.kinds]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_run, work))
    else:
        results = [_run(w) for w in work]
    wall = time.perf_counter() - t0

    if results:
        print(f"{'kind':<12} {'frames':>8} {'valid':>7} {'rejected':>9} {'crashes':>8} {'frames/s':>9}")
    total = FuzzCounts()
    for kind, c, secs in results:
        print(f"{kind:<12} {c.frames:>8} {c.valid:>7} {c.rejected:>9} {c.crashes:>8} {c.frames / secs:>9.0f}")
        total.frames += c.frames
        total.valid += c.valid
        total.rejected += c.rejected
        total.crashes += c.crashes
        if c.first_crash:
            print(f"first crash for {kind}:\n{c.first_crash}", file=sys.stderr)
    if results:
        print(f"total frames={total.frames} valid={total.valid} rejected={total.rejected} crashes={total.crashes} "
              f"wall_s={wall:.1f} rate={total.frames / wall:.0f}/s")
    out = {"wall_s": wall, "kinds": {k: dataclasses.asdict(c) for k, c, _ in results}, "live": {}}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    save()
    live_ok = True
    if args.live:
        for kind, counts in run_live(args.live, args.live_frames or args.frames, args.seed, args.keep):
            print(counts.line(kind), flush=True)
            for text in counts.problems:
                print(f"{kind}: {text}", file=sys.stderr)
            live_ok &= counts.ok
            out["live"][kind] = dataclasses.asdict(counts)
            save()
    return 1 if total.crashes or not live_ok else 0


LIVE_KINDS = ("DECODE", "SUBMIT", "STATUS")


def run_live(kinds: list[str], frames: int, seed: int, keep: bool):
    """(kind, LiveCounts) per live kind, in the order DECODE, SUBMIT, STATUS, on one tiny pipeline."""
    import shutil
    import tempfile
    from pathlib import Path

    import zmq

    from bench.fuzz_live import FUZZ_TOML, live_targets, settle_jobs
    from tests.fuzzing import fuzz_live
    from tests.pipeline_harness import Pipeline, tiny_assets
    # a `kill` (SIGTERM) unwinds like an exception: the pipeline is shut down and the fuzz arena unlinked (killed
    # mid-run without this, earlier runs left /dev/shm/anima_*_fuzz-live behind)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    cache = Path(tempfile.mkdtemp(prefix="anima-fuzz-assets-"))
    ctx = zmq.Context()
    try:
        models, pack = tiny_assets(cache)
        with Pipeline.start(models, pack, threads=1, extra_toml=FUZZ_TOML, keep=keep) as pipe:
            if keep:
                print(f"live pipeline run folder: {pipe.root}", flush=True)
            with live_targets(pipe) as targets:
                for kind in (k for k in LIVE_KINDS if k in kinds):
                    def progress(c, kind=kind):
                        if c.frames % 10_000 < 200:
                            print(f"  {c.line(kind)}", flush=True)
                    yield kind, fuzz_live(ctx, targets[kind], frames, seed, on_progress=progress)
                settle_jobs(pipe)
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
