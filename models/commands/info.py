"""`anima-models info FILE`: say what a checkpoint is (DiT, text encoder, VAE, LoRA), its config, dtypes and size.

    anima-models info anima-preview.safetensors
"""
from __future__ import annotations

import collections
import logging
import os
import re

import numpy as np

from models.dit.config import DIT_PREFIXES
from models.dit.checkpoint import LOOKS_LIKE, DiTCheckpoint, check_gguf, classify_keys
from models.base.safetensors_io import SafeTensorsError, SafeTensorsFile

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("file", help="a .safetensors checkpoint")


def _count(pattern: str, keys) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in keys if (m := rx.match(k))})


def describe(path: str) -> list:
    """Lines describing the file; raises ValueError (with the file name) for unreadable or quantized files."""
    check_gguf(path)
    try:
        st = SafeTensorsFile(path)
    except SafeTensorsError as e:
        raise ValueError(str(e)) from None
    keys = st.keys()
    kind = classify_keys(keys)
    dtypes = collections.Counter(st.dtype(k) for k in keys)
    params = sum(int(np.prod(st.shape(k), dtype=np.int64)) for k in keys)
    lines = [f"file: {path} ({os.path.getsize(path) / 2**20:.1f} MiB)"]
    if kind == "dit":
        ck = DiTCheckpoint.open(path)
        prefix = next((p for p in DIT_PREFIXES if any(k.startswith(p) for k in keys)), "")
        lines += [f"kind: Anima DiT (key prefix {prefix or '(none)'!r})",
                  f"config: {ck.config.to_dict()}",
                  f"llm adapter: {ck.adapter_config.to_dict() if ck.adapter_config else 'absent'}"]
    elif kind == "text-encoder":
        p = "model." if any(k.startswith("model.") for k in keys) else ""
        emb = p + "embed_tokens.weight"
        shape = st.shape(emb) if emb in st else None
        layers = _count("^" + re.escape(p) + r"layers\.(\d+)\.", keys)
        lines += [f"kind: text encoder (Qwen3 layout), {layers} layers"
                  + (f", vocab {shape[0]}, hidden {shape[1]}" if shape else "")]
    elif kind in ("vae", "vae-diffusers"):
        lines += [f"kind: VAE ({'diffusers' if kind == 'vae-diffusers' else 'original Wan 2.1'} layout)"
                  + (", decoder only" if not any(k.startswith("encoder.") for k in keys) else "")]
    elif _lora_lines(path) is not None:
        lines += _lora_lines(path)
    else:
        lines += [f"kind: unknown ({LOOKS_LIKE['unknown']})"]
    lines += [f"tensors: {len(keys)}, parameters: {params:,}",
              "dtypes: " + ", ".join(f"{d} x{n}" for d, n in sorted(dtypes.items()))]
    return lines


_BLOCK = re.compile(r"blocks[._](\d+)[._]")
_BRANCH_KINDS = ("self_attn", "cross_attn", "mlp")


def _lora_part(name: str) -> str:
    from models.lora.targets import ADAPTER_PREFIX, DIT_NAME_PREFIXES, TE_NAME_PREFIXES
    for p in DIT_NAME_PREFIXES:
        if name.startswith(p):
            adapter = name[len(p):].startswith((ADAPTER_PREFIX, ADAPTER_PREFIX.replace(".", "_")))
            return "LLM adapter" if adapter else "DiT"
    return "text encoder" if name.startswith(TE_NAME_PREFIXES) else "other"


def _lora_lines(path: str):
    """The lines of a LoRA file (layout, rank, alpha, what it targets), or None when the file is not one."""
    from models.lora.file import LoraError, LoraFile
    try:
        lf = LoraFile(path)
    except LoraError:
        return None
    pairs = list(lf.pairs.values())
    ranks = sorted({p.rank for p in pairs})
    alphas = sorted({p.alpha for p in pairs if p.alpha is not None})
    parts = collections.Counter(_lora_part(p.name) for p in pairs)
    dit = [p.name for p in pairs if _lora_part(p.name) == "DiT"]
    blocks = {int(m.group(1)) for n in dit if (m := _BLOCK.search(n))}
    kinds = [k for k in _BRANCH_KINDS if any(k in n for n in dit)]
    targets = []
    for part, n in parts.most_common():
        more = ""
        if part == "DiT" and blocks:
            more = f" in {len(blocks)} block(s) {min(blocks)}..{max(blocks)}"
            more += f": {', '.join(kinds)}" if kinds else ""
        targets.append(f"{part} x{n}{more}")
    return [f"kind: LoRA ({', '.join(lf.layouts)} layout), {len(pairs)} modules",
            f"rank: {ranks[-1] if len(ranks) == 1 else f'{ranks[0]}..{ranks[-1]}'}"
            + (f", alpha {', '.join(f'{a:g}' for a in alphas[:4])}" if alphas else ", alpha: none (scale 1)"),
            "targets: " + "; ".join(targets)
            + (f"; {len(lf.stray)} key(s) of no pair" if lf.stray else "")]


def run(args) -> int:
    for line in describe(os.fspath(args.file)):
        print(line)
    return 0
