"""PNG writing with text metadata (tEXt for Latin-1 values, iTXt otherwise), and `decode_to_png`."""
from __future__ import annotations

import json
import logging

import numpy as np
from PIL import Image, PngImagePlugin

from models.base.durable import atomic_write

log = logging.getLogger(__name__)


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


PNG_KEYWORD_CHARS = (1, 79)


def png_text_problem(key, value) -> str:
    """What makes (key, value) unusable as a PNG text chunk ("" when fine): keywords are 1-79 printable Latin-1
    characters without leading, trailing or double spaces (PNG 11.3.4); text holds no NUL and encodes as UTF-8."""
    if not isinstance(key, str) or not PNG_KEYWORD_CHARS[0] <= len(key) <= PNG_KEYWORD_CHARS[1]:
        return "a PNG keyword is 1-79 characters"
    if any(not (32 <= ord(c) <= 126 or 161 <= ord(c) <= 255) for c in key) or key != key.strip() or "  " in key:
        return "a PNG keyword is printable Latin-1 without leading, trailing or double spaces"
    text = _text(value)
    if "\x00" in text:
        return "PNG text cannot hold NUL"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "text is not encodable as UTF-8 (a lone surrogate?)"
    return ""


def write_png(path, image: np.ndarray, metadata: dict = None) -> None:
    """image [H, W, 3] uint8 -> PNG at `path` (models.base.durable.atomic_write); each metadata item becomes a text chunk."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image: expected [H, W, 3] uint8, got {list(image.shape)} {image.dtype}")
    info = PngImagePlugin.PngInfo()
    for k, v in (metadata or {}).items():
        problem = png_text_problem(k, v)
        if problem:
            raise ValueError(f"metadata key {str(k)[:100]!r}: {problem}")
        key, text = k, _text(v)
        try:
            text.encode("latin-1")
            info.add_text(key, text)                               # tEXt
        except UnicodeEncodeError:
            info.add_itxt(key, text)                               # iTXt (UTF-8)
    pil = Image.fromarray(image, "RGB")
    atomic_write(path, lambda f: pil.save(f, format="PNG", pnginfo=info))


def decode_to_png(vae, latent, path, metadata: dict = None, tile=32, overlap: float = 0.5):
    """Decode a model-space latent [16, h, w] with `vae` (models.vae.VAE) and write the PNG; returns DecodeResult."""
    result = vae.decode(latent, tile=tile, overlap=overlap)
    write_png(path, result.image, metadata)
    log.info("wrote %s (%dx%d)", path, result.image.shape[1], result.image.shape[0])
    return result
