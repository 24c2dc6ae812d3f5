"""The RK3588 board cost model (MODELLED from the reference board figures in cost.toml): per-branch phase
times and per-context memory for a model shape at a resolution, and the calibration split of a step.

Scaling rules (the reference: Anima 2B, 1024 image tokens, 512 text tokens):
- NPU time per inference: each branch's reference time is split into parts by the FLOP count of the real widths
  (`branch_flops`): `linear` ~ L (projections, FFN, cross-attention against the fixed 512 text tokens), `quadratic`
  ~ L^2 (self-attention scores and weights x V), `constant` (cross-attention's k/v projections of the text); each part
  scales with its own FLOP count, so other widths scale by weight bytes (the linear parts) and by width (attention).
- lifecycle (load, init, release) and context memory: by the branch's weight bytes; independent of the resolution.
- host ops: by L x D (elementwise over the [L, D] tensors).
- tensor I/O: by the bytes a call moves in and out (the branch table's shapes, models/dit/partition.py), at two per-MB
  rates: the peers' in:out ratio scaled to the reference's unattributed remainder (`io_rates`).
- N contexts inferring at once (dual_core, shards): each at concurrent_speedup[N-1] / N of its own speed.
- a LoRA-ready pack (lora_rank R > 0): each projection's low-rank term x·Aᵀ·Bᵀ adds 2·rows·R·(in + out) FLOPs to
  the part its rows scale with (image tokens: linear; the text context's k/v: constant), priced at the branch's
  own FLOP rate (the projections' MatMuls it runs beside). Its factor inputs are not priced as tensor I/O: the
  branch table's shapes, which the I/O term reads, hold no factors.
- a sharded pack (models/dit/shards.py) as its shards: each one's FLOPs (a heads shard 1/N of every part; a rows shard
  1/N of what its rows compute, all of what every shard recomputes: self-attention's keys and values, cross-attention's
  context projections), lifecycle by its weight bytes, I/O by its own inputs and outputs, memory by `context_units`.
- a W8A8 pack (Shape.int8): the INT8 projections' FLOPs of each branch or shard (flops.int8_shard_flops) at the
  reference's measured W8A8 speed-up (R13) of their FP16 price, INT8 weights 1 byte for the lifecycle (R4: it follows
  the weight bytes); tensor I/O and a context's memory as FP16 (conservative: the graphs' inputs stay FP16).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from models.records.manifest import pack_shape_fields
from models.board.flops import (branch_flops, int8_projection_flops, int8_shard_flops,  # noqa: F401
                                 int8_weight_elements, shard_flops, weight_bytes)
from models.dit.partition import KINDS, TEXT_TOKENS, Geometry, io_elements
from models.dit.shards import split

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

COST_FILE = Path(__file__).with_name("cost.toml")
BOARD_RAMS_GB = (8, 16, 32)
LABEL = "modelled"             # every printed board figure carries this word
MODELS = ("full", "pack")      # what a pack is modelled as: the official 2B widths, or the pack's own config
GIB = 1024.0                   # MiB per GiB
MB = 1e6                       # the peers' per-MB I/O figures are per 10^6 bytes


class CostModelError(ValueError):
    """A cost model file that is missing, malformed or inconsistent; the message names the file and key."""


def load_cost(path=COST_FILE) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CostModelError(f"board cost model {path}: {e}") from None


@dataclass(frozen=True)
class Shape:
    """What the cost model scales by: widths, block count, image and text tokens."""
    width: int
    heads: int
    head_dim: int
    ffn_width: int
    context_dim: int
    blocks: int
    tokens: int
    text_tokens: int = 512
    lora_rank: int = 0               # R of a LoRA-ready pack (0: plain)
    shards: int = 1                  # a sharded pack's shards per branch (models/dit/shards.py)
    cuts: tuple = ()                 # ((kind, "rows" | "heads"), ...) for a sharded pack
    int8: tuple = ()                 # a W8A8 pack's INT8 projections (fc1, qkv, q, fc2; models/quant/smooth.py)

    def cut(self, kind: str) -> str:
        return dict(self.cuts).get(kind, "heads")

    def sharded(self, shards: int, cuts) -> "Shape":
        """The same model as a pack built with `--shards N` and these cuts ({kind: cut})."""
        return dataclasses.replace(self, shards=int(shards), cuts=tuple(sorted(dict(cuts).items())) if shards > 1
                                   else ())

    def symbols(self) -> dict:
        """Values of the branch table's shape symbols (models.dit.partition.BRANCHES) for this shape."""
        return {"L": self.tokens, "S": self.text_tokens, "D": self.width, "Dc": self.context_dim,
                "HD2": self.head_dim // 2}

    def io_elements(self, kind: str) -> tuple:
        """(input elements, output elements) of one call of a branch kind at this shape."""
        return io_elements(kind, self.symbols(), self.text_tokens > TEXT_TOKENS)

    @classmethod
    def reference(cls, cost: dict) -> "Shape":
        r = cost["reference"]
        return cls(r["width"], r["heads"], r["head_dim"], r["ffn_width"], r["context_dim"], r["blocks"], r["tokens"],
                   r["text_tokens"])

    @classmethod
    def at_resolution(cls, width: int, height: int, cost: Optional[dict] = None) -> "Shape":
        """The official model (the reference's widths and blocks) at a picture size: that size's image tokens
        (models.dit.partition.Geometry: 1024x1024 -> 4096), so the attention's quadratic part, the tensor I/O and
        every context's memory follow the size; ValueError for a size the packs cannot take."""
        g = Geometry.from_resolution(int(width), int(height))
        return dataclasses.replace(cls.reference(cost or load_cost()), tokens=g.tokens)

    @classmethod
    def of_pack(cls, pack_dir, model: str = "full", cost: Optional[dict] = None) -> "Shape":
        """The shape a pack is modelled as: `full` = the official widths (the reference's) with the pack's block count
        and tokens, so a tiny pack runs at the real model's board pace; `pack` = the pack's own config."""
        if model not in MODELS:
            raise CostModelError(f"board_model {model!r}: choose one of {', '.join(MODELS)}")
        try:
            c, g, sh = pack_shape_fields(pack_dir)
            own = cls(c["width"], c["heads"], c["head_dim"], c["ffn_width"], c["context_dim"], c["blocks"],
                      g["tokens"], g.get("text_tokens", 512), g.get("lora_rank", 0), int(sh.get("n", 1)),
                      tuple(sorted(dict(sh.get("cuts", {})).items())))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CostModelError(f"{pack_dir}: cannot read the pack's config and geometry ({e})") from None
        from models.records.manifest import pack_quant
        q = pack_quant(pack_dir)
        own = dataclasses.replace(own, int8=tuple(q["int8"]) if q else ())
        if model == "pack":
            return own
        ref = cls.reference(cost or load_cost())
        return cls(ref.width, ref.heads, ref.head_dim, ref.ffn_width, ref.context_dim, own.blocks, own.tokens,
                   own.text_tokens, own.lora_rank, own.shards, own.cuts, own.int8)


@dataclass(frozen=True)
class KindFigures:
    """Board seconds (modelled) for one branch model of a kind: lifecycle per model, NPU and tensor I/O (in, out)
    per inference (one pass); and the bytes that I/O moves."""
    load_s: float
    init_s: float
    release_s: float
    npu_s: float
    io_in_s: float
    io_out_s: float
    bytes_in: int = 0
    bytes_out: int = 0
    units: float = 1.0             # its memory, in contexts of a whole branch (a heads shard less: context_units)

    @property
    def lifecycle_s(self) -> float:
        return self.load_s + self.init_s + self.release_s

    @property
    def io_s(self) -> float:
        return self.io_in_s + self.io_out_s


class BoardModel:
    """Modelled board figures for one model shape: per kind, per step, per context."""

    def __init__(self, shape: Optional[Shape] = None, cost: Optional[dict] = None, path=COST_FILE):
        self.cost = cost if cost is not None else load_cost(path)
        self.path = Path(path)
        # what every printed figure names as its source: the project's cost file by its place in the repository
        self.source = "models/board/cost.toml" if self.path == COST_FILE else str(self.path)
        try:
            self.ref = Shape.reference(self.cost)
            self.shape = shape or self.ref
            c = self.cost
            self.speedups = [float(x) for x in c["npu"]["concurrent_speedup"]]
            if not self.speedups or self.speedups[0] != 1.0 or any(b < a for a, b in zip(self.speedups,
                                                                                         self.speedups[1:])):
                raise ValueError("npu.concurrent_speedup must start at 1.0 and never fall")
            self.in_s_per_mb, self.out_s_per_mb = self.io_rates()
            self.kinds = {k: self._kind(k) for k in KINDS}
            mem = c["memory"]
            self._mem_n = [0] + list(mem["contexts"])
            self._mem_drop = [0.0] + [float(x) for x in mem["mem_available_drop_mib"]]
            self.parts = {k: self._shards(k) for k in KINDS}      # what one call runs: the branch, or its shards
            lsd = (self.shape.tokens * self.shape.width) / (self.ref.tokens * self.ref.width)
            self.host_block_s = c["host"]["per_block_s"] * lsd            # both passes, one block
            self.cores = int(c["npu"]["cores"])
            self.cpu_slots = int(c["lifecycle"]["cpu_slots"])
            self.multi_core_speedup = float(c["npu"]["multi_core_speedup"])
            self.measured = c.get("calibration", {}).get("label") == "measured"   # a board's own figures
            wref = sum(weight_bytes(k, self.ref) for k in KINDS)
            self.weight_factor = sum(weight_bytes(k, self.shape) for k in KINDS) / wref
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise CostModelError(f"board cost model {self.path}: missing or bad figure ({e!r})") from None

    # -- per kind ---------------------------------------------------------------------------------------------------
    def _npu(self, kind: str, flops: dict) -> float:
        """NPU seconds of an inference of these FLOPs (by part) of a branch kind: each part at the reference's
        seconds per FLOP of that part (the one-forward split by kind, scaled to the 20-step run's NPU time)."""
        c, ref = self.cost, self.ref
        fwd = c["npu"]["forward_s"]
        to_step = c["npu"]["step_npu_s"] / (2 * sum(fwd[k] for k in KINDS))
        t_ref = fwd[kind] / ref.blocks * to_step                                # one inference at the reference
        f_ref = branch_flops(kind, ref)
        total_ref = sum(f_ref.values())
        return sum(t_ref * flops[p] / total_ref for p in f_ref if f_ref[p])

    def _int8_saving(self, kind: str, f8: float) -> float:
        """NPU seconds a W8A8 pack's INT8 projections (`f8` of their FLOPs in one inference of the branch or of a
        shard, all in its linear part) save: that share of the linear time runs at the reference's measured W8A8
        speed-up (R13: FFN core 1.90x, both projections INT8)."""
        if not f8:
            return 0.0
        linear_s = self._npu(kind, {"linear": f8, "quadratic": 0, "constant": 0})     # at the FP16 price per FLOP
        return linear_s * (1.0 - 1.0 / float(self.cost["quant"]["int8_speedup"]))

    def _kind(self, kind: str) -> KindFigures:
        c, ref, s = self.cost, self.ref, self.shape
        npu = self._npu(kind, branch_flops(kind, s)) - self._int8_saving(kind, int8_projection_flops(kind, s))
        # lifecycle: per-kind model averages, split into phases by the sweep totals; by weight bytes
        # (a calibrated board measured each kind's phases: they replace the sweep's split)
        sweep = c["lifecycle"].get("phases_s", {}).get(kind) or c["lifecycle"]["sweep_s"]
        total = sum(sweep[ph] for ph in ("load", "init", "release"))
        wf = (weight_bytes(kind, s) - int8_weight_elements(kind, s)) / weight_bytes(kind, ref)   # INT8: 1 byte
        per = c["lifecycle"]["per_model_s"][kind] * wf
        n_in, n_out = s.io_elements(kind)
        b_in, b_out = n_in * int(c["io"]["board_itemsize"]), n_out * int(c["io"]["out_itemsize"])
        return KindFigures(load_s=per * sweep["load"] / total, init_s=per * sweep["init"] / total,
                           release_s=per * sweep["release"] / total, npu_s=npu,
                           io_in_s=b_in / MB * self.in_s_per_mb, io_out_s=b_out / MB * self.out_s_per_mb,
                           bytes_in=b_in, bytes_out=b_out)

    def _shards(self, kind: str) -> list:
        """[KindFigures] of the shards one call of a sharded pack runs (one entry: the branch itself)."""
        s, whole = self.shape, self.kinds[kind]
        if s.shards <= 1:
            return [whole]
        cut = s.cut(kind)
        total = s.tokens if cut == "rows" else s.ffn_width if kind == "ffn" else s.heads
        n_in, n_out = s.io_elements(kind)
        out = []
        for a, b in split(total, s.shards):
            q = (b - a) / total
            frac = 1.0 if cut == "rows" else q                       # its share of the branch's weights
            e_in, e_out = n_in, n_out
            if cut == "rows":                                        # its rows of y, and of xn where it takes them
                e_out = int(round(n_out * q))
                if kind != "self":
                    e_in = n_in - s.tokens * s.width + (b - a) * s.width
            b_in, b_out = e_in * int(self.cost["io"]["board_itemsize"]), e_out * int(self.cost["io"]["out_itemsize"])
            io_in, io_out = self.io_seconds(b_in, b_out)
            out.append(KindFigures(load_s=whole.load_s * frac, init_s=whole.init_s * frac,
                                   release_s=whole.release_s * frac,
                                   npu_s=self._npu(kind, shard_flops(kind, s, cut, b - a, total))
                                   - self._int8_saving(kind, int8_shard_flops(kind, s, cut, b - a, total)),
                                   io_in_s=io_in, io_out_s=io_out, bytes_in=b_in, bytes_out=b_out,
                                   units=self.context_units(kind, frac)))
        return out

    def context_units(self, kind: str, fraction: float) -> float:
        """Memory of a context holding `fraction` of a branch's weights, in whole-branch contexts. A context is its
        weights (FP16: the branch's weight bytes) and the rest the runtime allocates for it (buffers, graph): the
        reference's first context (R9) less the average reference branch's weights is that rest, which a shard
        keeps whole (every context its own, P7)."""
        if fraction >= 1.0:
            return 1.0
        w = sum(weight_bytes(k, self.ref) for k in KINDS) / len(KINDS) / 2**20          # MiB, the average branch
        rest = max(0.0, float(self.cost["memory"]["mem_available_drop_mib"][0]) - w)
        return (rest + fraction * w) / (rest + w)

    def branch_units(self) -> float:
        """Memory of one branch's contexts (its shards together), in whole-branch contexts: the largest kind."""
        return max(sum(f.units for f in self.parts[k]) for k in KINDS)

    def io_rates(self) -> tuple:
        """(seconds per MB in, seconds per MB out): a calibrated board's measured rates, else the peers' per-MB
        figures (P5, P6) in their ratio, scaled so that the reference's bytes of one step (its inputs and outputs as
        it passed them) cost the reference's unattributed remainder (R7): the only figure at this model's shapes."""
        io, ref = self.cost["io"], self.ref
        if "in_ms_per_mb" in io and "out_ms_per_mb" in io:           # measured on a board (bench/board.py)
            return io["in_ms_per_mb"] / 1000, io["out_ms_per_mb"] / 1000
        b_in = b_out = 0
        for kind in KINDS:
            n_in, n_out = ref.io_elements(kind)
            b_in += 2 * ref.blocks * n_in * int(io["reference_in_itemsize"])       # two passes per step
            b_out += 2 * ref.blocks * n_out * int(io["reference_out_itemsize"])
        peer_in, peer_out = io["peer_in_ms_per_mb"] / 1000, io["peer_out_ms_per_mb"] / 1000
        scale = self.cost["step"]["remainder_s"] / (b_in / MB * peer_in + b_out / MB * peer_out)
        return peer_in * scale, peer_out * scale

    def io_seconds(self, bytes_in: float, bytes_out: float) -> tuple:
        """(in, out) seconds of tensor I/O for a call moving these bytes (a shard, a LoRA-ready branch)."""
        return bytes_in / MB * self.in_s_per_mb, bytes_out / MB * self.out_s_per_mb

    def speedup(self, n: int) -> float:
        """Summed throughput of n contexts inferring at once on n NPU cores, over one context's (P1, P2)."""
        n = max(1, min(int(n), self.cores))
        return self.speedups[min(n, len(self.speedups)) - 1]

    def rate(self, n: int) -> float:
        """The speed of each of n contexts inferring at once, as a fraction of one context alone."""
        return self.speedup(n) / max(1, min(int(n), self.cores))

    def npu_parts(self, kind: str) -> dict:
        """Seconds of one inference by scaling part (what tests and docs show): {"linear", "quadratic", "constant"}."""
        f = branch_flops(kind, self.ref)
        fwd = self.cost["npu"]["forward_s"]
        t = fwd[kind] / self.ref.blocks * self.cost["npu"]["step_npu_s"] / (2 * sum(fwd[k] for k in KINDS))
        return {p: t * v / sum(f.values()) for p, v in f.items()}

    @property
    def host_pass_s(self) -> float:
        """Host ops of one pass of one branch (a block's 0.1658 s covers 3 branches x 2 passes)."""
        return self.host_block_s / 6.0

    # -- per step ---------------------------------------------------------------------------------------------------
    def step_parts(self, passes: int = 2) -> dict:
        """A computed step under on-demand, by part (board seconds, modelled)."""
        n = self.shape.blocks
        parts = [f for fs in self.parts.values() for f in fs]        # every graph a step runs (shards: all of them)
        return {"npu_s": n * passes * sum(f.npu_s for f in parts),
                "lifecycle_s": n * sum(f.lifecycle_s for f in parts),
                "host_s": n * self.host_block_s * passes / 2,
                "io_s": n * passes * sum(f.io_s for f in parts)}

    def on_demand_step_s(self) -> float:
        return sum(self.step_parts().values())

    # -- memory -----------------------------------------------------------------------------------------------------
    def mem_drop_mib(self, n: int) -> float:
        """MemAvailable drop with n contexts resident (reference table, interpolated; linear beyond its end)."""
        xs, ys = self._mem_n, self._mem_drop
        if n <= 0:
            return 0.0
        for i in range(1, len(xs)):
            if n <= xs[i]:
                a = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
                return (ys[i - 1] + a * (ys[i] - ys[i - 1])) * self.weight_factor
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return (ys[-1] + (n - xs[-1]) * slope) * self.weight_factor

    def context_mib(self, n: int) -> float:
        """What the n-th resident context costs (the table's marginal)."""
        return self.mem_drop_mib(n) - self.mem_drop_mib(n - 1)

    def usable_gib(self, ram_gb: float) -> float:
        mem = self.cost["memory"]
        return mem["usable_gib_8gb"] if ram_gb == 8 else ram_gb * mem["usable_fraction"]

    def context_budget_mib(self, ram_gb: Optional[float] = None, mem_available_mib: Optional[float] = None) -> float:
        """MiB that contexts may take before MemAvailable falls under the stop rule: from the modelled board
        (usable RAM - baseline usage) or, on a real board, from its MemAvailable now."""
        mem = self.cost["memory"]
        stop = mem["stop_mem_available_gib"] * GIB
        if mem_available_mib is not None:
            return max(0.0, mem_available_mib - stop)
        return max(0.0, (self.usable_gib(ram_gb) - mem["baseline_gib"]) * GIB - stop)

    def units_fit(self, budget_mib: float) -> float:
        """How many whole-branch contexts' memory fits in `budget_mib` (a fraction where a shard takes less)."""
        lo, hi = 0.0, float(max(1, self.contexts_fit(budget_mib) + 1))
        for _ in range(50):                          # mem_drop_mib is increasing: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.mem_drop_mib(mid) <= budget_mib else (lo, mid)
        return lo

    def contexts_fit(self, budget_mib: float) -> int:
        """How many contexts fit in `budget_mib` (the largest n with mem_drop_mib(n) <= budget)."""
        n = 0
        while self.mem_drop_mib(n + 1) <= budget_mib and n < 100_000:
            n += 1
        return n

    @classmethod
    def for_pack(cls, pack_dir=None, board_model: str = "full", cost_path=None) -> "BoardModel":
        """The modelled board for a pack (None: the reference configuration) from a cost file: `cost_path` (a
        board's own calibration, `[stage.executor] board_cost`) or the project's cost.toml."""
        path = Path(cost_path) if cost_path else COST_FILE
        cost = load_cost(path)
        shape = Shape.of_pack(pack_dir, board_model, cost) if pack_dir is not None else None
        return cls(shape, cost, path)

    # -- text -------------------------------------------------------------------------------------------------------
    def describe(self) -> list:
        """Lines for logs and benches: every one says modelled and where the figures come from."""
        s, p = self.shape, self.step_parts()
        what = "a board's own calibration" if self.measured else "reference board and peer figures"
        out = [f"{LABEL} RK3588 board ({self.source}, {what}): shape D={s.width} F={s.ffn_width} "
               f"blocks={s.blocks} tokens={s.tokens}"]
        for k, f in self.kinds.items():
            out.append(f"{LABEL} {k:<5} load {f.load_s:.4f} s, init {f.init_s:.4f} s, release {f.release_s:.4f} s, "
                       f"NPU {f.npu_s:.4f} s and tensor I/O {f.io_s:.4f} s per inference ({f.bytes_in / MB:.2f} MB "
                       f"in, {f.bytes_out / MB:.2f} MB out)")
        out.append(f"{LABEL} on-demand step {self.on_demand_step_s():.2f} s = NPU {p['npu_s']:.2f} + lifecycle "
                   f"{p['lifecycle_s']:.2f} + host {p['host_s']:.2f} + tensor I/O {p['io_s']:.2f}")
        out.append(f"{LABEL} NPU cores: {self.cores}; contexts inferring at once 1/2/3: "
                   + "/".join(f"{self.speedup(n):.2f}x" for n in range(1, self.cores + 1))
                   + f" one context's throughput (peer figures); tensor I/O {self.in_s_per_mb * 1000:.2f} ms/MB in, "
                   f"{self.out_s_per_mb * 1000:.2f} ms/MB out")
        return out
