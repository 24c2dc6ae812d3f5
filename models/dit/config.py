"""DiT and LLM-adapter configuration, derived from checkpoint tensor shapes (never hard-coded)."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

# Checkpoint key prefixes stripped on load (older releases: "net.", later ones: "model.diffusion_model.").
DIT_PREFIXES = ("model.diffusion_model.", "net.")
# Training leftovers ignored when present.
IGNORED_PATTERNS = (re.compile(r"^pos_embedder\."), re.compile(r"^accum_"), re.compile(r"\._extra_state$"),
                    re.compile(r"(^|\.)_extra_state$"))


class CheckpointError(ValueError):
    """A file that is not a usable Anima DiT checkpoint (or LLM adapter): here, its tensors do not describe one (the
    message names the key; models/dit/checkpoint.py adds the file)."""


@dataclass(frozen=True)
class DiTConfig:
    blocks: int            # 28 official
    width: int             # D = 2048
    head_dim: int          # 128
    heads: int             # D / head_dim = 16
    ffn_width: int         # 8192
    context_dim: int       # 1024 (LLM adapter output width)
    lora_dim: int          # 256 (AdaLN LoRA rank)
    latent_channels: int   # 16
    patch: int = 2

    @property
    def in_features(self) -> int:
        return (self.latent_channels + 1) * self.patch * self.patch     # 68

    @property
    def out_features(self) -> int:
        return self.latent_channels * self.patch * self.patch           # 64

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DiTConfig":
        return cls(**{k: int(v) for k, v in d.items()})


@dataclass(frozen=True)
class AdapterConfig:
    blocks: int            # 6
    width: int             # 1024 (= DiT context dim)
    heads: int             # 16
    head_dim: int          # 64
    mlp_width: int         # 4096
    source_dim: int        # 1024 (Qwen3 hidden size)
    vocab: int             # 32128 (T5 ids)

    def to_dict(self) -> dict:
        return asdict(self)


def _shape(shapes: dict, key: str) -> tuple:
    if key not in shapes:
        raise CheckpointError(f"missing key {key!r}")
    return tuple(shapes[key])


def block_count(shapes: dict, prefix: str = "blocks.") -> int:
    """Number of distinct `prefix`N indices; they must be 0..N-1."""
    idx = set()
    for k in shapes:
        if k.startswith(prefix):
            head = k[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                idx.add(int(head))
    if not idx:
        raise CheckpointError(f"no '{prefix}N.*' tensors")
    n = max(idx) + 1
    missing = sorted(set(range(n)) - idx)
    if missing:
        raise CheckpointError(f"block indices not contiguous: missing {prefix}{missing[0]}")
    return n


def detect_dit_config(shapes: dict) -> DiTConfig:
    """DiT config from {key: shape} with prefixes already stripped."""
    d, inf = _shape(shapes, "x_embedder.proj.1.weight")
    if inf % 4 != 0 or inf // 4 < 2:
        raise CheckpointError(f"x_embedder.proj.1.weight has {inf} input features, expected (C+1)*4")
    head_dim = _shape(shapes, "blocks.0.self_attn.q_norm.weight")[0]
    if head_dim <= 0 or d % head_dim:
        raise CheckpointError(f"blocks.0.self_attn.q_norm.weight length {head_dim} does not divide width {d}")
    return DiTConfig(
        blocks=block_count(shapes),
        width=d,
        head_dim=head_dim,
        heads=d // head_dim,
        ffn_width=_shape(shapes, "blocks.0.mlp.layer1.weight")[0],
        context_dim=_shape(shapes, "blocks.0.cross_attn.k_proj.weight")[1],
        lora_dim=_shape(shapes, "blocks.0.adaln_modulation_self_attn.1.weight")[0],
        latent_channels=inf // 4 - 1,
    )


def detect_adapter_config(shapes: dict, prefix: str = "llm_adapter.") -> AdapterConfig:
    """LLM-adapter config from {key: shape} (DiT prefixes already stripped)."""
    vocab, width = _shape(shapes, prefix + "embed.weight")
    head_dim = _shape(shapes, prefix + "blocks.0.self_attn.q_norm.weight")[0]
    return AdapterConfig(
        blocks=block_count(shapes, prefix + "blocks."),
        width=width,
        heads=width // head_dim,
        head_dim=head_dim,
        mlp_width=_shape(shapes, prefix + "blocks.0.mlp.0.weight")[0],
        source_dim=_shape(shapes, prefix + "blocks.0.cross_attn.k_proj.weight")[1],
        vocab=vocab,
    )


def expected_dit_shapes(c: DiTConfig) -> dict:
    """Every DiT tensor (adapter excluded) with the shape the config implies: the checklist for validation."""
    D, L = c.width, c.lora_dim
    s = {
        "x_embedder.proj.1.weight": (D, c.in_features),
        "t_embedder.1.linear_1.weight": (D, D),
        "t_embedder.1.linear_2.weight": (3 * D, D),
        "t_embedding_norm.weight": (D,),
        "final_layer.adaln_modulation.1.weight": (L, D),
        "final_layer.adaln_modulation.2.weight": (2 * D, L),
        "final_layer.linear.weight": (c.out_features, D),
    }
    for i in range(c.blocks):
        b = f"blocks.{i}."
        for kind in ("self_attn", "cross_attn", "mlp"):
            s[b + f"adaln_modulation_{kind}.1.weight"] = (L, D)
            s[b + f"adaln_modulation_{kind}.2.weight"] = (3 * D, L)
        for p in ("q", "k", "v", "output"):
            s[b + f"self_attn.{p}_proj.weight"] = (D, D)
        for attn in ("self_attn", "cross_attn"):
            s[b + f"{attn}.q_norm.weight"] = (c.head_dim,)
            s[b + f"{attn}.k_norm.weight"] = (c.head_dim,)
        s[b + "cross_attn.q_proj.weight"] = (D, D)
        s[b + "cross_attn.output_proj.weight"] = (D, D)
        s[b + "cross_attn.k_proj.weight"] = (D, c.context_dim)
        s[b + "cross_attn.v_proj.weight"] = (D, c.context_dim)
        s[b + "mlp.layer1.weight"] = (c.ffn_width, D)
        s[b + "mlp.layer2.weight"] = (D, c.ffn_width)
    return s


def expected_adapter_shapes(a: AdapterConfig, prefix: str = "llm_adapter.") -> dict:
    """Every LLM-adapter tensor (118 for the official config) with its shape."""
    W = a.width
    s = {prefix + "embed.weight": (a.vocab, W), prefix + "out_proj.weight": (W, W), prefix + "out_proj.bias": (W,),
         prefix + "norm.weight": (W,)}
    for i in range(a.blocks):
        b = f"{prefix}blocks.{i}."
        for n in ("norm_self_attn", "norm_cross_attn", "norm_mlp"):
            s[b + n + ".weight"] = (W,)
        for attn, src in (("self_attn", W), ("cross_attn", a.source_dim)):
            s[b + f"{attn}.q_proj.weight"] = (W, W)
            s[b + f"{attn}.k_proj.weight"] = (W, src)
            s[b + f"{attn}.v_proj.weight"] = (W, src)
            s[b + f"{attn}.o_proj.weight"] = (W, W)
            s[b + f"{attn}.q_norm.weight"] = (a.head_dim,)
            s[b + f"{attn}.k_norm.weight"] = (a.head_dim,)
        s[b + "mlp.0.weight"] = (a.mlp_width, W)
        s[b + "mlp.0.bias"] = (a.mlp_width,)
        s[b + "mlp.2.weight"] = (W, a.mlp_width)
        s[b + "mlp.2.bias"] = (W,)
    return s


# Presets for synthetic checkpoints. "full" is the official release; "tiny" keeps every structural choice
# (28 blocks, FFN 4x width, 6 adapter blocks, adapter head dim 64) at small widths; its DiT head dim is 64
# (documented smaller one) so that it has 4 heads, and context_dim != width so transposition bugs show.
# "small" is the smallest DiT ComfyUI's Anima support loads as it is: ComfyUI derives only the width from the
# weights (x_embedder) and fixes the rest for a width other than 2048/5120 (10 blocks, 16 heads, FFN 4x, context
# 1024, AdaLN-LoRA 256) and builds the LLM adapter, the Qwen3 text encoder and the VAE at their real sizes, so the
# adapter here is the full one (and the text encoder and VAE presets of the same name are full size too).
PRESETS = {
    "full": dict(
        dit=DiTConfig(blocks=28, width=2048, head_dim=128, heads=16, ffn_width=8192, context_dim=1024,
                      lora_dim=256, latent_channels=16),
        adapter=AdapterConfig(blocks=6, width=1024, heads=16, head_dim=64, mlp_width=4096, source_dim=1024,
                              vocab=32128),
    ),
    "tiny": dict(
        dit=DiTConfig(blocks=28, width=256, head_dim=64, heads=4, ffn_width=1024, context_dim=128,
                      lora_dim=32, latent_channels=16),
        adapter=AdapterConfig(blocks=6, width=128, heads=2, head_dim=64, mlp_width=512, source_dim=64,
                              vocab=32128),
    ),
    "small": dict(
        dit=DiTConfig(blocks=10, width=256, head_dim=16, heads=16, ffn_width=1024, context_dim=1024,
                      lora_dim=256, latent_channels=16),
        adapter=AdapterConfig(blocks=6, width=1024, heads=16, head_dim=64, mlp_width=4096, source_dim=1024,
                              vocab=32128),
    ),
}
