"""The graphs bench/comfy_reference.py --workflow sends unchanged to ComfyUI and to this front
(bench/comfy_workflows.py) map onto the jobs they mean in ComfyUI: no Spectrum where the graph has no Spectrum node,
the image, mask rule, grow, denoise, hires pass, batch, step cache and CFG each graph sets; and their input images
are what the graphs assume (an RGBA image whose alpha makes LoadImage's MASK, a grey mask)."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from bench.comfy_workflows import (INIT_IMAGE, MASK_IMAGE, MASKED_IMAGE, OTHER_IMAGE, PROMPT, SECOND_PROMPT,
                                   WORKFLOWS, input_images)
from orchestrator.http.comfy_graph import ModelNames, graph_to_job

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
    "split-cfg": {"steps": 8, "cfg": 4.0, "end_step": 4, "leftover_noise": True, "start_step": None, "spectrum": False,
                  "hires": {"steps": 8, "denoise": 1.0, "start_step": 4, "add_noise": False, "cfg": 1.5}},
    "combine": {"positive": [{"text": PROMPT}, {"text": SECOND_PROMPT}], "negative": None, "cfg": 4.0,
                "prompt": PROMPT, "spectrum": False},
    "combine-cfg1": {"positive": [{"text": PROMPT}, {"text": SECOND_PROMPT}], "cfg": 1.0},
    "composite": {"init_image": INIT_IMAGE, "denoise": 0.6, "hires": None,
                  "latent_mix": {"kind": "composite", "onto": "result", "x": 64, "y": 0, "feather": 32}},
    "blend": {"init_image": INIT_IMAGE, "denoise": 0.6, "latent_mix": {"kind": "blend", "onto": "image", "factor": 0.3}},
    "blend-second": {"latent_mix": {"kind": "blend", "onto": "image", "factor": 0.3},
                     "hires": {"steps": 6, "denoise": 0.5, "seed": 8}},
    "start-composite": {"init_image": INIT_IMAGE, "denoise": 0.6, "latent_mix": None, "batch": None,
                        "init_mix": {"image": OTHER_IMAGE, "kind": "composite", "x": 64, "y": 0, "feather": 32}},
    "start-blend": {"init_image": OTHER_IMAGE, "denoise": 0.75, "batch": 2, "sampler": "euler_ancestral",
                    "init_mix": {"image": INIT_IMAGE, "kind": "blend", "factor": 0.35}},
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
        INIT_IMAGE: ("RGB", (256, 256)), MASKED_IMAGE: ("RGBA", (256, 256)), MASK_IMAGE: ("L", (256, 256)),
        OTHER_IMAGE: ("RGB", (256, 256))}
    other = np.asarray(imgs[OTHER_IMAGE]).astype(int)                       # a picture of its own to mix in
    assert np.abs(other - np.asarray(imgs[INIT_IMAGE])).mean() > 40
    alpha = np.asarray(imgs[MASKED_IMAGE])[..., 3]
    assert (alpha == 0).sum() > 1000 and (alpha == 255).sum() > 10000      # a hole to repaint, the rest kept
    assert np.array_equal(np.asarray(imgs[MASKED_IMAGE])[..., :3], np.asarray(imgs[INIT_IMAGE]))
    grey = np.asarray(imgs[MASK_IMAGE])
    assert set(np.unique(grey)) == {0, 255} and 0.1 < (grey == 255).mean() < 0.5


def test_the_two_chain_and_pick_crop_graphs_are_their_jobs():
    """two-chains: two jobs in the graph's order (seed and seed + 1, their own prompt and sampler, one negative and
    empty latent); pick-crop: image 2 of the empty batch of 3 (batch_index 2) cut by ImageCrop."""
    from orchestrator.http.comfy_graph import graph_to_jobs
    a, b = graph_to_jobs(WORKFLOWS["two-chains"][1](FILES, 7, 256, 256), names=NAMES, sizes=SIZES)
    assert (a.output, b.output) == ("10", "30")
    assert (a.spec["seed"], a.spec["sampler"], b.spec["seed"], b.spec["sampler"]) == (7, "euler", 8, "euler_ancestral")
    assert a.spec["prompt"] != b.spec["prompt"] and a.spec["negative_prompt"] == b.spec["negative_prompt"]
    spec = _spec("pick-crop")
    assert (spec.get("batch", 1), spec["batch_index"]) == (1, 2)
    assert spec["crop"] == {"width": 128, "height": 256, "x": 72, "y": 32}


def test_the_base_and_hires_bench_graphs_keep_the_first_image_on_either_path():
    latent, pixel = _spec("hires-base-latent")["hires"], _spec("hires-base-pixel")["hires"]
    assert latent == {**_spec("hires-latent")["hires"], "keep_base": True}
    assert pixel == {"method": "lanczos", "space": "pixel", "scale": 1.5, "steps": 6, "denoise": 0.5,
                     "keep_base": True}
    graph = WORKFLOWS["hires-base-pixel"][1](FILES, 7, 256, 256)
    saves = sorted(k for k, n in graph.items() if n["class_type"] == "SaveImage")
    job = graph_to_job(graph, names=NAMES, sizes=SIZES)
    assert saves == ["10", "27"] and (job.nodes["save"], job.nodes["base_save"]) == ("10", "27")


def test_the_reference_reads_every_output_nodes_images_not_only_the_last():
    from bench.comfy_reference import ComfyClient

    def png(v: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), v, np.uint8)).save(buf, format="PNG")
        return buf.getvalue()
    files = {"base.png": png(1), "image.png": png(2), "image_1.png": png(3)}
    client = ComfyClient("http://127.0.0.1:1", 1.0)
    client.view = lambda item: files[item["filename"]]
    got = client.images({"27": {"images": [{"filename": "base.png"}]},
                         "10": {"images": [{"filename": "image.png"}, {"filename": "image_1.png"}]}})
    assert list(got) == ["10", "27"]
    assert [[int(a[0, 0, 0]) for a in got[k]] for k in got] == [[2, 3], [1]]
