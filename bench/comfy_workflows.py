"""The ComfyUI API graphs bench/comfy_reference.py --workflow sends, unchanged, to this project's HTTP front and to
ComfyUI, and the input images they load (made here, deterministic, uploaded to both sides under the same names).

Each graph is ComfyUI's own node vocabulary (nodes.py, comfy_extras/nodes_easycache.py): no node of this project's,
no Spectrum node (a ComfyUI graph samples every step), SaveImage as the only output node type (two of them in
two-chains and in the graphs that keep a hires fix's first image). WORKFLOWS maps a name to
(what it is, the graph builder); a builder takes the files, the seed and the size and returns the graph.
"""
from __future__ import annotations

import io

import numpy as np

PROMPT = "1girl, silver hair, blue eyes, (masterpiece:1.2)"
NEGATIVE = "worst quality, low quality"
INIT_IMAGE = "anima_ref_init.png"             # RGB: what VAEEncode / VAEEncodeForInpaint encode
MASKED_IMAGE = "anima_ref_init_masked.png"    # the same RGB with an alpha channel: LoadImage's MASK is 1 - alpha
MASK_IMAGE = "anima_ref_mask.png"             # grey: LoadImageMask(channel red) repaints where it is white
OTHER_IMAGE = "anima_ref_other.png"           # RGB: a second upload, mixed with INIT_IMAGE's latent before sampling


def input_images(width: int, height: int) -> dict:
    """{upload name: PNG bytes}: a smooth colour field with a few shapes (so img2img has structure to keep), the
    same with an alpha hole (a soft-edged disc, transparent = repaint), a grey mask of a rectangle, and another
    picture (a field and a ring) for the mixes of two uploads."""
    from PIL import Image
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    rgb = np.stack([0.2 + 0.6 * u, 0.3 + 0.5 * v * (1 - u), 0.8 - 0.5 * v], -1)
    disc = (x - 0.35 * width) ** 2 + (y - 0.4 * height) ** 2 < (0.18 * min(width, height)) ** 2
    rgb[disc] = (0.95, 0.85, 0.3)
    rgb[(x > 0.6 * width) & (x < 0.8 * width) & (y > 0.55 * height)] = (0.15, 0.2, 0.5)
    pixels = np.clip(np.round(rgb * 255), 0, 255).astype(np.uint8)
    r = np.hypot(x - 0.6 * width, y - 0.35 * height) / (0.22 * min(width, height))
    alpha = np.clip(np.round(255 * np.clip((r - 0.8) / 0.4, 0, 1)), 0, 255).astype(np.uint8)
    mask = np.zeros((height, width), np.uint8)
    mask[int(0.25 * height):int(0.7 * height), int(0.15 * width):int(0.55 * width)] = 255

    def png(a: np.ndarray, mode: str) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(a, mode).save(buf, format="PNG")
        return buf.getvalue()
    other = np.stack([0.9 - 0.7 * v, 0.25 + 0.6 * u * v, 0.2 + 0.5 * (1 - u)], -1)     # another field, a ring
    ring = np.abs(np.hypot(x - 0.5 * width, y - 0.6 * height) - 0.25 * min(width, height)) < 0.05 * min(width, height)
    other[ring] = (0.1, 0.7, 0.2)
    other = np.clip(np.round(other * 255), 0, 255).astype(np.uint8)
    return {INIT_IMAGE: png(pixels, "RGB"), MASKED_IMAGE: png(np.dstack([pixels, alpha]), "RGBA"),
            MASK_IMAGE: png(mask, "L"), OTHER_IMAGE: png(other, "RGB")}


