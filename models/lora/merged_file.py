"""A model file with LoRAs merged into its weights: the same keys, the updated ones in FP32, the rest copied as stored
(streamed one tensor at a time). What "the checkpoint with the LoRA merged" means in tests and benches, and a way
to hand a LoRA'd model to a tool that takes no LoRA.

    write_merged("anima.safetensors", plan, "anima+style.safetensors")          # DiT: keys net.* / model.diffusion_*
    write_merged("qwen_3_06b_base.safetensors", plan, "qwen+style.safetensors") # Qwen3: keys model.*
"""
from __future__ import annotations

import os

from models.dit.config import DIT_PREFIXES
from models.lora.plan import LoraPlan
from models.base.safetensors_io import DTYPES, SafeTensorsFile, TensorEntry, write_safetensors


def _target_key(key: str) -> str:
    """A file's key as the LoRA plan names it (DiT prefixes stripped; Qwen3 keys are already so)."""
    for p in DIT_PREFIXES:
        if key.startswith(p):
            return key[len(p):]
    return key


def write_merged(src, plan: LoraPlan, out) -> int:
    """Write `src` with every weight `plan` updates replaced by W + ΔW (F32) to `out`; returns how many changed."""
    st = SafeTensorsFile(src)
    entries, changed = [], 0
    for k in st.keys():
        t = _target_key(k)
        if t in plan.targets:
            changed += 1
            entries.append(TensorEntry(k, "F32", st.shape(k), (lambda k=k, t=t: plan.merged(t, st.get(k)))))
        elif st.dtype(k) in DTYPES:
            entries.append(TensorEntry(k, st.dtype(k), st.shape(k), (lambda k=k: st.raw(k))))
        else:
            raise ValueError(f"{src}: tensor {k!r} has dtype {st.dtype(k)}, which cannot be copied")
    meta = dict(st.metadata)
    meta["anima_lora_merged"] = ",".join(f"{os.path.basename(u.path)}:{u.strength:g}" for u in plan.uses)
    write_safetensors(out, entries, metadata=meta)
    return changed
