"""One LoRA file as it is stored: its low-rank pairs (up [out, r], down [r, in], alpha) grouped by module name, in
every layout Anima LoRAs come in, read through the memory map (no torch).

Layouts (docs/lora.md, every pair form ComfyUI's LoRA loader reads): sd-scripts/kohya `NAME.lora_up.weight` /
`NAME.lora_down.weight`, ComfyUI/diffusers/PEFT `NAME.lora_B.weight` / `NAME.lora_A.weight`, also `NAME.lora_B` /
`NAME.lora_A`, `NAME.lora_B.default.weight` / `NAME.lora_A.default.weight`, `NAME_lora.up.weight`,
`NAME.lora.up.weight` and `NAME.lora_linear_layer.up.weight` (with their down); each with an optional scalar
`NAME.alpha`. What NAME means (a module of the DiT, the
LLM adapter or the text encoder) is models/lora/targets.py's business, not this file's. LyCORIS LoKr (`NAME.lokr_w1`,
`.lokr_w2`, or their `_a`/`_b` halves) and LoHa (`NAME.hada_w1_a` ... `.hada_w2_b`) modules are read too, as pairs
of kind "lokr" / "loha" whose ΔW models/lora/lycoris.py forms.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from models.lora.lycoris import KIND_NAMES, KIND_OF_PART, check_shapes
from models.lora.lycoris import low_rank as lycoris_low_rank, product as lycoris_product
from models.base.safetensors_io import SafeTensorsError, SafeTensorsFile

FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
HASH_CHUNK = 8 * 1024 * 1024
# Bounds on what is read of a LoRA before anything is applied. An Anima LoRA on every layer of the DiT, its LLM
# adapter and Qwen3 has ~800 modules (~2,400 keys, a header under 1 MB with kohya's training metadata); ranks people
# train are 4..256. Beyond these a file is refused from its header: a rank is what every merge and factor allocates
# ([out, rank] and [rank, in] in FP32), and a header is parsed whole.
MAX_HEADER_BYTES = 8 * 1024 * 1024
MAX_KEYS = 8192
MAX_RANK = 1024

# key suffix -> (role, layout); role "up" [out, r] / "down" [r, in]. Matched by the longest suffix first.
PAIR_SUFFIXES = {
    ".lora_up.weight": ("up", "kohya"), ".lora_down.weight": ("down", "kohya"),
    ".lora_B.weight": ("up", "comfy"), ".lora_A.weight": ("down", "comfy"),
    ".lora_B.default.weight": ("up", "peft-default"), ".lora_A.default.weight": ("down", "peft-default"),
    ".lora_B": ("up", "bare"), ".lora_A": ("down", "bare"),
    # the other forms ComfyUI's LoRAAdapter.load reads (comfy/weight_adapter/lora.py): old diffusers attention
    # processors `NAME_lora.up.weight`, diffusers' `NAME.lora.up.weight`, transformers' `NAME.lora_linear_layer...`
    "_lora.up.weight": ("up", "diffusers-proc"), "_lora.down.weight": ("down", "diffusers-proc"),
    ".lora.up.weight": ("up", "diffusers-lora"), ".lora.down.weight": ("down", "diffusers-lora"),
    ".lora_linear_layer.up.weight": ("up", "transformers"), ".lora_linear_layer.down.weight": ("down", "transformers"),
}
ALPHA_SUFFIX = ".alpha"
LYCORIS_SUFFIXES = {"." + p: p for p in KIND_OF_PART}      # ".lokr_w1" -> "lokr_w1", ...
# key suffixes of adapter types that are not a plain low-rank pair -> the type's name (refused, named)
OTHER_TYPES = {
    ".dora_scale": "DoRA (weight-decomposed LoRA, dora_scale)",
    ".oft_blocks": "OFT", ".oft_diag": "OFT", ".rescale": "OFT/BOFT",
    ".a1.weight": "GLoRA", ".a2.weight": "GLoRA", ".b1.weight": "GLoRA", ".b2.weight": "GLoRA",
    ".lora_mid.weight": "LoCon with a Tucker mid weight (lora_mid)",
    ".diff": "a full weight difference (.diff)", ".diff_b": "a bias difference (.diff_b)",
    ".set_weight": "a weight replacement (.set_weight)", ".w_norm": "a norm-weight difference (.w_norm)",
    ".b_norm": "a norm-bias difference (.b_norm)", ".reshape_weight": "a reshaping LoRA (.reshape_weight)",
    ".lora_B.bias": "a LoRA with a bias (lora_B.bias)",
}


class LoraError(ValueError):
    """A LoRA file that cannot be applied; the message names the file and, where there is one, the key."""


@dataclass(frozen=True)
class LoraPair:
    """One module's update as the file stores it: a low-rank pair ΔW = scale · up @ down, scale = alpha / rank or 1;
    or (kind "lokr" / "loha") a LyCORIS module whose ΔW models/lora/lycoris.py forms, scale = alpha / rank or 1."""
    name: str                   # the module as the file spells it: "lora_unet_blocks_0_self_attn_q_proj", ...
    layout: str                 # a PAIR_SUFFIXES layout (models.lora.synth.LAYOUTS) | "lokr" | "loha"
    up_key: str                 # "" for LoKr / LoHa
    down_key: str
    out_features: int
    rank: int                   # what alpha divides by (LoKr with both factors full: 0, scale 1)
    in_features: int
    alpha: Optional[float]      # None when the file has no NAME.alpha
    kind: str = "lora"          # "lora" | "lokr" | "loha"
    parts: tuple = ()           # LoKr / LoHa: ((part, key), ...): ("lokr_w1", "NAME.lokr_w1"), ...
    low_rank: int = 0           # LoKr / LoHa: the rank of their exact low-rank form (models.lora.lycoris)

    @property
    def scale(self) -> float:
        """alpha / rank when the file gives alpha, else 1.0 (what ComfyUI and sd-scripts compute)."""
        return 1.0 if self.alpha is None or self.rank == 0 else self.alpha / self.rank

    @property
    def runtime_rank(self) -> int:
        """The rank this module takes in a LoRA-ready pack's branch inputs (a pair's own; LoKr/LoHa: r1·r2)."""
        return self.rank if self.kind == "lora" else self.low_rank


def _suffix(key: str, table) -> Optional[str]:
    """The longest suffix of `table` that `key` ends with (a module name must precede it)."""
    best = None
    for s in table:
        if key.endswith(s) and len(key) > len(s) and (best is None or len(s) > len(best)):
            best = s
    return best


class LoraFile:
    """A LoRA safetensors file, opened and checked for structure (header only; arrays are read on demand).

    `.pairs` {module name as stored: LoraPair}; `.stray` keys that belong to no pair (reported by whoever maps the
    names); `.layouts` the layouts seen. Raises LoraError for what no layer could use: not a safetensors file or
    truncated, another adapter type (named), half a pair, shapes that do not chain, a non-scalar or non-finite
    alpha, a non-float dtype."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            self._st = st = SafeTensorsFile(self.path, max_header_bytes=MAX_HEADER_BYTES, max_keys=MAX_KEYS,
                                            mapped=False)
        except SafeTensorsError as e:
            raise LoraError(f"LoRA {e}") from None
        end = max((st.info(k).end for k in st.keys()), default=st.data_start)
        if st.size != end:
            raise LoraError(f"LoRA {self.path}: {st.size - end} bytes after the last tensor (a safetensors file ends "
                            "where its last tensor does: damaged, or not what its header says)")
        self.metadata = dict(st.metadata)
        self.stray: list = []
        self.pairs: dict = {}
        for name, slot in self._group(st.keys()).items():
            if "lyco" in slot:
                self.pairs[name] = self._lycoris_pair(name, slot)
                continue
            if "up" not in slot and "down" not in slot:            # an alpha alone
                self.stray.append(slot["alpha"][0])
                continue
            for role, other in (("up", "down"), ("down", "up")):
                if role not in slot:
                    raise LoraError(f"{self.path}: module {name!r} has {slot[other][0]!r} but no {role} weight "
                                    "(half a LoRA pair: the file is cut or damaged)")
            if slot["up"][1] != slot["down"][1]:
                raise LoraError(f"{self.path}: module {name!r} mixes layouts ({slot['up'][0]!r}, {slot['down'][0]!r})")
            self.pairs[name] = self._pair(name, slot)
        if not self.pairs:
            raise LoraError(f"{self.path}: no LoRA pair (lora_up/lora_down, lora_B/lora_A) nor LoKr/LoHa module "
                            f"among its {len(st.keys())} tensors (first: {st.keys()[0]!r}): not a LoRA")
        self.layouts = tuple(sorted({p.layout for p in self.pairs.values()}))
        self._sha256: Optional[str] = None

    def _group(self, keys) -> dict:
        """name -> {"up": (key, layout), "down": ..., "alpha": (key, None), "lyco": {part: key}}; keys of no module
        go to .stray; another adapter type is refused, named."""
        parts: dict = {}
        others: dict = {}                                       # type -> first key
        for k in keys:
            s = _suffix(k, PAIR_SUFFIXES)
            if s is not None:
                role, layout = PAIR_SUFFIXES[s]
                slot = parts.setdefault(k[:-len(s)], {})
                if role in slot:
                    raise LoraError(f"{self.path}: module {k[:-len(s)]!r} has two {role} weights "
                                    f"({slot[role][0]!r} and {k!r})")
                slot[role] = (k, layout)
                continue
            s = _suffix(k, LYCORIS_SUFFIXES)
            if s is not None:
                parts.setdefault(k[:-len(s)], {}).setdefault("lyco", {})[LYCORIS_SUFFIXES[s]] = k
                continue
            s = _suffix(k, OTHER_TYPES)
            if s is not None:
                others.setdefault(OTHER_TYPES[s], k)
                continue
            if k.endswith(ALPHA_SUFFIX) and len(k) > len(ALPHA_SUFFIX):
                parts.setdefault(k[:-len(ALPHA_SUFFIX)], {})["alpha"] = (k, None)
                continue
            self.stray.append(k)
        if others:
            kind, key = next(iter(others.items()))
            also = f" (also {', '.join(list(others)[1:])})" if len(others) > 1 else ""
            raise LoraError(f"{self.path}: key {key!r}: this is {kind}{also}, not a LoRA this project applies "
                            "(lora_up/lora_down, lora_B/lora_A, LoKr lokr_*, LoHa hada_*)")
        if not parts and not self.stray:
            raise LoraError(f"{self.path}: holds no tensors: not a LoRA")
        return parts

    def _lycoris_pair(self, name: str, slot: dict) -> LoraPair:
        """A LoKr or LoHa module, checked from its header (models/lora/lycoris.py)."""
        lyco = slot["lyco"]
        kinds = sorted({KIND_OF_PART[p] for p in lyco})

        def fail(text):
            raise LoraError(f"{self.path}: module {name!r} ({'/'.join(KIND_NAMES[k] for k in kinds)}) "
                            f"{text}")
        if len(kinds) > 1:
            fail("mixes LoKr (lokr_*) and LoHa (hada_*) keys")
        if "up" in slot or "down" in slot:
            fail("has both a LoRA pair (lora_up/lora_down or lora_B/lora_A) and LyCORIS keys")
        for k in lyco.values():
            if self._st.dtype(k) not in FLOAT_DTYPES:
                fail(f"key {k!r} has dtype {self._st.dtype(k)}; a LoRA weight must be one of "
                     f"{', '.join(FLOAT_DTYPES)}")
        sh = check_shapes(kinds[0], lyco, self._st.shape, fail)
        if sh.dim is not None and sh.dim > MAX_RANK:
            fail(f"rank {sh.dim}; at most {MAX_RANK} is applied")
        alpha = self._alpha(slot)
        return LoraPair(name, kinds[0], "", "", sh.out_features, sh.dim or 0, sh.in_features, alpha, kinds[0],
                        tuple(sorted(lyco.items())), sh.runtime_rank)

    def _pair(self, name: str, slot: dict) -> LoraPair:
        up, down = slot["up"][0], slot["down"][0]
        for k in (up, down):
            dt = self._st.dtype(k)
            if dt not in FLOAT_DTYPES:
                raise LoraError(f"{self.path}: key {k!r} has dtype {dt}; a LoRA weight must be one of "
                                f"{', '.join(FLOAT_DTYPES)}")
        su, sd = self._st.shape(up), self._st.shape(down)
        if len(su) != 2 or len(sd) != 2:
            raise LoraError(f"{self.path}: module {name!r}: up {list(su)} and down {list(sd)} must both be 2-D "
                            "(a LoRA of a Linear layer; Anima has no convolution a LoRA may target)")
        if su[1] != sd[0] or su[1] == 0:
            raise LoraError(f"{self.path}: module {name!r}: up {list(su)} and down {list(sd)} do not chain (up is "
                            "[out, rank], down [rank, in])")
        if su[1] > MAX_RANK:
            raise LoraError(f"{self.path}: module {name!r}: rank {su[1]} (up {list(su)}, down {list(sd)}); at most "
                            f"{MAX_RANK} is applied")
        alpha = self._alpha(slot)
        return LoraPair(name, slot["up"][1], up, down, int(su[0]), int(su[1]), int(sd[1]), alpha)

    def _alpha(self, slot: dict) -> Optional[float]:
        """NAME.alpha as a number, None when the file has none."""
        if "alpha" not in slot:
            return None
        k = slot["alpha"][0]
        shape = self._st.shape(k)
        if self._st.dtype(k) not in FLOAT_DTYPES + ("I64", "I32", "I16", "I8", "U8") or math.prod(shape) != 1:
            raise LoraError(f"{self.path}: key {k!r}: alpha must be one number, got {self._st.dtype(k)} "
                            f"{list(shape)}")
        alpha = float(self._st.get(k, np.float64).reshape(()))
        if not math.isfinite(alpha):
            raise LoraError(f"{self.path}: key {k!r}: alpha is {alpha}")
        return alpha

    # -- data ----------------------------------------------------------------------------------------------------
    def up(self, pair: LoraPair) -> np.ndarray:
        """up [out, r] as f32 (a fresh array), checked finite."""
        return self._array(pair.up_key)

    def down(self, pair: LoraPair) -> np.ndarray:
        """down [r, in] as f32 (a fresh array), checked finite."""
        return self._array(pair.down_key)

    def arrays(self, pair: LoraPair) -> dict:
        """Every array of one module, f32, checked finite: {"up", "down"} of a pair, {part: array} of LoKr/LoHa."""
        if pair.kind == "lora":
            return {"up": self.up(pair), "down": self.down(pair)}
        return {part: self._array(key) for part, key in pair.parts}

    def product(self, pair: LoraPair) -> np.ndarray:
        """ΔW before scale and strength, [out, in] f32: up @ down, or LoKr's / LoHa's (models/lora/lycoris.py)."""
        if pair.kind == "lora":
            return self.up(pair) @ self.down(pair)
        return lycoris_product(pair.kind, self.arrays(pair))

    def low_rank(self, pair: LoraPair) -> tuple:
        """(up [out, k], down [k, in]) f32 with up @ down = product(pair), k = pair.runtime_rank."""
        if pair.kind == "lora":
            return self.up(pair), self.down(pair)
        return lycoris_low_rank(pair.kind, self.arrays(pair))

    def _array(self, key: str) -> np.ndarray:
        try:
            a = self._st.get(key)
        except (SafeTensorsError, ValueError, OSError) as e:
            raise LoraError(f"{self.path}: key {key!r}: {e}") from None
        if not np.isfinite(a).all():
            raise LoraError(f"{self.path}: key {key!r} holds NaN or Inf")
        return a

    def sha256(self) -> str:
        """sha256 of the whole file (hex), computed once."""
        if self._sha256 is None:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                while True:
                    chunk = f.read(HASH_CHUNK)
                    if not chunk:
                        break
                    h.update(chunk)
            self._sha256 = h.hexdigest()
        return self._sha256

    def __repr__(self) -> str:
        return f"LoraFile({self.path!r}, {len(self.pairs)} pairs, {'/'.join(self.layouts)})"
