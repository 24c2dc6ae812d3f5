"""Open a VAE file in either key layout: detect, validate, and give the decoder's weights as 2D-conv f32 tensors."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from models.dit.checkpoint import LOOKS_LIKE, classify_keys
from models.safetensors_io import SafeTensorsError, SafeTensorsFile
from models.vae.keys import (VAEConfig, VAEKeyError, check_decoder_shapes, decoder_shapes, detect_config,
                             diffusers_per_stage, to_original)

log = logging.getLogger(__name__)

DECODER_MARKERS = {"original": "decoder.conv1.weight", "diffusers": "decoder.conv_in.weight"}


class VAEError(ValueError):
    """A file that is not a usable Qwen-Image / Wan 2.1 VAE; the message names the file and the key."""


@dataclass
class VAEWeights:
    """The decoder's tensors under original-layout names, each conv collapsed to 2D: [out, in, kh, kw] f32."""
    path: str
    layout: str                 # "original" | "diffusers"
    config: VAEConfig
    tensors: dict               # original key -> np.ndarray f32 (gammas flattened to [C])


def detect_layout(keys) -> str:
    """'original' or 'diffusers'; raises VAEError saying what the file looks like otherwise."""
    keys = set(keys)
    for layout, marker in DECODER_MARKERS.items():
        if marker in keys:
            return layout
    kind = classify_keys(keys)
    if kind in ("vae", "vae-diffusers"):
        what = "a VAE without its decoder (no decoder.conv1.weight / decoder.conv_in.weight)"
    else:
        what = LOOKS_LIKE.get(kind, kind) if kind != "unknown" else "no VAE decoder"
        if kind == "dit":
            what = "an Anima DiT checkpoint (x_embedder / blocks.N.*)"
    raise VAEError(f"not a Qwen-Image VAE decoder: the file looks like {what}")


def collapse(key: str, arr: np.ndarray) -> np.ndarray:
    """Causal 3D conv [o, i, t, kh, kw] -> its last temporal tap [o, i, kh, kw]; gamma [C, 1, ...] -> [C]."""
    if key.endswith(".gamma"):
        return np.ascontiguousarray(arr.reshape(arr.shape[0]))
    if arr.ndim == 5:
        # One frame: the causal padding puts zeros in front, so only the last tap meets the input.
        return np.ascontiguousarray(arr[:, :, -1])
    return arr


def load_vae(path) -> VAEWeights:
    """Read a VAE file (original or diffusers layout, with or without the encoder) for the single-image decoder."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                raise VAEError(f"{path}: is a GGUF file (quantized); only safetensors bf16/f16/f32 VAEs are supported")
    except OSError as e:
        raise VAEError(f"{path}: cannot open ({e.strerror})") from None
    try:
        st = SafeTensorsFile(path)
    except SafeTensorsError as e:
        raise VAEError(str(e)) from None
    keys = st.keys()
    try:
        layout = detect_layout(keys)
    except VAEError as e:
        raise VAEError(f"{path}: {e}") from None
    try:
        if layout == "original":
            names = {k: k for k in keys if k.startswith(("decoder.", "conv2."))}
        else:
            per_stage = diffusers_per_stage(keys)
            names = {to_original(k, per_stage): k for k in keys if k.startswith(("decoder.", "post_quant_conv."))}
        shapes = {o: st.shape(k) for o, k in names.items()}
        cfg = detect_config(shapes)
        check_decoder_shapes(cfg, shapes)
    except VAEKeyError as e:
        raise VAEError(f"{path} ({layout} layout): {e}") from None
    tensors = {}
    for okey in decoder_shapes(cfg):                               # time_conv is never read
        fkey = names[okey]
        dtype = st.dtype(fkey)
        if dtype not in ("BF16", "F16", "F32"):
            raise VAEError(f"{path}: tensor {fkey!r} has dtype {dtype}; only bf16/f16/f32 VAEs are supported")
        arr = st.get(fkey)
        if not np.isfinite(arr).all():
            raise VAEError(f"{path}: tensor {fkey!r} has NaN or infinite values")
        tensors[okey] = collapse(okey, arr)
    log.info("VAE %s: %s layout, config %s, %d decoder tensors", path, layout, cfg.to_dict(), len(tensors))
    return VAEWeights(path=path, layout=layout, config=cfg, tensors=tensors)
