"""Whether a picture size's branch contexts fit the board's memory (MODELLED), per size and per kind.

A context's memory at a size is the reference's context at 512x512 (R9, by weight bytes: BoardModel.context_mib(1))
plus what its activation memory grows by from 512x512 to the size. The activation memory is the compiler's own
figure ("Total Internal Memory Size" of rknn-toolkit2's build log, models/rknn/buildlog.py), measured for block 0 of
a 16-head model at 1,024 and 4,096 tokens (cost.toml [context_memory], M1); from those two points:
- self-attention: `score_buffers` FP16 buffers of heads x rows x L scores and `wide_tensors` FP16 [L, D] tensors
  (the two unknowns of the two points; a query-row shard of rows [r0, r1) keeps the whole keys and values, so its
  [L, D] part stays whole: conservative against the measured shards);
- cross-attention and the FFN: the per-token slope between the points, scaled by the width (D; the FFN's F).
A job needs, at the least, one branch call's contexts resident at once (a sharded pack's shards: every one holds
its own weights, P7) and its arena (models/packs/scratch.py, grown from its 512x512 size). What the board leaves for
contexts is BoardModel.context_budget_mib: the modelled 8 GB board's, or a real board's from its MemAvailable.
Splitting a branch by query rows (pack --shards N, rows cut) makes each context smaller; it does not make one
call's contexts together smaller, since every part is resident while the call runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from models.board.cost import LABEL, BoardModel, CostModelError, Shape
from models.dit.config import DiTConfig
from models.dit.partition import KINDS, Geometry
from models.dit.shards import split

MIB = 2 ** 20
REFERENCE_SIZE = (512, 512)     # the size R9's contexts were measured at


def _coefficients(cm: dict) -> dict:
    """{kind: (a, b)}: self: a FP16 score buffers [H, rows, L] and b FP16 [L, D] tensors; cross / ffn: a KiB per
    token at the measured width, b KiB at zero tokens (the line through the two measured points)."""
    (l0, l1), H, D = cm["tokens"], int(cm["heads"]), int(cm["width"])
    s0, s1 = cm["self_kib"]
    q0, q1 = H * l0 * l0 * 2 / 1024, H * l1 * l1 * 2 / 1024          # KiB of one score buffer
    w0, w1 = l0 * D * 2 / 1024, l1 * D * 2 / 1024                  # KiB of one [L, D] tensor
    det = q0 * w1 - q1 * w0
    out = {"self": ((s0 * w1 - s1 * w0) / det, (q0 * s1 - q1 * s0) / det)}
    for kind in ("cross", "ffn"):
        k0, k1 = cm[f"{kind}_kib"]
        slope = (k1 - k0) / (l1 - l0)
        out[kind] = (slope, k0 - slope * l0)
    return out


def internal_mib(kind: str, shape: Shape, cost: dict, rows: Optional[int] = None) -> float:
    """MODELLED activation memory (MiB) of a context of a branch kind at `shape`; `rows`: a self-attention shard of
    that many query rows (None: all L)."""
    try:
        cm = cost["context_memory"]
        a, b = _coefficients(cm)[kind]
        L = shape.tokens
        if kind == "self":
            q = L if rows is None else int(rows)
            return (a * shape.heads * q * L * 2 + b * L * shape.width * 2) / MIB
        scale = shape.width / cm["width"] if kind == "cross" else shape.ffn_width / cm["ffn_width"]
        return max(0.0, (a * L + b) * scale) * 1024 / MIB
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise CostModelError(f"board cost model: [context_memory] missing or bad figure ({e!r})") from None


def arena_mib(shape: Shape, size: tuple, passes: int = 2) -> float:
    """The job arena's scratch region (every branch input and output, both CFG passes) of this shape at a size."""
    from models.packs.scratch import scratch_plan
    cfg = DiTConfig(blocks=shape.blocks, width=shape.width, head_dim=shape.head_dim, heads=shape.heads,
                    ffn_width=shape.ffn_width, context_dim=shape.context_dim, lora_dim=256, latent_channels=16)
    g = Geometry.from_resolution(int(size[0]), int(size[1]), text_tokens=max(512, shape.text_tokens))
    return scratch_plan(cfg, g, "fp16", passes, shards=shape.shards).nbytes(64) / MIB


def signed_mib(mib: float) -> str:
    """A change in MiB with its sign: "+12 MiB", "-7 MiB" (a size under 512x512 shrinks the arena), "+0 MiB"."""
    return f"{round(mib) or 0:+,} MiB"


@dataclass(frozen=True)
class SizeFit:
    """One size's memory on a board (MODELLED): the largest branch call's contexts and the arena's growth against
    what the board leaves for contexts."""
    width: int
    height: int
    tokens: int
    shards: int
    kind: str                  # the branch whose call needs the most
    context_mib: float         # its largest context (one shard's, for a sharded pack)
    call_mib: float            # its call's contexts together
    arena_growth_mib: float    # the arena at this size less at 512x512
    budget_mib: float          # what the board leaves for contexts
    basis: str                 # where the budget comes from
    spare_contexts: int        # further contexts of that size beside the call (prefetch's room)

    @property
    def need_mib(self) -> float:
        return self.call_mib + self.arena_growth_mib

    @property
    def fits(self) -> bool:
        return self.need_mib <= self.budget_mib

    def line(self) -> str:
        what = f"{self.shards} shards of " if self.shards > 1 else ""
        head = (f"{self.width}x{self.height}: a {self.kind} call needs {self.need_mib:,.0f} MiB ({what}"
                f"{self.context_mib:,.0f} MiB contexts, arena {signed_mib(self.arena_growth_mib)}) of "
                f"{self.budget_mib:,.0f} MiB for contexts ({self.basis})")
        if self.fits:
            return f"{head}; {self.spare_contexts} more fit beside it ({LABEL})"
        return (f"{head}: does not fit by {self.need_mib - self.budget_mib:,.0f} MiB; a smaller size, a board with "
                f"more RAM, or stop other programs ({LABEL})")


