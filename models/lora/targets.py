"""What a LoRA may change: every Linear weight of the models a job runs, under each name a LoRA file gives it.

The names are built from the models' own key lists (a checkpoint's, or the validated key set its config implies:
`expected_dit_shapes` / `expected_adapter_shapes` / Qwen3's `expected_shapes`, which are exactly the keys a checkpoint
that opened has), never from a hand-written list of modules:

    DiT + LLM adapter (strength_model)   lora_unet_<module, dots as underscores>    diffusion_model.<module>
    Qwen3 text encoder (strength_clip)    lora_te_<module under model., dots as _>   text_encoder.qwen3.<module under model.>

so `lora_unet_blocks_3_adaln_modulation_self_attn_1` finds `blocks.3.adaln_modulation_self_attn.1.weight` because that
key exists, and an underscore name two modules would share is refused as ambiguous instead of guessed.

Where a target layer computes (its `place`): `branch` (the NPU branch graphs: q/k/v/output_proj of self- and
cross-attention, mlp.layer1/layer2; run-time low-rank inputs or baked), `host` (the scheduler's FP32 host ops:
embedders, modulation, final layer), `adapter` (the LLM adapter, in the encoder stage), `te` (Qwen3, in the encoder).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from models.lora.file import LoraError
from models.dit.partition import BRANCHES

PLACES = ("branch", "host", "adapter", "te")
MODEL_OF_PLACE = {"branch": "dit", "host": "dit", "adapter": "dit", "te": "te"}   # whose strength applies
ADAPTER_PREFIX = "llm_adapter."
TE_PREFIX = "model."
# name prefixes of each model: kohya's underscore form and ComfyUI's dotted form
DIT_NAME_PREFIXES = ("lora_unet_", "diffusion_model.")
TE_NAME_PREFIXES = ("lora_te_", "text_encoder.qwen3.")
_BRANCH_WEIGHT = re.compile(r"^blocks\.\d+\.(%s)\.(.+)$" % "|".join(re.escape(b.module) for b in BRANCHES))
_BRANCH_SUFFIXES = {b.module: set(b.weights) for b in BRANCHES}
# what other models' LoRAs look like (for the message when nothing matches)
OTHER_MODELS = (("down_blocks", "Stable Diffusion 1.x/2.x/XL (down_blocks/up_blocks)"),
                ("input_blocks", "Stable Diffusion 1.x/2.x/XL (input_blocks)"),
                ("double_blocks", "Flux (double_blocks/single_blocks)"),
                ("single_blocks", "Flux (double_blocks/single_blocks)"),
                ("joint_blocks", "Stable Diffusion 3 (joint_blocks)"),
                ("transformer_blocks", "a diffusers transformer (transformer_blocks: Qwen-Image, SD3, ...)"),
                ("text_model_encoder", "a CLIP text encoder (text_model.encoder)"))


@dataclass(frozen=True)
class Target:
    """One weight a LoRA may update."""
    key: str                  # in its checkpoint: "blocks.3.self_attn.q_proj.weight" (DiT, prefix stripped),
    #                           "llm_adapter.blocks.0.mlp.0.weight", "model.layers.0.self_attn.q_proj.weight" (Qwen3)
    place: str                # "branch" | "host" | "adapter" | "te"
    shape: tuple              # (out, in)

    @property
    def model(self) -> str:
        return MODEL_OF_PLACE[self.place]


PARTS = {"dit": "the diffusion model", "adapter": "the LLM adapter", "te": "the text encoder"}


@dataclass(frozen=True)
class Absent:
    """A name of a model part this run does not hold (e.g. the text encoder for `anima-models forward PACK`)."""
    part: str                 # "dit" | "adapter" | "te" (PARTS)


def place_of(key: str) -> str:
    """Where a DiT-file weight computes: 'branch', 'host' or 'adapter' (keys without the checkpoint prefix)."""
    if key.startswith(ADAPTER_PREFIX):
        return "adapter"
    m = _BRANCH_WEIGHT.match(key)
    if m and m.group(2) in _BRANCH_SUFFIXES[m.group(1)]:
        return "branch"
    return "host"


def _underscored(module: str) -> str:
    return module.replace(".", "_")


class TargetTable:
    """Name -> Target for the weights of a run; built from key -> shape dicts (only 2-D `.weight` keys count).

    dit: the DiT file's keys (prefix stripped) that are part of the run: its own layers, the LLM adapter's
    `llm_adapter.*`, or both (the encoder stage holds the adapter alone); te: the Qwen3 file's keys (`model.*`), or
    None. A name of a part left out is `Absent`, not unknown."""

    def __init__(self, dit: Optional[dict] = None, te: Optional[dict] = None):
        self._names: dict = {}
        self._ambiguous: dict = {}
        dit = dit or {}
        self.has = {"dit": any(not k.startswith(ADAPTER_PREFIX) for k in dit),      # the DiT's own layers
                    "adapter": any(k.startswith(ADAPTER_PREFIX) for k in dit), "te": te is not None}
        self.targets: dict = {}
        for key, shape in dit.items():
            if key.endswith(".weight") and len(shape) == 2:
                t = Target(key, place_of(key), tuple(int(s) for s in shape))
                module = key[:-len(".weight")]
                self._add(t, "lora_unet_" + _underscored(module), "diffusion_model." + module)
        for key, shape in (te or {}).items():
            if key.endswith(".weight") and len(shape) == 2:
                t = Target(key, "te", tuple(int(s) for s in shape))
                module = key[:-len(".weight")]
                rel = module[len(TE_PREFIX):] if module.startswith(TE_PREFIX) else module
                self._add(t, "lora_te_" + _underscored(rel), "text_encoder.qwen3." + rel)

    def _add(self, t: Target, *names: str) -> None:
        self.targets[t.key] = t
        for n in names:
            if n in self._names and self._names[n].key != t.key:
                self._ambiguous[n] = (self._names[n].key, t.key)
            self._names[n] = t

    @classmethod
    def from_configs(cls, dit_cfg=None, adapter_cfg=None, te_shape=None) -> "TargetTable":
        """The table for models of these configs (models.dit.config DiTConfig / AdapterConfig, models.text.qwen3
        Qwen3Shape), each optional: the key sets their checkpoints hold."""
        from models.dit.config import expected_adapter_shapes, expected_dit_shapes
        dit = dict(expected_dit_shapes(dit_cfg)) if dit_cfg is not None else {}
        if adapter_cfg is not None:
            dit.update(expected_adapter_shapes(adapter_cfg, ADAPTER_PREFIX))
        te = None
        if te_shape is not None:
            from models.text.qwen3 import expected_shapes
            te = expected_shapes(te_shape)
        return cls(dit or None, te)

    def lookup(self, name: str, where: str = ""):
        """A file's module name -> Target; Absent for a part this run lacks; None for a name no model has."""
        if name in self._ambiguous:
            a, b = self._ambiguous[name]
            raise LoraError(f"{where}module {name!r} could be {a!r} or {b!r}: the underscore name is ambiguous")
        t = self._names.get(name)
        if t is not None:
            return t
        for p in DIT_NAME_PREFIXES:
            if name.startswith(p):
                rest = name[len(p):]
                if rest.startswith(("llm_adapter_", "llm_adapter.")):
                    return None if self.has["adapter"] else Absent("adapter")
                return None if self.has["dit"] else Absent("dit")
        if name.startswith(TE_NAME_PREFIXES) and not self.has["te"]:
            return Absent("te")
        return None


def looks_like(names) -> str:
    """What model a set of unmatched module names seems to be for ('' when nothing says)."""
    joined = " ".join(names)
    for marker, what in OTHER_MODELS:
        if marker in joined:
            return what
    return ""
