"""Fuzz the protocol decoder: >= 100k mutated frames per message kind; prints counts per kind and the rate.

    .venv/bin/python bench/fuzz_protocol.py                     # 100000 frames per kind, every kind
    .venv/bin/python bench/fuzz_protocol.py --frames 2000 --kinds BRANCH DENOISE --jobs 2 --json out.json

Exit status 1 when any frame crashed the decoder (anything but a ProtocolError or a valid, round-tripping message).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from protocol import messages as m
from protocol.fuzzing import FuzzCounts, fuzz_kind


def _run(args: tuple[str, int, int]) -> tuple[str, FuzzCounts, float]:
    kind, frames, seed = args
    t0 = time.perf_counter()
    counts = fuzz_kind(kind, frames, seed)
    return kind, counts, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100_000, help="frames per kind (default 100000)")
    parser.add_argument("--kinds", nargs="*", default=sorted(m.KINDS), choices=sorted(m.KINDS), metavar="KIND")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--json", help="write the counts here too")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    work = [(kind, args.frames, args.seed) for kind in args.kinds]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_run, work))
    else:
        results = [_run(w) for w in work]
    wall = time.perf_counter() - t0

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
    print(f"total frames={total.frames} valid={total.valid} rejected={total.rejected} crashes={total.crashes} "
          f"wall_s={wall:.1f} rate={total.frames / wall:.0f}/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_s": wall, "kinds": {k: dataclasses.asdict(c) for k, c, _ in results}}, f, indent=1)
    return 1 if total.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
