"""A board's own figures in the cost file's format (models/board/cost.toml).

`bench/board.py --calibrate OUT.toml` measures them on the board (per-kind NPU time, tensor I/O in and out per MB,
the lifecycle per kind, host ops per block, 1 / 2 / 3 contexts inferring at once, MemAvailable per context) and
`write_cost` writes them here so that `[stage.executor] board_cost = "OUT.toml"` makes board-sim and the `auto`
chooser run on this board's figures instead of the reference's and the peers'. The file's reference configuration
is the calibrated pack's (its widths, blocks and tokens): other packs scale from it by the cost model's rules. What a
calibration does not measure (the job's encoder and VAE figures, the CPU slots for the lifecycle, a multi-core
mask's speed-up, the memory rules of other board sizes) is copied from the project's cost file, and says so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from models.board.cost import Shape, load_cost
from models.board.ram import KIB_PER_GIB, board_size_gb
from models.dit.partition import KINDS

MEASURED = "measured"


@dataclass
class Calibration:
    """What one calibration run measured (seconds are this board's, wall time around each call)."""
    shape: Shape                           # the calibrated pack's shape
    npu_pass_s: dict                       # kind -> NPU seconds per pass (rknn_runtime.run; with I/O if not split)
    io_split: bool                         # True: tensor I/O was timed apart from the NPU (set_inputs/get_outputs)
    in_ms_per_mb: float                    # tensor I/O in, ms per 10^6 bytes handed to RKNNLite
    out_ms_per_mb: float                   # tensor I/O out, ms per 10^6 bytes RKNNLite returned
    lifecycle_s: dict                      # kind -> {"load", "init", "release"} seconds per model
    host_block_s: float                    # host ops of one block, both CFG passes
    speedup: list                          # 1, 2, 3 contexts inferring at once: summed throughput over one's
    mem_contexts: list                     # contexts resident ...
    mem_drop_mib: list                     # ... and the MemAvailable drop with them
    extra_pss_mib: list
    baseline_gib: float                    # MemTotal - MemAvailable before any context
    mem_total_gib: float
    board: dict = field(default_factory=dict)    # what ran it: machine, runtime, stand-in, driver, DRAM governor
    models: dict = field(default_factory=dict)   # kind -> how many branch models were measured
    bytes_per_call: dict = field(default_factory=dict)   # kind -> [bytes in, bytes out] of one pass

    def step_parts(self) -> dict:
        """An on-demand computed step from the measured parts (board seconds; the cost file's [step])."""
        n = self.shape.blocks
        io = 2 * n * sum((b[0] * self.in_ms_per_mb + b[1] * self.out_ms_per_mb) / 1e9
                         for b in self.bytes_per_call.values()) if self.io_split else 0.0
        return {"npu_s": 2 * n * sum(self.npu_pass_s.values()),
                "lifecycle_s": n * sum(sum(p.values()) for p in self.lifecycle_s.values()),
                "host_s": n * self.host_block_s, "io_s": io}


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"calibration figure {v!r} is not a finite number")
        return repr(round(v, 9))
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _increasing(values: list, floor: float = 1.0) -> list:
    """A measured MemAvailable table made non-decreasing by at least `floor` MiB per row (noise on a quiet board
    can make a row fall; the cost model needs a table that grows)."""
    out = []
    for v in values:
        out.append(max(float(v), (out[-1] + floor) if out else floor))
    return out


SOURCE = "bench/board.py --calibrate"
_M = f"# {MEASURED} on this board ({SOURCE})"                 # after a figure this board measured
_KEPT = "# not measured by a calibration: the project's cost.toml"


def write_cost(c: Calibration, base: Optional[dict] = None) -> str:
    """The calibration as a cost file (TOML text, loadable by models.board.cost.load_cost)."""
    base = base or load_cost()
    sections = (_preamble(c), _reference(c, base), _step(c), _npu(c, base), _lifecycle(c, base), _host_io(c, base),
                _memory(c, base), _copied(base))
    return "\n".join(line for section in sections for line in (*section, ""))


def _preamble(c: Calibration) -> list:
    """The file's header comment and [calibration]: what ran it and what it measured."""
    return ["# The board cost model from ONE BOARD's own measurements (models/board/calibrate.py wrote it;",
            f"# {SOURCE}). Figures marked `{MEASURED}` are this board's; the others are the project's cost.toml,",
            "# copied. [stage.executor] board_cost = \"THIS FILE\" makes board-sim and auto use it.",
            "",
            "[calibration]",
            f"label = {_toml(MEASURED)}",
            *[f"{k} = {_toml(v)}" for k, v in c.board.items() if v is not None],
            f"models = {_toml({k: int(c.models.get(k, 0)) for k in KINDS})}  # branch models measured per kind",
            f"io_split = {_toml(c.io_split)}  # tensor I/O timed apart from the NPU (set_inputs / run / get_outputs)"]


