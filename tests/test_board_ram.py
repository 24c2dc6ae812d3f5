"""One rule turns a machine's MemTotal into its board's size (models/board/ram.board_size_gb): the board model's
pricing (account.board_ram, which keep_up and the estimate read), the calibration's memory section
(calibrate._memory) and the board bench's record (bench/board.board_ram_gb) must name the same board."""
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from models.board.account import ASSUMED_RAM_GB, board_ram
from models.board.calibrate import _memory
from models.board.cost import BOARD_RAMS_GB, load_cost
from models.board.ram import BOARD_SIZES_GB, RAM_SHARE, board_size_gb

GIB = 2**20                                 # kB per GiB, as /proc/meminfo counts
ROCK_5C_8GB_KIB = 8126464                   # 7.75 GiB: the 8 GB ROCK 5C's MemTotal (docs/board.md, measured)


def _bench_board():
    path = Path(__file__).resolve().parents[1] / "bench" / "board.py"
    spec = importlib.util.spec_from_file_location("bench_board", path)
    board = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(board)
    return board


def _kernel_mem_total_kib(size_gb: int, reserved_gib: float) -> int:
    """A board's MemTotal as a kernel reports it (modelled): its size less the page structures (64 bytes per 4 KiB
    page) and what the firmware and drivers reserve; with 0.125 GiB reserved an 8 GB board gives the ROCK 5C's
    7.75 GiB exactly."""
    return int((size_gb * (1 - 64 / 4096) - reserved_gib) * GIB)


def _calibrated_size(mem_total_kib: int):
    """The board size the calibration's [memory] section says it measured (None: it kept the project's figures)."""
    c = SimpleNamespace(mem_total_gib=mem_total_kib / GIB, mem_contexts=[1, 2], mem_drop_mib=[10.0, 20.0],
                        extra_pss_mib=[0.0, 0.0], baseline_gib=1.0)
    text = "\n".join(_memory(c, load_cost()))
    per = re.search(r"MemTotal / (\d+) GB", text)
    if per:
        return int(per.group(1))
    return 8 if re.search(r"usable_gib_8gb = .*MemTotal", text) else None


def test_the_kernels_memtotal_of_each_board_is_that_board():
    assert _kernel_mem_total_kib(8, 0.125) == ROCK_5C_8GB_KIB
    for size in BOARD_SIZES_GB:
        for reserved in (0.05, 0.125, 0.25):                              # up to twice the ROCK 5C's
            assert board_size_gb(_kernel_mem_total_kib(size, reserved)) == size, (size, reserved)
        assert board_size_gb(size * GIB) == size                          # all of it: still that board
        assert board_size_gb(RAM_SHARE * size * GIB) == size              # the rule's edge
    assert board_size_gb(RAM_SHARE * 8 * GIB - 1) == 4                    # under 90% of 8: the size below
    assert board_size_gb(11.6 * GIB) == 8 and board_size_gb(23.4 * GIB) == 16     # 12 / 24 GB: never priced up
    assert board_size_gb(62 * GIB) == 32
    assert [board_size_gb(v) for v in (None, 0, 3.5 * GIB)] == [None, None, None]


@pytest.mark.parametrize("mem_total_kib", [
    *(_kernel_mem_total_kib(size, r) for size in BOARD_SIZES_GB for r in (0.05, 0.125, 0.25)),
    ROCK_5C_8GB_KIB, int(3.5 * GIB), int(11.6 * GIB), int(23.4 * GIB), int(62 * GIB)])
def test_the_board_model_its_calibration_and_the_bench_name_the_same_board(mem_total_kib):
    size = board_size_gb(mem_total_kib)
    bench = _bench_board().board_ram_gb(mem_total_kib)
    priced, basis = board_ram({}, mem_total_kib)
    calibrated = _calibrated_size(mem_total_kib)
    assert bench == (size or "?")
    # priced: the board itself when the model has it, else the smallest modelled board, saying so
    assert priced == (size if size in BOARD_RAMS_GB else ASSUMED_RAM_GB)
    assert ("under the smallest modelled board" in basis) == (size not in BOARD_RAMS_GB)
    # measured: the board's own figures when MemTotal is of that size (a 12 GB board measures no 8 GB one)
    assert calibrated == (size if size is not None and mem_total_kib <= size * GIB else None)
    assert bench == priced or size not in BOARD_RAMS_GB
