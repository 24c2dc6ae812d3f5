"""ComfyUI API-format graphs for tests: the standard Anima text-to-image graph as ComfyUI's "Export (API)" writes it
(node ids, titles and input order as there), with the loaders naming the tiny bundle's files."""
from __future__ import annotations

import copy

TINY_NAMES = {"unet": "anima-tiny.safetensors", "clip": "qwen_3_06b_base-tiny.safetensors",
              "vae": "qwen_image_vae-tiny.safetensors"}


def standard_graph(*, prompt="1girl, silver hair, (blue eyes:1.2)", negative="worst quality", seed=1234, steps=2,
                   cfg=4.0, width=128, height=128, shift_node=True, latent="EmptySD3LatentImage",
                   names=TINY_NAMES) -> dict:
    g = {
        "3": {"inputs": {"seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "sgm_uniform",
                         "denoise": 1, "model": ["15" if shift_node else "12", 0], "positive": ["6", 0],
                         "negative": ["7", 0], "latent_image": ["5", 0]},
              "class_type": "KSampler", "_meta": {"title": "KSampler"}},
        "5": {"inputs": {"width": width, "height": height, "batch_size": 1}, "class_type": latent,
              "_meta": {"title": "Empty Latent"}},
        "6": {"inputs": {"text": prompt, "clip": ["11", 0]}, "class_type": "CLIPTextEncode",
              "_meta": {"title": "Positive"}},
        "7": {"inputs": {"text": negative, "clip": ["11", 0]}, "class_type": "CLIPTextEncode",
              "_meta": {"title": "Negative"}},
        "8": {"inputs": {"samples": ["3", 0], "vae": ["13", 0]}, "class_type": "VAEDecode",
              "_meta": {"title": "VAE Decode"}},
        "9": {"inputs": {"filename_prefix": "anima", "images": ["8", 0]}, "class_type": "SaveImage",
              "_meta": {"title": "Save Image"}},
        "11": {"inputs": {"clip_name": names["clip"], "type": "stable_diffusion", "device": "default"},
               "class_type": "CLIPLoader", "_meta": {"title": "Load CLIP"}},
        "12": {"inputs": {"unet_name": names["unet"], "weight_dtype": "default"}, "class_type": "UNETLoader",
               "_meta": {"title": "Load Diffusion Model"}},
        "13": {"inputs": {"vae_name": names["vae"]}, "class_type": "VAELoader", "_meta": {"title": "Load VAE"}},
    }
    if shift_node:
        g["15"] = {"inputs": {"shift": 3.0, "model": ["12", 0]}, "class_type": "ModelSamplingAuraFlow",
                   "_meta": {"title": "ModelSamplingAuraFlow"}}
    return g


def edited(graph: dict, node: str, **inputs) -> dict:
    """A deep copy of `graph` with inputs of `node` replaced (an input set to ... is removed)."""
    g = copy.deepcopy(graph)
    for k, v in inputs.items():
        if v is ...:
            g[node]["inputs"].pop(k, None)
        else:
            g[node]["inputs"][k] = v
    return g


def two_chains(graph: dict, seed: int = 77, **inputs) -> dict:
    """`graph` (the standard one) with a second independent chain: KSampler 23 (another seed, or other `inputs`)
    -> VAEDecode 28 -> SaveImage 29, sharing the loaders, both prompts and the empty latent (ComfyUI's way to get
    two seeds from one prompt)."""
    g = copy.deepcopy(graph)
    g["23"] = copy.deepcopy(g["3"])
    g["23"]["inputs"].update(seed=seed, **inputs)
    g["28"] = {"inputs": {"samples": ["23", 0], "vae": ["13", 0]}, "class_type": "VAEDecode",
               "_meta": {"title": "VAE Decode"}}
    g["29"] = {"inputs": {"filename_prefix": "second", "images": ["28", 0]}, "class_type": "SaveImage",
               "_meta": {"title": "Save Image"}}
    return g
