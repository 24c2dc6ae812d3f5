"""PNG writing with text metadata (tEXt for Latin-1 values, iTXt otherwise), and `decode_to_png`."""
from __future__ import annotations

import json
import logging

import numpy as np
from PIL import Image, PngImagePlugin

from models.durable import atomic_write

log = logging.getLogger(__name__)


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def write_png(path, image: np.ndarray, metadata: dict = None) -> None:
    """image [H, W, 3] uint8 -> PNG at `path` (models.durable.atomic_write); each metadata item becomes a text chunk."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image: expected [H, W, 3] uint8, got {list(image.shape)} {image.dtype}")
    info = PngImagePlugin.PngInfo()
    for k, v in (metadata or {}).items():
        key, text = str(k), _text(v)
        if not 1 <= len(key) <= 79:
            raise ValueError(f"metadata key {key!r}: PNG keywords are 1-79 characters")
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
