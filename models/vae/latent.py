"""Model-space latent <-> VAE space (the per-channel (de-)normalisation), without torch: every VAE backend uses it."""
from __future__ import annotations

import numpy as np

# Latent de-normalisation, per channel (model space -> VAE space: z_vae = z * std + mean).
LATENT_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
               0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENT_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
              3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


def denormalize(latent: np.ndarray) -> np.ndarray:
    """Model-space latent [16, h, w] -> VAE space [16, h, w] f32."""
    c = latent.shape[0]
    if c != len(LATENT_MEAN):
        raise ValueError(f"latent has {c} channels; the Qwen-Image VAE de-normalisation needs {len(LATENT_MEAN)}")
    mean = np.asarray(LATENT_MEAN, np.float32)[:, None, None]
    std = np.asarray(LATENT_STD, np.float32)[:, None, None]
    return (latent.astype(np.float32) * std + mean).astype(np.float32)


def normalize(z_vae: np.ndarray) -> np.ndarray:
    """VAE space [16, h, w] (the encoder's mean) -> model space [16, h, w] f32: (z - mean) / std, the inverse of
    `denormalize` (ComfyUI's Wan 2.1 latent format `process_in`, scale factor 1)."""
    c = z_vae.shape[0]
    if c != len(LATENT_MEAN):
        raise ValueError(f"latent has {c} channels; the Qwen-Image VAE normalisation needs {len(LATENT_MEAN)}")
    mean = np.asarray(LATENT_MEAN, np.float32)[:, None, None]
    std = np.asarray(LATENT_STD, np.float32)[:, None, None]
    return ((z_vae.astype(np.float32) - mean) / std).astype(np.float32)
