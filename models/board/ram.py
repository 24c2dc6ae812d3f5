"""A machine's MemTotal -> the size of the board it is (GB), the one rule the board model, its calibration and the
board bench read it by.

The kernel reports less than the board's nominal size: the firmware's and the drivers' reserved memory and the page
structures are not in MemTotal (an 8 GB ROCK 5C shows 7.75 GiB, docs/board.md). A board therefore is the largest size
of which its MemTotal holds RAM_SHARE: a 12 GB board is an 8 GB one to the model (never 16), a 4 GB board a 4 GB one
(below every modelled size, models/board/cost.BOARD_RAMS_GB)."""
from __future__ import annotations

from typing import Optional

BOARD_SIZES_GB = (4, 8, 16, 32)    # the RK3588 boards' RAM sizes (ROCK 5B/5C, Orange Pi 5 ...)
RAM_SHARE = 0.9                    # MemTotal is at least this share of the board's size (7.75 / 8 = 0.97)
KIB_PER_GIB = 2**20                # /proc/meminfo counts kB (KiB)


def board_size_gb(mem_total_kib: Optional[float]) -> Optional[int]:
    """The board size (one of BOARD_SIZES_GB) whose RAM_SHARE a MemTotal of `mem_total_kib` reaches, the largest
    such; None when unknown (None, 0) or under the smallest."""
    if not mem_total_kib or mem_total_kib <= 0:
        return None
    gib = mem_total_kib / KIB_PER_GIB
    fits = [gb for gb in BOARD_SIZES_GB if gib >= RAM_SHARE * gb]
    return max(fits) if fits else None
