"""Open a VAE file in either key layout: detect, validate, and give the decoder's (or the encoder's) weights as 2D-conv
f32 tensors."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from models.dit.checkpoint import LOOKS_LIKE, classify_keys
from models.base.safetensors_io import SafeTensorsError, SafeTensorsFile
from models.vae.keys import (VAEConfig, VAEKeyError, check_decoder_shapes, decoder_shapes, detect_config,
                             diffusers_per_stage, encoder_shapes, to_original)
from models.vae.keys import TOP_ORIG_TO_DIFF

log = logging.getLogger(__name__)

DECODER_MARKERS = {"original": "decoder.conv1.weight", "diffusers": "decoder.conv_in.weight"}
ENCODER_MARKERS = {"original": "encoder.conv1.weight", "diffusers": "encoder.conv_in.weight"}


class VAEError(ValueError):
    """A file that is not a usable Qwen-Image / Wan 2.1 VAE; the message names the file and the key."""


@dataclass
class VAEWeights:
    """The decoder's (or the encoder's) tensors under original-layout names, each conv collapsed to 2D: [out, in, kh, kw] f32."""
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


def _open(path: str) -> SafeTensorsFile:
    try:
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                raise VAEError(f"{path}: is a GGUF file (quantized); only safetensors bf16/f16/f32 VAEs are supported")
    except OSError as e:
        raise VAEError(f"{path}: cannot open ({e.strerror})") from None
    try:
        return SafeTensorsFile(path)
    except SafeTensorsError as e:
        raise VAEError(str(e)) from None


def _original_names(keys, layout: str, prefixes: tuple) -> dict:
    """{original-layout name: the file's name} of the keys under `prefixes` (original-layout prefixes)."""
    if layout == "original":
        return {k: k for k in keys if k.startswith(prefixes)}
    per_stage = diffusers_per_stage(keys)
    theirs = tuple(TOP_ORIG_TO_DIFF.get(p[:-1], p[:-1]) + "." for p in prefixes)     # conv1. -> quant_conv.
    return {to_original(k, per_stage): k for k in keys if k.startswith(theirs)}


def _read(path: str, st: SafeTensorsFile, names: dict, wanted) -> dict:
    """{original key: collapsed f32 array} for every key of `wanted`; dtype and finiteness checked."""
    tensors = {}
    for okey in wanted:
        fkey = names[okey]
        dtype = st.dtype(fkey)
        if dtype not in ("BF16", "F16", "F32"):
            raise VAEError(f"{path}: tensor {fkey!r} has dtype {dtype}; only bf16/f16/f32 VAEs are supported")
        arr = st.get(fkey)
        if not np.isfinite(arr).all():
            raise VAEError(f"{path}: tensor {fkey!r} has NaN or infinite values")
        tensors[okey] = collapse(okey, arr)
    return tensors


def _checked(path: str, st: SafeTensorsFile, encoder: bool) -> tuple:
    """(layout, config, {original name: file name}) of the decoder half, or of the encoder half and `conv1`."""
    keys = st.keys()
    try:
        layout = detect_layout(keys)
    except VAEError as e:
        raise VAEError(f"{path}: {e}") from None
    if encoder and ENCODER_MARKERS[layout] not in keys:
        raise VAEError(f"{path}: a VAE without its encoder (no {ENCODER_MARKERS[layout]}): encoding an image needs "
                       "the whole qwen_image_vae.safetensors")
    try:
        names = _original_names(keys, layout, ("decoder.", "conv2."))
        shapes = {o: st.shape(k) for o, k in names.items()}
        cfg = detect_config(shapes)                                # the decoder tells the config; both halves share it
        check_decoder_shapes(cfg, shapes)
        if encoder:
            names = _original_names(keys, layout, ("encoder.", "conv1."))
            check_decoder_shapes(cfg, {o: st.shape(k) for o, k in names.items()}, encoder_shapes(cfg, None))
    except VAEKeyError as e:
        raise VAEError(f"{path} ({layout} layout): {e}") from None
    return layout, cfg, names


def load_vae(path) -> VAEWeights:
    """Read a VAE file (original or diffusers layout, with or without the encoder) for the single-image decoder."""
    path = os.fspath(path)
    st = _open(path)
    layout, cfg, names = _checked(path, st, encoder=False)
    tensors = _read(path, st, names, decoder_shapes(cfg))           # time_conv is never read
    log.info("VAE %s: %s layout, config %s, %d decoder tensors", path, layout, cfg.to_dict(), len(tensors))
    return VAEWeights(path=path, layout=layout, config=cfg, tensors=tensors)


def load_vae_encoder(path) -> VAEWeights:
    """Read the encoder half and the quant conv `conv1` of a whole VAE file (either layout) for the single-image
    encoder; time_conv is never read (one frame: the temporal downsample keeps the first frame as it is)."""
    path = os.fspath(path)
    st = _open(path)
    layout, cfg, names = _checked(path, st, encoder=True)
    tensors = _read(path, st, names, encoder_shapes(cfg, None))
    log.info("VAE %s: %s layout, config %s, %d encoder tensors", path, layout, cfg.to_dict(), len(tensors))
    return VAEWeights(path=path, layout=layout, config=cfg, tensors=tensors)