def _base(files: dict, prompt: str = PROMPT, negative: str = NEGATIVE) -> dict:
    """Loaders, the prompt pair and ModelSamplingAuraFlow (shift 3): ids 1-5 and 7, as ComfyUI's Anima template."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": files["dit"], "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": files["text_encoder"], "type": "stable_diffusion"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": files["vae"]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": ["2", 0]}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": negative, "clip": ["2", 0]}},
        "7": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["1", 0], "shift": 3.0}},
    }


def _ksampler(latent: list, seed: int, steps: int, cfg: float, sampler: str, scheduler: str, denoise: float,
              model: list | None = None) -> dict:
    return {"class_type": "KSampler", "inputs": {"model": model or ["7", 0], "positive": ["4", 0], "negative": ["5", 0],
                                                 "latent_image": latent, "seed": seed, "steps": steps, "cfg": cfg,
                                                 "sampler_name": sampler, "scheduler": scheduler, "denoise": denoise}}


def _out(graph: dict, samples: list, prefix: str) -> dict:
    graph["9"] = {"class_type": "VAEDecode", "inputs": {"samples": samples, "vae": ["3", 0]}}
    graph["10"] = {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}}
    return graph


def _empty(width: int, height: int, batch: int = 1) -> dict:
    return {"class_type": "EmptySD3LatentImage", "inputs": {"width": width, "height": height, "batch_size": batch}}


def _encoded(graph: dict, image: str) -> list:
    """LoadImage "20" of an upload -> VAEEncode "21"; -> the latent's link."""
    graph["20"] = {"class_type": "LoadImage", "inputs": {"image": image}}
    graph["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["3", 0]}}
    return ["21", 0]


def txt2img(files, seed, width, height, steps=6, cfg=4.0, sampler="euler", scheduler="simple", batch=1, cache=None,
            prompt=PROMPT, negative=NEGATIVE, prefix=None):
    """The standard Anima text-to-image graph; `cache`: {"node": EasyCache|LazyCache, "reuse": threshold, and
    optionally "start"/"end" percents (the node's defaults 0.15 / 0.95)} patched on the model before the KSampler."""
    g = _base(files, prompt, negative)
    g["6"] = _empty(width, height, batch)
    model = ["7", 0]
    if cache is not None:
        g["12"] = {"class_type": cache["node"], "inputs": {"model": ["7", 0], "reuse_threshold": cache["reuse"],
                                                           "start_percent": cache.get("start", 0.15),
                                                           "end_percent": cache.get("end", 0.95),
                                                           "verbose": False}}
        model = ["12", 0]
    g["8"] = _ksampler(["6", 0], seed, steps, cfg, sampler, scheduler, 1.0, model)
    return _out(g, ["8", 0], prefix or f"ref_txt2img_b{batch}")


def img2img(files, seed, width, height):
    g = _base(files)
    g["8"] = _ksampler(_encoded(g, INIT_IMAGE), seed, 6, 4.0, "euler_ancestral", "karras", 0.6)
    return _out(g, ["8", 0], "ref_img2img")


def inpaint_noise_mask(files, seed, width, height):
    g = _base(files)
    g["22"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": _encoded(g, MASKED_IMAGE), "mask": ["20", 1]}}
    g["8"] = _ksampler(["22", 0], seed, 6, 4.0, "euler", "simple", 0.8)
    return _out(g, ["8", 0], "ref_inpaint_mask")


def inpaint_vae(files, seed, width, height):
    g = _base(files)
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": INIT_IMAGE}}
    g["23"] = {"class_type": "LoadImageMask", "inputs": {"image": MASK_IMAGE, "channel": "red"}}
    g["21"] = {"class_type": "VAEEncodeForInpaint", "inputs": {"pixels": ["20", 0], "vae": ["3", 0],
                                                               "mask": ["23", 0], "grow_mask_by": 6}}
    g["8"] = _ksampler(["21", 0], seed, 6, 4.0, "er_sde", "beta", 1.0)
    return _out(g, ["8", 0], "ref_inpaint_vae")


def hires_latent(files, seed, width, height):
    g = _base(files)
    g["6"] = _empty(width, height)
    g["8"] = _ksampler(["6", 0], seed, 6, 4.0, "euler", "simple", 1.0)
    g["24"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["8", 0], "upscale_method": "nearest-exact",
                                                           "scale_by": 1.5}}
    g["25"] = _ksampler(["24", 0], seed, 6, 4.0, "euler", "simple", 0.5)
    return _out(g, ["25", 0], "ref_hires")


def _advanced(latent: list, add_noise: bool, seed: int, steps: int, cfg: float, start: int, end: int,
              leftover: bool, sampler: str = "euler", scheduler: str = "simple") -> dict:
    toggle = lambda on: "enable" if on else "disable"  # noqa: E731
    return {"class_type": "KSamplerAdvanced", "inputs": {
        "model": ["7", 0], "add_noise": toggle(add_noise), "noise_seed": seed, "steps": steps, "cfg": cfg,
        "sampler_name": sampler, "scheduler": scheduler, "positive": ["4", 0], "negative": ["5", 0],
        "latent_image": latent, "start_at_step": start, "end_at_step": end,
        "return_with_leftover_noise": toggle(leftover)}}


def split_cfg(files, seed, width, height):
    """Split sampling: 8 steps over two KSamplerAdvanced, the first (cfg 4) ending at step 4 with its leftover
    noise, the second (cfg 1.5, no noise added) going on from step 4 to the end."""
    g = _base(files)
    g["6"] = _empty(width, height)
    g["8"] = _advanced(["6", 0], True, seed, 8, 4.0, 0, 4, True)
    g["26"] = _advanced(["8", 0], False, seed, 8, 1.5, 4, 10000, False)
    return _out(g, ["26", 0], "ref_split_cfg")


AVERAGE_WITH = "a red fox in a snowy forest at dusk, soft light, detailed fur, (watercolor:1.1), wide shot"


def zero_negative(files, seed, width, height):
    """The negative through ConditioningZeroOut (Anima's LLM adapter still reads the negative's T5 ids)."""
    g = txt2img(files, seed, width, height, prefix="ref_zero_negative")
    g["60"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["5", 0]}}
    g["8"]["inputs"]["negative"] = ["60", 0]
    return g