def _reference(c: Calibration, base: dict) -> list:
    s = c.shape
    return ["[reference]                 # the calibrated pack's configuration",
            f"tokens = {s.tokens}", f"text_tokens = {s.text_tokens}", f"blocks = {s.blocks}",
            f"width = {s.width}", f"heads = {s.heads}", f"head_dim = {s.head_dim}", f"ffn_width = {s.ffn_width}",
            f"context_dim = {s.context_dim}", f"resolution = {_toml(base['reference'].get('resolution', ''))}"]


def _step(c: Calibration) -> list:
    p = c.step_parts()
    wall = sum(p.values())
    return ["[step]                      # an on-demand computed step from the measured parts below",
            f"wall_s = {_toml(wall)}", f"npu_s = {_toml(p['npu_s'])}",
            f"overhead_ratio = {_toml(wall / p['npu_s'] if p['npu_s'] else 0.0)}",
            f"remainder_s = {_toml(p['io_s'])}  # the tensor I/O of a step"]


def _npu(c: Calibration, base: dict) -> list:
    return ["[npu]",
            f"forward_s = {_toml({k: c.npu_pass_s[k] * c.shape.blocks for k in KINDS})}  {_M}: per pass x blocks"
            + ("" if c.io_split else " (tensor I/O included: not split)"),
            f"step_npu_s = {_toml(c.step_parts()['npu_s'])}",
            f"cores = {int(base['npu']['cores'])}",
            f"concurrent_speedup = {_toml([float(x) for x in c.speedup])}  {_M}: 1 / 2 / 3 contexts at once",
            f"multi_core_speedup = {_toml(float(base['npu']['multi_core_speedup']))}  {_KEPT}",
            f"multi_core_conv_speedup = {_toml(float(base['npu'].get('multi_core_conv_speedup', 1.0)))}  {_KEPT}"]


def _lifecycle(c: Calibration, base: dict) -> list:
    sweep = {ph: c.shape.blocks * sum(c.lifecycle_s[k][ph] for k in KINDS) for ph in ("load", "init", "release")}
    return ["[lifecycle]",
            f"per_model_s = {_toml({k: sum(c.lifecycle_s[k].values()) for k in KINDS})}  {_M}: mean per model",
            f"sweep_s = {_toml(sweep)}  {_M}: means x blocks",
            f"phases_s = {_toml({k: c.lifecycle_s[k] for k in KINDS})}  {_M}: each kind's own split",
            f"cpu_slots = {int(base['lifecycle']['cpu_slots'])}  {_KEPT}"]


def _host_io(c: Calibration, base: dict) -> list:
    inside = "" if c.io_split else " (0: inside the NPU figure)"
    return ["[host]",
            f"per_block_s = {_toml(c.host_block_s)}  {_M}: both passes",
            "",
            "[io]",
            f"per_inference_s = {_toml(c.step_parts()['io_s'] / (6 * c.shape.blocks))}",
            f"in_ms_per_mb = {_toml(c.in_ms_per_mb)}  {_M}" + inside,
            f"out_ms_per_mb = {_toml(c.out_ms_per_mb)}  {_M}" + inside,
            *[f"{k} = {_toml(base['io'][k])}" for k in ("peer_in_ms_per_mb", "peer_out_ms_per_mb",
                                                        "reference_in_itemsize", "reference_out_itemsize",
                                                        "out_itemsize", "board_itemsize")]]


def _memory(c: Calibration, base: dict) -> list:
    # this board's size (an 8 GB ROCK 5C has 7.75 GiB): its MemTotal is what it has usable; a MemTotal over the size
    # (a 12 GB board is an 8 GB one to the model) measures no size: the project's figures are kept
    ram = board_size_gb(c.mem_total_gib * KIB_PER_GIB)
    ram = ram if ram is not None and c.mem_total_gib <= ram else None
    usable_8 = c.mem_total_gib if ram == 8 else float(base["memory"]["usable_gib_8gb"])
    fraction = c.mem_total_gib / ram if ram not in (None, 8) else float(base["memory"]["usable_fraction"])
    return ["[memory]",
            f"contexts = {_toml([int(n) for n in c.mem_contexts])}  {_M}",
            f"mem_available_drop_mib = {_toml(_increasing(c.mem_drop_mib))}  {_M} (made to grow by >= 1 MiB a row)",
            f"extra_pss_mib = {_toml([float(x) for x in c.extra_pss_mib])}  {_M}",
            f"stop_mem_available_gib = {_toml(float(base['memory']['stop_mem_available_gib']))}  {_KEPT}",
            f"usable_gib_8gb = {_toml(usable_8)}  {'# ' + MEASURED + ': MemTotal' if ram == 8 else _KEPT}",
            f"baseline_gib = {_toml(c.baseline_gib)}  {_M}: MemTotal - MemAvailable before any context",
            f"usable_fraction = {_toml(fraction)}  "
            + (f"# {MEASURED}: MemTotal / {ram} GB" if ram not in (None, 8) else _KEPT)]


def _copied(base: dict) -> list:
    """The sections a calibration does not measure, as the project's cost file has them."""
    return ["[dram]",
            *[f"{k} = {_toml(v)}" for k, v in base.get("dram", {}).items()],
            "",
            f"[job]                       {_KEPT}",
            *[f"{k} = {_toml(v)}" for k, v in base["job"].items()]]
