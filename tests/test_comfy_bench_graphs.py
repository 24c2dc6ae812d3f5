"""The graphs bench/comfy_reference.py --workflow sends unchanged to ComfyUI and to this front
(bench/comfy_workflows.py) map onto the jobs they mean in ComfyUI: no Spectrum where the graph has no Spectrum node,
the image, mask rule, grow, denoise, hires pass, batch, step cache and CFG each graph sets; and their input images
are what the graphs assume (an RGBA image whose alpha makes LoadImage's MASK, a grey mask)."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from bench.comfy_workflows import (INIT_IMAGE, MASK_IMAGE, MASKED_IMAGE, PROMPT, SECOND_PROMPT, WORKFLOWS,
                                   input_images)
from orchestrator.comfy_graph import ModelNames, graph_to_job

FILES = {"dit": "anima-small.safetensors", "text_encoder": "qwen_3_06b_base-small.safetensors",
         "vae": "qwen_image_vae-small.safetensors"}
NAMES = ModelNames(unet=(FILES["dit"],), clip=(FILES["text_encoder"],), vae=(FILES["vae"],))
SIZES = [(256, 256), (384, 384)]

# per workflow: the prompt.json fields its graph must come to (None: the field absent or null)
WANT = {
    "txt2img": {"steps": 6, "cfg": 4.0, "sampler": "euler", "scheduler": "simple", "spectrum": False,
                "init_image": None, "hires": None, "cache": None},
    "img2img": {"init_image": INIT_IMAGE, "denoise": 0.6, "sampler": "euler_ancestral", "scheduler": "karras",
                "mask": None, "spectrum": False},
    "inpaint-mask": {"init_image": MASKED_IMAGE, "mask": MASKED_IMAGE, "mask_channel": "alpha", "denoise": 0.8,
                     "grow_mask_by": None},
    "inpaint-vae": {"init_image": INIT_IMAGE, "mask": MASK_IMAGE, "mask_channel": "red", "grow_mask_by": 6,
                    "sampler": "er_sde", "scheduler": "beta"},
    "batch3": {"batch": 3, "sampler": "dpmpp_2m", "scheduler": "karras", "spectrum": False},
    "easycache": {"steps": 14, "spectrum": False},
    "cfg1": {"cfg": 1.0, "spectrum": False},
    "combine": {"positive": [{"text": PROMPT}, {"text": SECOND_PROMPT}], "negative": None, "cfg": 4.0,
                "prompt": PROMPT, "spectrum": False},
    "combine-cfg1": {"positive": [{"text": PROMPT}, {"text": SECOND_PROMPT}], "cfg": 1.0},
    "timestep-halves": {"positive": [{"text": PROMPT, "start": 0.0, "end": 0.5},
                                     {"text": SECOND_PROMPT, "start": 0.5, "end": 1.0}], "steps": 8},
}


def _spec(name: str) -> dict:
    graph = WORKFLOWS[name][1](FILES, 7, 256, 256)
    return graph_to_job(graph, names=NAMES, sizes=SIZES).spec


def _off(v) -> bool:
    return v is None or v is False


@pytest.mark.parametrize("name", sorted(WANT))
def test_a_bench_graph_is_the_job_it_means_in_comfyui(name):
    spec = _spec(name)
    for field, want in WANT[name].items():
        got = spec.get(field)
        if want is None:
            assert _off(got), f"{name}: {field} = {got!r}, the graph sets none"
        else:
            assert got == want, f"{name}: {field} = {got!r}, the graph means {want!r}"


def test_the_bench_graphs_cover_the_step_cache_and_the_hires_pass():
    assert _spec("easycache")["cache"]["kind"] == "easycache"
    assert _spec("easycache")["cache"]["reuse_threshold"] == 0.2
    h = _spec("hires-latent")["hires"]
    assert (h["scale"], h["method"], h["denoise"], h.get("space", "latent")) == (1.5, "nearest-exact", 0.5, "latent")
    assert _spec("hires-latent")["spectrum"] is False           # absent would be prompt.json's default (on)


def test_the_input_images_are_what_the_graphs_load():
    imgs = {k: Image.open(io.BytesIO(v)) for k, v in input_images(256, 256).items()}
    assert {k: (im.mode, im.size) for k, im in imgs.items()} == {
        INIT_IMAGE: ("RGB", (256, 256)), MASKED_IMAGE: ("RGBA", (256, 256)), MASK_IMAGE: ("L", (256, 256))}
    alpha = np.asarray(imgs[MASKED_IMAGE])[..., 3]
    assert (alpha == 0).sum() > 1000 and (alpha == 255).sum() > 10000      # a hole to repaint, the rest kept
    assert np.array_equal(np.asarray(imgs[MASKED_IMAGE])[..., :3], np.asarray(imgs[INIT_IMAGE]))
    grey = np.asarray(imgs[MASK_IMAGE])
    assert set(np.unique(grey)) == {0, 255} and 0.1 < (grey == 255).mean() < 0.5