def _part_internal_mib(kind: str, s: Shape, cost: dict, cut: str, a: int, b: int, total: int) -> float:
    """Activation memory of one shard of a call: a rows shard's query rows (self-attention keeps the whole keys and
    values; the others are the branch at its rows), a heads shard its share."""
    if cut == "rows":
        if kind == "self":
            return internal_mib(kind, s, cost, rows=b - a)
        return internal_mib(kind, dataclasses.replace(s, tokens=b - a), cost)
    return internal_mib(kind, s, cost) * (b - a) / total


def kind_contexts_mib(model: BoardModel, kind: str) -> list:
    """MODELLED MiB of each context one call of a branch kind holds at the model's shape (a shard each): the
    reference's context (its share of the weights) plus the activation memory grown from 512x512's."""
    s, cost = model.shape, model.cost
    ref = dataclasses.replace(s, tokens=Geometry.from_resolution(*REFERENCE_SIZE).tokens, shards=1, cuts=())
    base, at_ref = model.context_mib(1), internal_mib(kind, ref, cost)
    if s.shards <= 1:
        return [base + internal_mib(kind, s, cost) - at_ref]
    cut = s.cut(kind)
    total = s.tokens if cut == "rows" else s.ffn_width if kind == "ffn" else s.heads
    return [base * f.units + _part_internal_mib(kind, s, cost, cut, a, b, total) - at_ref
            for f, (a, b) in zip(model.parts[kind], split(total, s.shards))]


def size_fit(model: BoardModel, size: tuple, budget_mib: float, basis: str) -> SizeFit:
    """The fit of `model` (its shape at `size`'s tokens) in `budget_mib` for contexts."""
    s = model.shape
    calls = {k: kind_contexts_mib(model, k) for k in KINDS}
    kind = max(calls, key=lambda k: sum(calls[k]))
    grow = arena_mib(s, size) - arena_mib(s, REFERENCE_SIZE)
    call, ctx = sum(calls[kind]), max(calls[kind])
    spare = int(max(0.0, budget_mib - call - grow) // ctx)
    return SizeFit(int(size[0]), int(size[1]), s.tokens, s.shards, kind, ctx, call, grow, budget_mib, basis, spare)


def fit_at(width: int, height: int, ram_gb: float = 8, shards: int = 1, cuts=None,
           mem_available_mib: Optional[float] = None, model: Optional[BoardModel] = None) -> SizeFit:
    """The official model at a size (a pack's shards and cuts) on the modelled board of `ram_gb`, or on a real board
    with `mem_available_mib` free now."""
    base = model or BoardModel()
    shape = Shape.at_resolution(width, height, base.cost)
    shape = dataclasses.replace(shape, blocks=base.shape.blocks)
    if shards > 1:
        shape = shape.sharded(shards, cuts or {"self": "rows", "cross": "rows", "ffn": "rows"})
    m = BoardModel(shape, base.cost, base.path)
    if mem_available_mib is not None:
        return size_fit(m, (width, height), m.context_budget_mib(mem_available_mib=mem_available_mib),
                        f"MemAvailable {mem_available_mib:,.0f} MiB, measured")
    return size_fit(m, (width, height), m.context_budget_mib(ram_gb), f"{ram_gb:g} GB board")


def for_auto(size: tuple, basis: str = "the modelled board"):
    """This module's rule as `auto` weighs it (models/board/auto.choose's `memory`): (model, MiB for contexts) ->
    the model's SizeFit at `size` (None below 512x512's tokens), so a policy whose contexts do not fit beside the
    size's largest call is left out."""
    w, h = int(size[0]), int(size[1])
    ref_tokens = Geometry.from_resolution(*REFERENCE_SIZE).tokens

    def fit(model: BoardModel, budget_mib: float) -> Optional[SizeFit]:
        # below the size R9's contexts were measured at nothing has grown: the weights' rule (auto's own) holds
        if model.shape.tokens < ref_tokens:
            return None
        return size_fit(_with_memory_figures(model), (w, h), budget_mib, basis)
    return fit


def _with_memory_figures(model: BoardModel) -> BoardModel:
    """The model with the project's [context_memory] where its cost file has none: a board's own calibration
    (models/board/calibrate.py) measures times and MemAvailable, while those figures are the compiler's plan."""
    if "context_memory" in model.cost:
        return model
    from models.board.cost import load_cost
    return BoardModel(model.shape, {**model.cost, "context_memory": load_cost()["context_memory"]}, model.path)


def for_pack(pack_dir):
    """`for_auto` at a DiT pack's own picture size (its manifest's geometry), for the executor's `auto`; None when
    there is no pack or its geometry does not give the size (then auto weighs the weights' memory alone)."""
    if pack_dir is None:
        return None
    from models.records.manifest import ManifestError, pack_shape_fields
    try:
        _, g, _ = pack_shape_fields(pack_dir)
        return for_auto((int(g["width"]), int(g["height"])))
    except (ManifestError, OSError, KeyError, TypeError, ValueError):
        return None
