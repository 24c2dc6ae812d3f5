"""Several LoRAs resolved against the models of a run: which weight each pair updates, by how much, and the two ways
of applying them (FP32 numpy, no torch):

    merged:   W' = W + Σ_i (strength_i · scale_i · up_i) @ down_i           (host ops, encoder, baking a pack)
    factors:  B = [s_1·up_1 | s_2·up_2 | …] [out, R], A = [down_1; down_2; …] [R, in], zero-padded to R,
              so W·x + B·(A·x) = W'·x                                        (a LoRA-ready branch graph's inputs)

LoKr / LoHa modules (models/lora/lycoris.py) merge their ΔW as ComfyUI does, and give factors through their exact
low-rank form (rank r1·r2), so a LoRA-ready pack takes them when that rank fits.

scale = alpha / rank when the file has alpha, else 1 (models/lora/file.py); strength_model applies to the DiT and
its LLM adapter, strength_clip to the text encoder (ComfyUI's LoraLoader). LoRAs stack along the rank; more rank than
a graph takes is refused, or reduced by a truncated SVD whose relative error (Frobenius) is reported.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from models.lora.file import LoraError, LoraFile
from models.lora.lycoris import KIND_NAMES as LYCORIS_NAMES
from models.lora.targets import PARTS, PLACES, Absent, Target, TargetTable, looks_like

log = logging.getLogger(__name__)

MAX_STRENGTH = 100.0           # ComfyUI's LoraLoader bounds strength_model / strength_clip to ±100
OVERFLOW = ("refuse", "svd")    # what to do when the stacked rank of a layer exceeds a graph's R
SHOW_NAMES = 5                  # names listed in a message before "... and N more"


def _names(items, n: int = SHOW_NAMES) -> str:
    items = list(items)
    more = f" ... and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(repr(i) for i in items[:n]) + more


@dataclass(frozen=True)
class LoraUse:
    """One LoRA a job asks for."""
    path: str
    strength: float = 1.0                      # strength_model: DiT + LLM adapter
    clip_strength: Optional[float] = None      # strength_clip: text encoder; None = strength
    name: str = ""                             # as the user named it ("style.safetensors"); the file's name if empty

    @property
    def label(self) -> str:
        return self.name or os.path.basename(self.path)

    @property
    def te_strength(self) -> float:
        return self.strength if self.clip_strength is None else self.clip_strength

    def check(self) -> None:
        for what, v in (("strength", self.strength), ("clip_strength", self.te_strength)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or \
                    abs(v) > MAX_STRENGTH:
                raise LoraError(f"LoRA {self.label}: {what} must be a number in [-{MAX_STRENGTH:g}, "
                                f"{MAX_STRENGTH:g}], got {v!r}")


@dataclass(frozen=True)
class Update:
    """One pair of one file applied to one target, with its factor strength · scale."""
    use: int                   # index into the plan's uses
    pair: object               # models.lora.file.LoraPair
    factor: float


@dataclass
class LoraPlan:
    """The LoRAs of a run resolved against its TargetTable. Arrays are read from the files when asked for."""
    uses: tuple
    files: tuple                                   # LoraFile per use
    targets: dict                                  # key -> Target (only those some LoRA updates)
    updates: dict                                  # key -> [Update] in the order of the uses
    absent: list = field(default_factory=list)     # per use: {part: module count} of parts this run lacks

    # -- what it touches -------------------------------------------------------------------------------------------
    def keys(self, place: str) -> list:
        """The target keys of one place ('branch' | 'host' | 'adapter' | 'te'), in table order."""
        if place not in PLACES:
            raise ValueError(f"place {place!r}: choose one of {PLACES}")
        return [k for k, t in self.targets.items() if t.place == place]

    def rank(self, key: str) -> int:
        """The stacked rank of one target (the sum over the LoRAs that update it; a LoKr/LoHa counts the rank of
        its exact low-rank form)."""
        return sum(u.pair.runtime_rank for u in self.updates[key])

    def max_rank(self, place: str = "branch") -> int:
        return max((self.rank(k) for k in self.keys(place)), default=0)

    def over_rank(self, R: int, place: str = "branch") -> list:
        """[(key, stacked rank)] of the targets of `place` whose stacked rank exceeds R."""
        return [(k, self.rank(k)) for k in self.keys(place) if self.rank(k) > R]

    def check_rank(self, R: int, overflow: str = "refuse", where: str = "") -> list:
        """LoraError when a branch target's stacked rank exceeds R and overflow is 'refuse' (R = 0: the pack takes
        no LoRA at run time); with 'svd' the list of those targets (reduced when their factors are made)."""
        if overflow not in OVERFLOW:
            raise ValueError(f"overflow {overflow!r}: choose one of {OVERFLOW}")
        over = self.over_rank(R)
        if not over or overflow == "svd" and R > 0:
            return over
        if R == 0:
            raise LoraError(f"{where}the LoRAs update {len(over)} NPU branch layers ({_names(k for k, _ in over)}) "
                            "but this pack takes no LoRA at run time: build it with `anima-models pack ... "
                            "--lora-rank R`, or bake the LoRA in with `--lora FILE:STRENGTH`")
        worst = max(r for _, r in over)
        lyco = sorted({u.pair.layout for k, _ in over for u in self.updates[k] if u.pair.kind != "lora"})
        bake = (f"; a {'/'.join(LYCORIS_NAMES[k] for k in lyco)} takes rank r1·r2 at run time (its exact low-rank "
                "form): bake it into the pack instead with `anima-models pack CKPT --out PACK --lora FILE:STRENGTH` "
                "(or `anima-models bundle --lora FILE:STRENGTH`)") if lyco else ""
        raise LoraError(f"{where}stacked LoRA rank {worst} exceeds the pack's LoRA rank {R} in {len(over)} layers "
                        f"({_names(k for k, _ in over)}): use fewer or smaller LoRAs, a pack built with --lora-rank "
                        f"{worst}, or let the rank be reduced by SVD{bake}")

    def read_all(self, place: str, between=None) -> None:
        """Every pair that updates a target of `place` read once, so what LoraFile refuses when read (NaN/Inf, a
        file cut short since it was opened) is refused now rather than wherever the arrays are first used;
        `between()` is called before each target (a cancel check that raises)."""
        for key in self.keys(place):
            if between is not None:
                between()
            for u in self.updates[key]:
                self.files[u.use].arrays(u.pair)

    # -- applying --------------------------------------------------------------------------------------------------
    def delta(self, key: str) -> np.ndarray:
        """ΔW [out, in] f32 of one target: Σ factor · (up @ down), added in the order of the uses."""
        out = None
        for u in self.updates[key]:
            d = self._term(u)
            out = d if out is None else out + d
        return out if out is not None else np.zeros(self.targets[key].shape, np.float32)

    def merged(self, key: str, weight: np.ndarray) -> np.ndarray:
        """W' [out, in] f32 = W + each LoRA's factor · (up @ down), in order (ComfyUI adds its patches so)."""
        w = np.array(weight, np.float32, copy=True)
        if tuple(w.shape) != self.targets[key].shape:
            raise LoraError(f"{key}: weight has shape {list(w.shape)}, the LoRA plan expects "
                            f"{list(self.targets[key].shape)}")
        for u in self.updates[key]:
            w += self._term(u)
        return w

    def _term(self, u: Update) -> np.ndarray:
        """factor · ΔW [out, in] f32 of one update: (factor · up) @ down for a pair; factor · kron / Hadamard
        product for LoKr / LoHa (ComfyUI's `(strength * alpha) * lora_diff`)."""
        f = self.files[u.use]
        if u.pair.kind == "lora":
            return (np.float32(u.factor) * f.up(u.pair)) @ f.down(u.pair)            # [out, r] @ [r, in]
        return np.float32(u.factor) * f.product(u.pair)

    def factors(self, key: str, R: int, overflow: str = "refuse") -> tuple:
        """(B [out, R], A [R, in], relative error) f32: the stacked factors of one target zero-padded to R, so that
        B @ A = ΔW; over R refused, or (overflow 'svd') the best rank-R approximation with its relative Frobenius
        error (0.0 when nothing was dropped)."""
        out_f, in_f = self.targets[key].shape
        ups, downs = [], []
        for u in self.updates.get(key, ()):
            up, down = self.files[u.use].low_rank(u.pair)                             # [out, r_i], [r_i, in]
            ups.append(np.float32(u.factor) * up)
            downs.append(down)
        r = sum(d.shape[0] for d in downs)
        B = np.zeros((out_f, R), np.float32)
        A = np.zeros((R, in_f), np.float32)
        if r == 0:
            return B, A, 0.0
        Bc, Ac = np.concatenate(ups, axis=1), np.concatenate(downs, axis=0)          # [out, r], [r, in]
        if r <= R:
            B[:, :r], A[:r] = Bc, Ac
            return B, A, 0.0
        if overflow != "svd" or R == 0:
            self.check_rank(R, "refuse")
        Bs, As, err = reduce_rank(Bc, Ac, R)
        return Bs, As, err

    def report(self) -> list:
        """Per use: what it is and what it changes (report.json, `anima-models forward`)."""
        out = []
        for i, (use, f) in enumerate(zip(self.uses, self.files)):
            places = {p: 0 for p in PLACES}
            ranks = set()
            for key, ups in self.updates.items():
                for u in ups:
                    if u.use == i:
                        places[self.targets[key].place] += 1
                        ranks.add(u.pair.rank)
            out.append({"name": use.label, "path": use.path, "strength": use.strength,
                        "clip_strength": use.te_strength, "layouts": list(f.layouts),
                        "ranks": sorted(ranks), "layers": {p: n for p, n in places.items() if n},
                        "not_applied": dict(self.absent[i]) if i < len(self.absent) else {}})
        return out


def reduce_rank(B: np.ndarray, A: np.ndarray, R: int) -> tuple:
    """The best rank-R approximation of B @ A ([out, r] @ [r, in], r > R) as (B' [out, R], A' [R, in], relative
    Frobenius error), without forming B @ A: QR of both factors, then the SVD of the small r×r core (float64)."""
    Q1, R1 = np.linalg.qr(np.asarray(B, np.float64))                                 # [out, r], [r, r]
    Q2, R2 = np.linalg.qr(np.asarray(A, np.float64).T)                               # [in, r], [r, r]
    U, S, Vt = np.linalg.svd(R1 @ R2.T)                                              # [r, r], [r], [r, r]
    total = float(np.sum(S * S))
    err = math.sqrt(float(np.sum(S[R:] * S[R:])) / total) if total > 0 else 0.0
    Bs = (Q1 @ (U[:, :R] * S[:R])).astype(np.float32)                                # [out, R]
    As = (Vt[:R] @ Q2.T).astype(np.float32)                                          # [R, in]
    return Bs, As, err


def open_lora(path) -> LoraFile:
    """A LoRA file opened for a plan (LoraError naming it when it cannot be)."""
    if not os.path.isfile(path):
        raise LoraError(f"LoRA {path}: no such file")
    return LoraFile(path)


def plan_loras(uses, table: TargetTable, strict: bool = True, files=None) -> LoraPlan:
    """Resolve `uses` ([LoraUse]) against `table`.

    Refused (LoraError, naming the file): a bad strength; a file none of whose modules names a layer of Anima
    (another model's LoRA); a pair whose shapes do not match its layer's weight; with `strict`, module names that
    match no layer (reported by name; without `strict` they are logged and skipped, as ComfyUI does). Names of a
    model part the run does not hold (`TargetTable` built without it) are counted in `absent`, not refused.
    `files`: LoraFile objects already open for the same paths (one per use)."""
    uses = tuple(uses)
    opened = tuple(files) if files is not None else tuple(open_lora(u.path) for u in uses)
    targets: dict = {}
    updates: dict = {}
    absent = []
    for i, (use, f) in enumerate(zip(uses, opened)):
        use.check()
        where = f"{f.path}: "
        unknown, skipped, hits = [], {}, 0
        for name, pair in f.pairs.items():
            t = table.lookup(name, where)
            if isinstance(t, Absent):
                skipped[t.part] = skipped.get(t.part, 0) + 1
                continue
            if t is None:
                unknown.append(name)
                continue
            if (pair.out_features, pair.in_features) != t.shape:
                raise LoraError(f"{where}module {name!r}: up [{pair.out_features}, {pair.rank}] @ down "
                                f"[{pair.rank}, {pair.in_features}] makes [{pair.out_features}, {pair.in_features}], "
                                f"but {t.key} is {list(t.shape)} (a LoRA for another size of model?)")
            hits += 1
            strength = use.te_strength if t.model == "te" else use.strength
            targets.setdefault(t.key, t)
            updates.setdefault(t.key, []).append(Update(i, pair, float(strength) * pair.scale))
        stray = list(f.stray)
        if hits == 0 and not skipped:
            other = looks_like(list(f.pairs) + stray)
            raise LoraError(f"{where}none of its {len(f.pairs)} LoRA modules names a layer of Anima (the DiT, its "
                            f"LLM adapter or the Qwen3 text encoder); first: {_names(list(f.pairs), 3)}"
                            + (f". It looks like a LoRA for {other}" if other else ""))
        if unknown or stray:
            msg = (f"{where}{len(unknown) + len(stray)} keys match no layer of Anima: "
                   f"{_names(unknown + stray)}")
            if strict:
                raise LoraError(msg)
            for n in unknown + stray:
                log.warning("lora key not loaded: %s (%s)", n, f.path)
        for part, n in skipped.items():
            log.info("%s%d modules for %s are not applied here", where, n, PARTS[part])
        absent.append(skipped)
    ordered = {k: targets[k] for k in table.targets if k in targets}             # the models' own key order
    return LoraPlan(uses, opened, ordered, {k: updates[k] for k in ordered}, absent)


def parse_lora_arg(text: str) -> LoraUse:
    """'FILE', 'FILE:STRENGTH' or 'FILE:STRENGTH:CLIP_STRENGTH' (the command lines' --lora) -> LoraUse; up to two
    trailing numbers are strengths, the rest is the file."""
    parts = str(text).split(":")
    nums: list = []
    while len(parts) > 1 and len(nums) < 2:
        try:
            nums.insert(0, float(parts[-1]))
        except ValueError:
            break
        parts.pop()
    path = ":".join(parts)
    if not path:
        raise ValueError(f"--lora {text!r}: expected FILE[:STRENGTH[:CLIP_STRENGTH]]")
    use = LoraUse(path, nums[0] if nums else 1.0, nums[1] if len(nums) > 1 else None)
    use.check()
    return use


def plan_text_loras(uses, encoder, strict: bool = True) -> Optional[LoraPlan]:
    """`uses` planned against a text encoder's adapter and Qwen3 layers (models.text TextEncoder.lora_shapes);
    None without LoRAs. The result goes to `encoder.set_lora`."""
    if not uses:
        return None
    adapter, qwen = encoder.lora_shapes()
    return plan_loras(list(uses), TargetTable.from_configs(adapter_cfg=adapter, te_shape=qwen), strict=strict)