def average(files, seed, width, height):
    """ConditioningAverage of the prompt (conditioning_to, strength 0.6) and a longer prompt (cut to its length)."""
    g = txt2img(files, seed, width, height, prefix="ref_average")
    g["61"] = {"class_type": "CLIPTextEncode", "inputs": {"text": AVERAGE_WITH, "clip": ["2", 0]}}
    g["62"] = {"class_type": "ConditioningAverage", "inputs": {"conditioning_to": ["4", 0],
                                                               "conditioning_from": ["61", 0],
                                                               "conditioning_to_strength": 0.6}}
    g["8"]["inputs"]["positive"] = ["62", 0]
    return g


def two_chains(files, seed, width, height):
    """Two independent chains on one set of loaders, sharing the negative prompt and the empty latent: the
    txt2img chain (SaveImage "10") and another prompt at seed + 1 with euler_ancestral (SaveImage "30")."""
    g = txt2img(files, seed, width, height, prefix="ref_chain_a")
    g["27"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "1boy, black hair, red eyes, night city",
                                                          "clip": ["2", 0]}}
    g["28"] = _ksampler(["6", 0], seed + 1, 6, 4.0, "euler_ancestral", "simple", 1.0)
    g["28"]["inputs"]["positive"] = ["27", 0]
    g["29"] = {"class_type": "VAEDecode", "inputs": {"samples": ["28", 0], "vae": ["3", 0]}}
    g["30"] = {"class_type": "SaveImage", "inputs": {"images": ["29", 0], "filename_prefix": "ref_chain_b"}}
    return g


def pick_and_crop(files, seed, width, height):
    """LatentFromBatch(-1, 1) of an empty batch of 3 (image 2's noise), then ImageCrop of the decoded image with a
    box past its right and bottom edges (ComfyUI cuts it where the image ends)."""
    g = _base(files)
    g["6"] = _empty(width, height, 3)
    g["31"] = {"class_type": "LatentFromBatch", "inputs": {"samples": ["6", 0], "batch_index": -1, "length": 1}}
    g["8"] = _ksampler(["31", 0], seed, 6, 4.0, "euler", "simple", 1.0)
    g["9"] = {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}}
    g["32"] = {"class_type": "ImageCrop", "inputs": {"image": ["9", 0], "width": width // 2, "height": height,
                                                     "x": width // 4 + 8, "y": height // 8}}
    g["10"] = {"class_type": "SaveImage", "inputs": {"images": ["32", 0], "filename_prefix": "ref_pick_crop"}}
    return g


def hires_base_latent(files, seed, width, height):
    """The latent hires fix with both images saved: a VAEDecode "26" of the first KSampler's latent to SaveImage
    "27" beside the second pass's (ComfyUI's usual 'base + hires' graph)."""
    g = hires_latent(files, seed, width, height)
    g["26"] = {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}}
    g["27"] = {"class_type": "SaveImage", "inputs": {"images": ["26", 0], "filename_prefix": "ref_hires_base"}}
    return g


def hires_base_pixel(files, seed, width, height):
    """The pixel hires fix (VAEDecode "26" -> ImageScaleBy 1.5 lanczos -> VAEEncode -> KSampler denoise 0.5), the
    first image saved by SaveImage "27" from the same VAEDecode the upscale reads."""
    g = _base(files)
    g["6"] = _empty(width, height)
    g["8"] = _ksampler(["6", 0], seed, 6, 4.0, "euler", "simple", 1.0)
    g["26"] = {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}}
    g["27"] = {"class_type": "SaveImage", "inputs": {"images": ["26", 0], "filename_prefix": "ref_pixel_base"}}
    g["28"] = {"class_type": "ImageScaleBy", "inputs": {"image": ["26", 0], "upscale_method": "lanczos",
                                                        "scale_by": 1.5}}
    g["29"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["28", 0], "vae": ["3", 0]}}
    g["25"] = _ksampler(["29", 0], seed, 6, 4.0, "euler", "simple", 0.5)
    return _out(g, ["25", 0], "ref_pixel_hires")


