"""The NPU branch partition as data: branch kinds, their inputs/outputs and weights, resolved for a config + resolution."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from models.dit.config import DiTConfig

log = logging.getLogger(__name__)

TEXT_TOKENS = 512          # S of a default pack; a prompt's context is zero-padded to at least this many rows
MAX_TEXT_TOKENS = 4096     # the longest context a pack may take (a 4000-character prompt stays far below)
MASKED = -30000.0          # additive context mask of rows past a prompt (exp underflows to exactly 0; fits f16)
MAX_LORA_RANK = 1024       # the largest LoRA rank a LoRA-ready pack may take (real Anima LoRAs: 4 to 128)
LATENT_SCALE = 8           # image pixels per latent pixel (VAE downsampling)
PATCH = 2                  # latent pixels per token side

# Pack dtype names (CLI / manifest) -> descriptor dtype strings (protocol) -> numpy dtypes.
PACK_DTYPES = {"fp16": "f16", "fp32": "f32"}
NUMPY_DTYPES = {"f16": np.float16, "f32": np.float32}


@dataclass(frozen=True)
class IOSpec:
    """One branch input or output. shape is symbolic (see `symbols`); dtype role "pack" = the pack's dtype.

    lifetime: "call" = new for every call (xn, y); "pass" = one per CFG pass, the same for the whole job (the
    context and its mask); "job" = shared by the passes for the whole job (RoPE tables); "branch" = one per branch
    (block and kind) for the whole job, shared by the passes (a LoRA-ready pack's low-rank factors).
    long_context: present only in packs whose context has more than TEXT_TOKENS rows.
    lora: present only in LoRA-ready packs (lora_rank R > 0)."""
    name: str
    shape: tuple
    dtype: str = "pack"
    lifetime: str = "call"
    long_context: bool = False
    lora: bool = False


@dataclass(frozen=True)
class LoraSpec:
    """One Linear of a branch that a LoRA-ready graph computes as W·x + B·(A·x), A [R, in] and B [out, R] taken as
    inputs in the layout the graph's MatMuls want: Aᵀ [in, R] and Bᵀ [R, out] (so no Transpose or Slice appears).
    split: the weight's rows are split into each head's first and second half in the graph (self-attention q/k,
    for the rotary halves), so Bᵀ comes as two inputs [R, out/2]; qk_scale: the graph folds 1/sqrt(head_dim) into
    the weight (q and k), so B carries it too. models/dit/branch_layout.py turns (B, A) into these inputs."""
    weight: str               # suffix under blocks.{i}.{module}.: "q_proj.weight"
    stem: str                 # input names lora_{kind}_{stem}_a / _b (_b1, _b2 when split)
    in_dim: str               # symbol of the input features
    out_dim: str              # symbol of the output features
    split: bool = False
    qk_scale: bool = False

    def inputs(self, kind: str) -> tuple:
        """The graph inputs (IOSpec) this Linear adds to a LoRA-ready branch of `kind`."""
        p = f"lora_{kind}_{self.stem}"
        a = IOSpec(p + "_a", (self.in_dim, "R"), lifetime="branch", lora=True)
        if self.split:
            half = self.out_dim + "2"
            return a, IOSpec(p + "_b1", ("R", half), lifetime="branch", lora=True), \
                IOSpec(p + "_b2", ("R", half), lifetime="branch", lora=True)
        return a, IOSpec(p + "_b", ("R", self.out_dim), lifetime="branch", lora=True)


def _with_lora(kind: str, inputs: tuple, lora: tuple) -> tuple:
    return inputs + tuple(i for ls in lora for i in ls.inputs(kind))


@dataclass(frozen=True)
class BranchSpec:
    """One branch kind: the checkpoint module it computes and its weights (suffixes under blocks.{i}.{module}.);
    lora: the Linears a LoRA-ready pack adds low-rank inputs to (their inputs are listed in `inputs`)."""
    kind: str
    module: str
    inputs: tuple
    outputs: tuple
    weights: tuple
    lora: tuple = ()

    def lora_spec(self, weight: str) -> "LoraSpec":
        for ls in self.lora:
            if ls.weight == weight:
                return ls
        raise ValueError(f"{self.kind} branch: {weight!r} takes no LoRA; these do: {[ls.weight for ls in self.lora]}")

    def weight_keys(self, block: int) -> list:
        """Full (prefix-stripped) checkpoint keys of this branch in block `block`."""
        return [f"blocks.{block}.{self.module}.{w}" for w in self.weights]


# The Linears a LoRA-ready pack takes low-rank inputs for: sd-scripts' default LoRA targets (q/k/v/output_proj of
# self- and cross-attention, mlp.layer1/layer2); every other layer a LoRA may touch runs on the host or in the
# encoder, where it is merged into FP32 weights per job (docs/lora.md).
_SELF_LORA = (LoraSpec("q_proj.weight", "q", "D", "D", split=True, qk_scale=True),
              LoraSpec("k_proj.weight", "k", "D", "D", split=True, qk_scale=True),
              LoraSpec("v_proj.weight", "v", "D", "D"), LoraSpec("output_proj.weight", "o", "D", "D"))
_CROSS_LORA = (LoraSpec("q_proj.weight", "q", "D", "D", qk_scale=True),
               LoraSpec("k_proj.weight", "k", "Dc", "D", qk_scale=True),
               LoraSpec("v_proj.weight", "v", "Dc", "D"), LoraSpec("output_proj.weight", "o", "D", "D"))
_FFN_LORA = (LoraSpec("layer1.weight", "fc1", "D", "F"), LoraSpec("layer2.weight", "fc2", "F", "D"))

# THE branch table. Per block the branches run in exactly this order; each output feeds the next input through the
# host's x += gate * y. Symbols: L image tokens, S text tokens, D width (D2 = D / 2), Dc context dim, F FFN width,
# HD2 head_dim / 2, R a LoRA-ready pack's LoRA rank.
BRANCHES = (
    BranchSpec(
        kind="self", module="self_attn",
        inputs=_with_lora("self", (IOSpec("xn", ("L", "D")), IOSpec("rope_cos", ("L", "HD2"), lifetime="job"),
                                   IOSpec("rope_sin", ("L", "HD2"), lifetime="job")), _SELF_LORA),
        outputs=(IOSpec("y", ("L", "D")),),
        weights=("q_proj.weight", "k_proj.weight", "v_proj.weight", "output_proj.weight",
                 "q_norm.weight", "k_norm.weight"),
        lora=_SELF_LORA,
    ),
    BranchSpec(
        kind="cross", module="cross_attn",
        # context_mask [S]: 0 for the rows ComfyUI's context has, MASKED for the rows past them (long packs only)
        inputs=_with_lora("cross", (IOSpec("xn", ("L", "D")), IOSpec("context", ("S", "Dc"), lifetime="pass"),
                                    IOSpec("context_mask", ("S",), lifetime="pass", long_context=True)), _CROSS_LORA),
        outputs=(IOSpec("y", ("L", "D")),),
        weights=("q_proj.weight", "k_proj.weight", "v_proj.weight", "output_proj.weight",
                 "q_norm.weight", "k_norm.weight"),
        lora=_CROSS_LORA,
    ),
    BranchSpec(
        kind="ffn", module="mlp",
        inputs=_with_lora("ffn", (IOSpec("xn", ("L", "D")),), _FFN_LORA),
        outputs=(IOSpec("y", ("L", "D")),),
        weights=("layer1.weight", "layer2.weight"),
        lora=_FFN_LORA,
    ),
)
KINDS = tuple(b.kind for b in BRANCHES)               # ("self", "cross", "ffn")
BY_KIND = {b.kind: b for b in BRANCHES}


@dataclass(frozen=True)
class Geometry:
    """Image resolution -> latent and token counts (latent padded to even, then 2x2 patches)."""
    width: int            # image pixels
    height: int
    latent_w: int         # w = W / 8
    latent_h: int         # h = H / 8
    w_tokens: int         # ceil(w / 2)
    h_tokens: int         # ceil(h / 2)
    text_tokens: int = TEXT_TOKENS   # S: context rows the cross-attention graphs take
    lora_rank: int = 0               # R: low-rank inputs per LoRA-ready Linear (0: a plain pack)

    @property
    def tokens(self) -> int:
        """L = h_tokens * w_tokens (512x512 -> 1024)."""
        return self.h_tokens * self.w_tokens

    @classmethod
    def from_resolution(cls, width: int, height: int, text_tokens: int = TEXT_TOKENS,
                        lora_rank: int = 0) -> "Geometry":
        for name, v in (("width", width), ("height", height)):
            if not isinstance(v, (int, np.integer)) or v <= 0 or v % LATENT_SCALE:
                raise ValueError(f"resolution {name} {v!r} must be a positive multiple of {LATENT_SCALE}")
        if not isinstance(text_tokens, (int, np.integer)) or not TEXT_TOKENS <= text_tokens <= MAX_TEXT_TOKENS:
            raise ValueError(f"context {text_tokens!r} must be an integer in [{TEXT_TOKENS}, {MAX_TEXT_TOKENS}]")
        if not isinstance(lora_rank, (int, np.integer)) or isinstance(lora_rank, bool) or \
                not 0 <= lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"LoRA rank {lora_rank!r} must be an integer in [0, {MAX_LORA_RANK}]")
        w, h = int(width) // LATENT_SCALE, int(height) // LATENT_SCALE
        return cls(int(width), int(height), w, h, -(-w // PATCH), -(-h // PATCH), int(text_tokens), int(lora_rank))

    @classmethod
    def from_latent(cls, latent_h: int, latent_w: int) -> "Geometry":
        return cls.from_resolution(latent_w * LATENT_SCALE, latent_h * LATENT_SCALE)

    @property
    def long_context(self) -> bool:
        return self.text_tokens > TEXT_TOKENS

    def to_dict(self) -> dict:
        return {"width": self.width, "height": self.height, "latent_h": self.latent_h, "latent_w": self.latent_w,
                "h_tokens": self.h_tokens, "w_tokens": self.w_tokens, "tokens": self.tokens,
                "text_tokens": self.text_tokens, "lora_rank": self.lora_rank}


def parse_resolution(text: str) -> tuple:
    """"WIDTHxHEIGHT" (e.g. "512x768") -> (width, height); both multiples of 8."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not m:
        raise ValueError(f"resolution {text!r}: expected WIDTHxHEIGHT, e.g. 512x512")
    w, h = int(m.group(1)), int(m.group(2))
    Geometry.from_resolution(w, h)          # validates
    return w, h


def symbols(cfg: DiTConfig, geom: Geometry) -> dict:
    """Values of the symbolic dimensions used in BRANCHES."""
    return {"L": geom.tokens, "S": geom.text_tokens, "D": cfg.width, "D2": cfg.width // 2, "Dc": cfg.context_dim,
            "F": cfg.ffn_width, "HD2": cfg.head_dim // 2, "R": geom.lora_rank}


def pack_io_dtype(pack_dtype: str) -> str:
    """"fp16"|"fp32" -> descriptor dtype "f16"|"f32"."""
    if pack_dtype not in PACK_DTYPES:
        raise ValueError(f"dtype {pack_dtype!r}: choose one of {sorted(PACK_DTYPES)}")
    return PACK_DTYPES[pack_dtype]


def branch_inputs(spec: BranchSpec, geom: Geometry) -> tuple:
    """The inputs a branch graph of this geometry takes (the mask only in long-context packs, the low-rank factors
    only in LoRA-ready ones)."""
    return tuple(i for i in spec.inputs if (geom.long_context or not i.long_context)
                 and (geom.lora_rank > 0 or not i.lora))


def context_rows(t5_tokens: int, text_tokens: int) -> int:
    """Rows of ComfyUI's context for a prompt of `t5_tokens` T5 tokens (it pads to 512, never truncates), as far as
    a pack with `text_tokens` rows holds them."""
    return min(max(int(t5_tokens), TEXT_TOKENS), int(text_tokens))


def context_mask(rows: int, text_tokens: int, dtype=np.float32) -> np.ndarray:
    """[S] additive mask: 0 for the first `rows` context rows, MASKED after them."""
    m = np.zeros(int(text_tokens), dtype=dtype)
    m[int(rows):] = MASKED
    return m


def io_elements(kind: str, sym: dict, long_context: bool = False) -> tuple:
    """(elements of every input, of every output) one call of a branch kind moves, for the symbol values `sym`
    (`symbols`, or a modelled shape's): what the board model prices tensor I/O by. A LoRA-ready graph's factor
    inputs are left out: the board model does not price them as tensor I/O (docs/board.md section 7)."""
    spec = branch_spec(kind)

    def count(specs) -> int:
        try:
            return sum(int(np.prod([sym[d] if isinstance(d, str) else int(d) for d in s.shape])) for s in specs)
        except KeyError as e:
            raise ValueError(f"branch kind {kind!r}: no value for the shape symbol {e.args[0]!r}") from None
    return count([i for i in spec.inputs if (long_context or not i.long_context) and not i.lora]), count(spec.outputs)


def resolve_io(specs, cfg: DiTConfig, geom: Geometry, pack_dtype: str) -> list:
    """[IOSpec] -> [{"name", "shape": [ints], "dtype": "f16"|"f32"}]."""
    sym, dt = symbols(cfg, geom), pack_io_dtype(pack_dtype)
    return [{"name": s.name, "shape": [sym[d] if isinstance(d, str) else int(d) for d in s.shape],
             "dtype": dt if s.dtype == "pack" else s.dtype} for s in specs]


def resolve(kind: str, cfg: DiTConfig, geom: Geometry, pack_dtype: str) -> dict:
    """{"inputs": [...], "outputs": [...]} with concrete shapes and dtypes for one branch kind."""
    spec = branch_spec(kind)
    return {"inputs": resolve_io(branch_inputs(spec, geom), cfg, geom, pack_dtype),
            "outputs": resolve_io(spec.outputs, cfg, geom, pack_dtype)}


def branch_spec(kind: str) -> BranchSpec:
    if kind not in BY_KIND:
        raise ValueError(f"branch kind {kind!r}: choose one of {list(KINDS)}")
    return BY_KIND[kind]


def branch_index(block: int, kind: str) -> int:
    """The place of (block, kind) in the strict execution order (block 0 self = 0, cross = 1, …)."""
    return int(block) * len(KINDS) + KINDS.index(branch_spec(kind).kind)


def branch_file(block: int, kind: str) -> str:
    """File name of one branch graph: b07_cross.onnx."""
    branch_spec(kind)
    return f"b{int(block):02d}_{kind}.onnx"


def parse_branch_file(name: str) -> tuple:
    """The inverse of branch_file: 'b07_cross.onnx' (or .rknn) -> (7, 'cross'); ValueError for other names."""
    stem = name.split(".", 1)[0]
    block, _, kind = stem[1:].partition("_")
    if not name.startswith("b") or not block.isdigit() or kind not in BY_KIND:
        raise ValueError(f"{name!r} is not a branch file name like b07_cross.onnx")
    return int(block), kind


def branch_order(cfg: DiTConfig) -> Iterator:
    """(block, BranchSpec) in the strict execution order: block 0 self, cross, ffn; block 1 ..."""
    for i in range(cfg.blocks):
        for spec in BRANCHES:
            yield i, spec


def parse_blocks(text: str, blocks: int) -> list:
    """"0,3,5-7" or "all" -> sorted block indices, each checked against 0..blocks-1."""
    if text is None or str(text).strip().lower() in ("", "all"):
        return list(range(blocks))
    out = set()
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"blocks {text!r}: bad item {part!r}; expected e.g. 0,3,5-7 or all")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if a > b or b >= blocks:
            raise ValueError(f"blocks {text!r}: {part!r} outside 0..{blocks - 1}")
        out.update(range(a, b + 1))
    return sorted(out)
