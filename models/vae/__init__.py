"""Qwen-Image (Wan 2.1) VAE decoder and encoder: both key layouts, single-image 2D path, tiling, PNG output, VAE packs.

Names resolve lazily; only `VAEDecoder`, `VAEEncoder` and the methods of `VAE` and `TorchEncoder` import torch (the
pack backends never do).
"""
from models.base.lazy import import_target

_EXPORTS = {
    "VAE": "models.vae.api", "DecodeResult": "models.vae.api",
    "VAEError": "models.vae.checkpoint", "VAEWeights": "models.vae.checkpoint", "load_vae": "models.vae.checkpoint",
    "LATENT_MEAN": "models.vae.latent", "LATENT_STD": "models.vae.latent", "VAEDecoder": "models.vae.decoder",
    "denormalize": "models.vae.latent",
    "VAEConfig": "models.vae.keys",
    "decode_to_png": "models.vae.png", "write_png": "models.vae.png",
    "write_vae": "models.vae.synth",
    "TorchEncoder": "models.vae.encode", "EncodeResult": "models.vae.encode", "check_image": "models.vae.encode",
    "load_vae_encoder": "models.vae.checkpoint", "VAEEncoder": "models.vae.encoder", "normalize": "models.vae.latent",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return import_target(f"{_EXPORTS[name]}:{name}")
    raise AttributeError(f"module 'models.vae' has no attribute {name!r}")