SECOND_PROMPT = "1boy, red jacket, city street at night"


def _conditioned(files, seed, width, height, positive: dict, prefix: str, cfg: float = 4.0, steps: int = 6):
    """txt2img with the KSampler's positive from `positive`'s nodes (node "12" its output), a second
    CLIPTextEncode "11" of SECOND_PROMPT beside the first ("4")."""
    g = _base(files)
    g["11"] = {"class_type": "CLIPTextEncode", "inputs": {"text": SECOND_PROMPT, "clip": ["2", 0]}}
    g.update(positive)
    g["6"] = _empty(width, height)
    g["8"] = _ksampler(["6", 0], seed, steps, cfg, "euler", "simple", 1.0)
    g["8"]["inputs"]["positive"] = ["12", 0]
    return _out(g, ["8", 0], prefix)


def combine(files, seed, width, height, cfg: float = 4.0):
    """ConditioningCombine of two prompts: each its own model pass per step, averaged (comfy/samplers.py)."""
    node = {"12": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["4", 0],
                                                                   "conditioning_2": ["11", 0]}}}
    return _conditioned(files, seed, width, height, node, f"ref_combine_cfg{cfg:g}", cfg=cfg)


def timestep_halves(files, seed, width, height):
    """ConditioningSetTimestepRange: the first prompt for the schedule's first half, the second for the rest,
    combined (at the one sigma both windows hold, both passes run and average)."""
    nodes = {"13": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["4", 0], "start": 0.0,
                                                                             "end": 0.5}},
             "14": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["11", 0], "start": 0.5,
                                                                             "end": 1.0}},
             "12": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["13", 0],
                                                                    "conditioning_2": ["14", 0]}}}
    return _conditioned(files, seed, width, height, nodes, "ref_timestep_halves", steps=8)


def _mixed(files, seed, width, height, node: dict, prefix: str):
    """img2img (denoise 0.6) with `node` ("24": LatentComposite / LatentBlend of the KSampler "8" and the VAEEncode
    "21" it starts from) between the KSampler and VAEDecode."""
    g = _base(files)
    g["8"] = _ksampler(_encoded(g, INIT_IMAGE), seed, 6, 4.0, "euler", "simple", 0.6)
    g["24"] = node
    return _out(g, ["24", 0], prefix)


