"""`anima-models info FILE`: say what a checkpoint is (DiT, text encoder, VAE), its config, dtypes and size.

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
from models.safetensors_io import SafeTensorsError, SafeTensorsFile

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
    else:
        lines += [f"kind: unknown ({LOOKS_LIKE['unknown']})"]
    lines += [f"tensors: {len(keys)}, parameters: {params:,}",
              "dtypes: " + ", ".join(f"{d} x{n}" for d, n in sorted(dtypes.items()))]
    return lines


def run(args) -> int:
    for line in describe(os.fspath(args.file)):
        print(line)
    return 0
