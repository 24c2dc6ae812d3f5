"""Process memory figures for reports: RSS, PSS and swap from /proc/self/smaps_rollup (Linux), peak RSS."""
from __future__ import annotations

import resource
import sys

SMAPS_ROLLUP = "/proc/self/smaps_rollup"


def process_memory_mb(path: str = SMAPS_ROLLUP) -> dict:
    """{"rss": MB, "pss": MB, "swap": MB} for this process (pss/swap absent where the kernel does not expose them)."""
    out: dict = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss", "Swap"):
                    out[key.lower()] = int(rest.split()[0]) / 1024.0     # kB -> MB
    except OSError:
        pass
    if "rss" not in out:
        import psutil
        out["rss"] = psutil.Process().memory_info().rss / 2**20
    return out


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (ru_maxrss: kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024.0