def composite(files, seed, width, height):
    """LatentComposite of the init image's latent onto the KSampler's at x = height / 4 (on Anima's 5-D latent
    ComfyUI's x moves it down, latent_mix.py), feathered over 32 pixels (4 latent rows)."""
    node = {"class_type": "LatentComposite", "inputs": {"samples_to": ["8", 0], "samples_from": ["21", 0],
                                                        "x": height // 4, "y": 0, "feather": 32}}
    return _mixed(files, seed, width, height, node, "ref_composite")


def blend(files, seed, width, height):
    """LatentBlend: the init image's latent x 0.3 + the KSampler's x 0.7."""
    node = {"class_type": "LatentBlend", "inputs": {"samples1": ["21", 0], "samples2": ["8", 0], "blend_factor": 0.3}}
    return _mixed(files, seed, width, height, node, "ref_blend")


def blend_second(files, seed, width, height):
    """blend's LatentBlend (the init latent 0.3, the img2img result 0.7) into a second KSampler (denoise 0.5)."""
    g = blend(files, seed, width, height)
    g["25"] = _ksampler(["24", 0], seed + 1, 6, 4.0, "euler", "simple", 0.5)
    return _out(g, ["25", 0], "ref_blend_second")


def _two_uploads(g: dict) -> None:
    """LoadImage "20" -> VAEEncode "21" of INIT_IMAGE and LoadImage "22" -> VAEEncode "23" of OTHER_IMAGE."""
    _encoded(g, INIT_IMAGE)
    g["22"] = {"class_type": "LoadImage", "inputs": {"image": OTHER_IMAGE}}
    g["23"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["22", 0], "vae": ["3", 0]}}


def start_composite(files, seed, width, height):
    """LatentComposite before the first KSampler: the second upload's latent pasted onto the first's at x = height / 4
    (down, on Anima's 5-D latent), feathered over 32 pixels; the KSampler (denoise 0.6) starts from it."""
    g = _base(files)
    _two_uploads(g)
    g["24"] = {"class_type": "LatentComposite", "inputs": {"samples_to": ["21", 0], "samples_from": ["23", 0],
                                                           "x": height // 4, "y": 0, "feather": 32}}
    g["8"] = _ksampler(["24", 0], seed, 6, 4.0, "euler", "simple", 0.6)
    return _out(g, ["8", 0], "ref_start_composite")


def start_blend(files, seed, width, height):
    """LatentBlend before the first KSampler: the second upload's latent x 0.35 + the first's x 0.65, repeated to a
    batch of 2 (RepeatLatentBatch), sampled at denoise 0.75 (euler_ancestral / karras)."""
    g = _base(files)
    _two_uploads(g)
    g["24"] = {"class_type": "LatentBlend", "inputs": {"samples1": ["23", 0], "samples2": ["21", 0],
                                                       "blend_factor": 0.35}}
    g["25"] = {"class_type": "RepeatLatentBatch", "inputs": {"samples": ["24", 0], "amount": 2}}
    g["8"] = _ksampler(["25", 0], seed, 6, 4.0, "euler_ancestral", "karras", 0.75)
    return _out(g, ["8", 0], "ref_start_blend")


def combine_zero_average(files, seed, width, height):
    """ConditioningCombine of the prompt and a ConditioningAverage of the second prompt with a longer one (strength
    0.6, from 0.3 of the schedule on), the negative through ConditioningZeroOut: each entry its own pass."""
    nodes = {"61": {"class_type": "CLIPTextEncode", "inputs": {"text": AVERAGE_WITH, "clip": ["2", 0]}},
             "62": {"class_type": "ConditioningAverage", "inputs": {"conditioning_to": ["11", 0],
                                                                    "conditioning_from": ["61", 0],
                                                                    "conditioning_to_strength": 0.6}},
             "63": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["62", 0],
                                                                             "start": 0.3, "end": 1.0}},
             "12": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["4", 0],
                                                                    "conditioning_2": ["63", 0]}},
             "60": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["5", 0]}}}
    g = _conditioned(files, seed, width, height, nodes, "ref_combine_zero_average")
    g["8"]["inputs"]["negative"] = ["60", 0]
    return g


def hires_windows(files, seed, width, height):
    """The latent hires fix (256 -> LatentUpscaleBy 1.5 -> denoise 0.5) with both KSamplers fed one
    ConditioningCombine of two prompts in overlapping ConditioningSetTimestepRange windows (0-0.85, 0.6-1): each
    pass mixes them over its own sigmas (the second pass's run both where the windows overlap)."""
    nodes = {"13": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["4", 0], "start": 0.0,
                                                                             "end": 0.85}},
             "14": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["11", 0], "start": 0.6,
                                                                             "end": 1.0}},
             "12": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["13", 0],
                                                                    "conditioning_2": ["14", 0]}}}
    g = _conditioned(files, seed, width, height, nodes, "ref_hires_windows")
    g["24"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["8", 0], "upscale_method": "nearest-exact",
                                                           "scale_by": 1.5}}
    g["25"] = _ksampler(["24", 0], seed, 6, 4.0, "euler", "simple", 0.5)
    g["25"]["inputs"]["positive"] = ["12", 0]
    return _out(g, ["25", 0], "ref_hires_windows")


def combine_lazycache(files, seed, width, height):
    """ConditioningCombine of two prompts (the second from 0.3 of the schedule on) with LazyCache (reuse 0.2) on the
    model, 12 steps: the cache acts on the CFG-combined prediction, after the entries' mix."""
    nodes = {"13": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["11", 0], "start": 0.3,
                                                                             "end": 1.0}},
             "12": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["4", 0],
                                                                    "conditioning_2": ["13", 0]}}}
    g = _conditioned(files, seed, width, height, nodes, "ref_combine_lazycache", steps=12)
    g["15"] = {"class_type": "LazyCache", "inputs": {"model": ["7", 0], "reuse_threshold": 0.2,
                                                     "start_percent": 0.15, "end_percent": 0.95, "verbose": False}}
    g["8"]["inputs"]["model"] = ["15", 0]
    return g


WORKFLOWS = {
    "txt2img": ("text-to-image, no Spectrum node (euler/simple, 6 steps, cfg 4)", txt2img),
    "img2img": ("LoadImage -> VAEEncode, denoise 0.6, euler_ancestral/karras", img2img),
    "inpaint-mask": ("SetLatentNoiseMask with LoadImage's MASK (alpha), denoise 0.8", inpaint_noise_mask),
    "inpaint-vae": ("VAEEncodeForInpaint (LoadImageMask red, grow 6), er_sde/beta", inpaint_vae),
    "hires-latent": ("256 -> LatentUpscaleBy 1.5 nearest-exact -> second pass denoise 0.5 (384)", hires_latent),
    "hires-base-latent": ("hires-latent with the first pass's image saved too (two SaveImage)", hires_base_latent),
    "hires-base-pixel": ("256 -> VAEDecode (saved) -> ImageScaleBy 1.5 lanczos -> VAEEncode -> denoise 0.5 (384), "
                         "both images saved", hires_base_pixel),
    "batch3": ("EmptySD3LatentImage batch 3, dpmpp_2m/karras", lambda f, s, w, h: txt2img(
        f, s, w, h, sampler="dpmpp_2m", scheduler="karras", batch=3)),
    "easycache": ("EasyCache (reuse 0.2) on the model, 14 steps", lambda f, s, w, h: txt2img(
        f, s, w, h, steps=14, cache={"node": "EasyCache", "reuse": 0.2})),
    "cfg1": ("cfg 1 (one pass per model call)", lambda f, s, w, h: txt2img(f, s, w, h, cfg=1.0)),
    "split-cfg": ("KSamplerAdvanced 0-4 of 8 (cfg 4, leftover noise) -> KSamplerAdvanced 4-end (cfg 1.5, no noise)",
                  split_cfg),
    "zero-negative": ("the negative through ConditioningZeroOut", zero_negative),
    "average": ("ConditioningAverage of two prompts (strength 0.6, the second longer)", average),
    "two-chains": ("two independent chains: txt2img and another prompt, seed + 1, euler_ancestral", two_chains),
    "pick-crop": ("LatentFromBatch -1 of a batch of 3, ImageCrop past the edges", pick_and_crop),
    "combine": ("ConditioningCombine of two prompts (a model pass each), cfg 4", combine),
    "combine-cfg1": ("ConditioningCombine of two prompts at cfg 1 (no negative pass)",
                     lambda f, s, w, h: combine(f, s, w, h, cfg=1.0)),
    "timestep-halves": ("ConditioningSetTimestepRange 0-0.5 / 0.5-1 of two prompts, combined (8 steps)",
                        timestep_halves),
    "composite": ("img2img, then LatentComposite of the init latent onto the result (x 64, feather 32)", composite),
    "blend": ("img2img, then LatentBlend of the init latent (0.3) and the result", blend),
    "start-composite": ("LatentComposite of a second upload's latent onto the first's (x 64, feather 32) before "
                        "the KSampler (denoise 0.6)", start_composite),
    "start-blend": ("LatentBlend of two uploads' latents (0.35) -> RepeatLatentBatch 2 -> KSampler (denoise 0.75, "
                    "euler_ancestral/karras)", start_blend),
    "blend-second": ("blend's LatentBlend into a second KSampler (seed + 1, denoise 0.5)", blend_second),
    "combine-zero-average": ("ConditioningCombine of the prompt and a ConditioningAverage (0.6, from 0.3 on), the "
                             "negative through ConditioningZeroOut", combine_zero_average),
    "hires-windows": ("hires-latent with both KSamplers fed one ConditioningCombine of two windowed prompts "
                      "(0-0.85, 0.6-1)", hires_windows),
    "combine-lazycache": ("ConditioningCombine of two prompts (the second from 0.3 on) with LazyCache (reuse 0.2), "
                          "12 steps", combine_lazycache),
}
