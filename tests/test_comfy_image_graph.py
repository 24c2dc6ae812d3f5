"""The ComfyUI graph front's image nodes: LoadImage -> VAEEncode [-> SetLatentNoiseMask with LoadImage's MASK or a
LoadImageMask] -> KSampler, or VAEEncodeForInpaint with such a mask, becomes a job with init_image, mask (ComfyUI's
mask rule, `mask_channel`), grow_mask_by and denoise; other shapes refused in ComfyUI's node_errors on the node at
fault; the job's graph maps back onto the same job; one job run through the real daemon and supervisord with
stand-in stages from a VAEEncodeForInpaint graph whose mask is LoadImage's alpha."""
from __future__ import annotations

import copy
import io
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

from orchestrator.http.comfy_graph import GraphError, graph_to_job, job_to_graph
from orchestrator.http.comfy_nodes import ModelNames, node_table, object_info
from orchestrator.engine.prompt_spec import parse_prompt_obj
from tests.comfy_graphs import TINY_NAMES, edited, standard_graph

NAMES = ModelNames(unet=(TINY_NAMES["unet"],), clip=(TINY_NAMES["clip"],), vae=(TINY_NAMES["vae"],))
SIZES = [(64, 64)]


def image_graph(*, mask: str | None = "image", denoise: float = 0.6, image: str = "t/init.png [input]") -> dict:
    """The standard graph with its EmptyLatentImage ("5") replaced by LoadImage "20" -> VAEEncode "21", and with a
    mask SetLatentNoiseMask "23" taking LoadImage's MASK (mask="image") or LoadImageMask "22" of that channel."""
    g = edited(standard_graph(width=64, height=64), "3", denoise=denoise)
    del g["5"]
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": image}}
    g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
    latent = ["21", 0]
    if mask is not None:
        src = ["20", 1]
        if mask != "image":
            g["22"] = {"class_type": "LoadImageMask", "inputs": {"image": "t/mask.png [input]", "channel": mask}}
            src = ["22", 0]
        g["23"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": latent, "mask": src}}
        latent = ["23", 0]
    g["3"]["inputs"]["latent_image"] = latent
    return g


def inpaint_graph(*, mask: str = "image", grow: int = 6, denoise: float = 0.8) -> dict:
    """image_graph's with VAEEncodeForInpaint "21" (its mask LoadImage's MASK or LoadImageMask "22") for VAEEncode."""
    g = image_graph(mask=mask, denoise=denoise)
    src = g.pop("23")["inputs"]["mask"]
    g["21"] = {"class_type": "VAEEncodeForInpaint",
               "inputs": {"pixels": ["20", 0], "vae": ["13", 0], "mask": src, "grow_mask_by": grow}}
    g["3"]["inputs"]["latent_image"] = ["21", 0]
    return g


def _refused(graph) -> GraphError:
    with pytest.raises(GraphError) as e:
        graph_to_job(graph, names=NAMES, sizes=SIZES)
    json.dumps(e.value.body())
    return e.value


def _custom(err: GraphError, node: str, name: str, words: str) -> None:
    entry = err.node_errors[node]
    assert entry["class_type"] == err_class(node, err)
    details = [e["details"] for e in entry["errors"] if e["type"] == "custom_validation_failed"]
    assert any(d.startswith(f"{name} - ") and words in d for d in details), details


def err_class(node: str, err: GraphError) -> str:
    return err.node_errors[node]["class_type"]


def test_img2img_graph_maps_onto_the_job_fields():
    job = graph_to_job(image_graph(mask=None), names=NAMES, sizes=SIZES)
    assert {k: job.spec.get(k) for k in ("init_image", "mask", "mask_channel", "denoise", "width", "height")} == \
        {"init_image": "t/init.png [input]", "mask": None, "mask_channel": None, "denoise": 0.6, "width": None,
         "height": None}                                    # the size: the pack's (the image is fitted or refused)
    assert (job.nodes["image"], job.nodes["encode"], job.nodes["latent"]) == ("20", "21", "21")
    assert parse_prompt_obj(job.spec, resolution=SIZES).init_image == "t/init.png [input]"


@pytest.mark.parametrize("mask, channel, mask_name, node", [
    ("image", "alpha", "t/init.png [input]", "20"),         # LoadImage's MASK: its own upload, 1 - alpha
    ("red", "red", "t/mask.png [input]", "22"),
    ("alpha", "alpha", "t/mask.png [input]", "22"),
])
def test_a_noise_mask_becomes_the_jobs_mask_with_comfyuis_rule(mask, channel, mask_name, node):
    job = graph_to_job(image_graph(mask=mask, denoise=0.8), names=NAMES, sizes=SIZES)
    assert (job.spec["mask"], job.spec["mask_channel"], job.spec["denoise"]) == (mask_name, channel, 0.8)
    assert (job.nodes["mask"], job.nodes["noise_mask"], job.nodes["latent"]) == (node, "23", "23")


def _resolved(spec: dict) -> dict:
    import msgspec
    return msgspec.to_builtins(parse_prompt_obj(spec, resolution=SIZES))


@pytest.mark.parametrize("mask", [None, "image", "alpha", "green"])
def test_the_jobs_graph_maps_back_onto_the_same_job(mask):
    job = graph_to_job(image_graph(mask=mask), names=NAMES, sizes=SIZES)
    spec = _resolved(job.spec)
    back = job_to_graph(spec, names=NAMES, ids=job.nodes)
    again = graph_to_job(back, names=NAMES, sizes=SIZES)
    assert _resolved(again.spec) == spec
    classes = sorted(n["class_type"] for n in back.values())
    assert "EmptyLatentImage" not in classes and "VAEEncode" in classes
    assert ("SetLatentNoiseMask" in classes) == (mask is not None)
    # a job of prompt.json's own (no graph ids) shows with the canonical ids, and maps back too
    plain = job_to_graph(spec, names=NAMES)
    assert _resolved(graph_to_job(plain, names=NAMES, sizes=SIZES).spec) == spec


@pytest.mark.parametrize("mask", ["image", "red"])
def test_vae_encode_for_inpaint_maps_onto_grow_mask_by_and_back(mask):
    g = inpaint_graph(mask=mask, grow=6)
    job = graph_to_job(g, names=NAMES, sizes=SIZES)
    assert {k: job.spec.get(k) for k in ("init_image", "mask", "mask_channel", "grow_mask_by", "denoise")} == \
        {"init_image": "t/init.png [input]", "mask": "t/init.png [input]" if mask == "image" else "t/mask.png [input]",
         "mask_channel": "alpha" if mask == "image" else "red", "grow_mask_by": 6, "denoise": 0.8}
    assert (job.nodes["encode"], job.nodes["latent"]) == ("21", "21") and "noise_mask" not in job.nodes
    spec = _resolved(job.spec)
    back = job_to_graph(spec, names=NAMES, ids=job.nodes)
    assert back["21"]["class_type"] == "VAEEncodeForInpaint" and back["21"]["inputs"]["grow_mask_by"] == 6
    assert "SetLatentNoiseMask" not in {n["class_type"] for n in back.values()}
    assert _resolved(graph_to_job(back, names=NAMES, sizes=SIZES).spec) == spec
    assert _resolved(graph_to_job(job_to_graph(spec, names=NAMES), names=NAMES, sizes=SIZES).spec) == spec
    bad = copy.deepcopy(g)
    bad["21"]["inputs"]["grow_mask_by"] = 65                                # ComfyUI's max is 64
    assert [x["type"] for x in _refused(bad).node_errors["21"]["errors"]] == ["value_bigger_than_max"]
    with pytest.raises(Exception) as e:
        parse_prompt_obj({"prompt": "x", "init_image": "a.png", "grow_mask_by": 6})
    assert getattr(e.value, "field", None) == "grow_mask_by"


def test_grey_and_grown_mask_match_comfyuis_torch_ops():
    """models.images.inpaint against ComfyUI's own ops in torch (conv2d with a box of ones, clamp, crop, round;
    (x - 0.5) * (1 - round(m)) + 0.5), on a mask with soft values and odd and even boxes."""
    import math
    import torch
    from models.images.inpaint import grey_under, grow_mask
    rng = np.random.default_rng(4)
    mask = (rng.random((40, 24)) > 0.93).astype(np.float32) * rng.choice([0.4, 0.6, 1.0], (40, 24)).astype(np.float32)
    rgb = (rng.integers(0, 256, (40, 24, 3)).astype(np.float32) / 255.0)
    t = torch.from_numpy(mask)[None, None]
    for by in (0, 1, 5, 6, 64):
        if by == 0:
            want = t.round()
        else:
            k = torch.ones((1, 1, by, by))
            want = torch.clamp(torch.nn.functional.conv2d(t.round(), k, padding=math.ceil((by - 1) / 2)), 0, 1)
        want = want[:, :, :40, :24].round()[0, 0].numpy()
        np.testing.assert_array_equal(grow_mask(mask, by), want)
    px = torch.from_numpy(rgb.copy())[None]
    m = (1.0 - t.round()).squeeze(1)
    for i in range(3):
        px[:, :, :, i] -= 0.5
        px[:, :, :, i] *= m
        px[:, :, :, i] += 0.5
    np.testing.assert_array_equal(grey_under(rgb, mask), px[0].numpy())


def test_an_a1111_rule_mask_shows_as_load_image_mask_red():
    spec = _resolved({"prompt": "x", "init_image": "a.png", "mask": "m.png", "denoise": 0.5})
    g = job_to_graph(spec, names=NAMES)
    masks = [n for n in g.values() if n["class_type"] == "LoadImageMask"]
    assert [m["inputs"] for m in masks] == [{"image": "m.png", "channel": "red"}]


def test_the_jobs_ui_workflow_has_comfyuis_load_image_widgets():
    from orchestrator.http.comfy_workflow import api_to_workflow
    spec = _resolved({"prompt": "x", "init_image": "t/a.png [input]", "mask": "t/a.png [input]",
                      "mask_channel": "alpha", "denoise": 0.5})
    wf = api_to_workflow(job_to_graph(spec, names=NAMES))
    loads = [n for n in wf["nodes"] if n["type"] == "LoadImage"]
    assert [n["widgets_values"] for n in loads] == [["t/a.png [input]", "image"]]
    assert [n["type"] for n in wf["nodes"] if n["type"] == "LoadImageMask"] == []   # its own MASK output
    noise = next(n for n in wf["nodes"] if n["type"] == "SetLatentNoiseMask")
    mask_link = next(i["link"] for i in noise["inputs"] if i["name"] == "mask")
    assert [(lk[1], lk[2], lk[5]) for lk in wf["links"] if lk[0] == mask_link] == [(loads[0]["id"], 1, "MASK")]


def test_other_shapes_are_refused_on_the_node_that_asks():
    g = image_graph(mask=None)
    g["30"] = {**copy.deepcopy(g["3"]), "class_type": "KSampler"}          # a first pass, decoded: a second pass
    g["5"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    g["30"]["inputs"]["latent_image"] = ["5", 0]
    g["31"] = {"class_type": "VAEDecode", "inputs": {"samples": ["30", 0], "vae": ["13", 0]}}
    g["21"]["inputs"]["pixels"] = ["31", 0]
    _custom(_refused(g), "21", "pixels", "must be a LoadImage's")
    g = image_graph(mask="red")
    g["23"]["inputs"]["samples"] = ["5", 0]
    g["5"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    _custom(_refused(g), "23", "samples", "must be VAEEncode's")
    g = image_graph(mask=None)
    g["14"] = {"class_type": "VAELoader", "inputs": {"vae_name": TINY_NAMES["vae"]}}
    g["21"]["inputs"]["vae"] = ["14", 0]
    _custom(_refused(g), "21", "vae", "same VAE")
    g = inpaint_graph(mask="image")                                         # a second mask over the inpaint encode
    g["23"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["21", 0], "mask": ["20", 1]}}
    g["3"]["inputs"]["latent_image"] = ["23", 0]
    _custom(_refused(g), "23", "samples", "must be VAEEncode's")


@pytest.mark.parametrize("image", ["../escape.png", "t/../../x.png [input]", "/etc/passwd"])
def test_image_names_that_are_not_uploads_are_refused_on_the_loader(image):
    _custom(_refused(image_graph(mask=None, image=image)), "20", "image", "Invalid image file")


@pytest.mark.parametrize("mask, field, node, name", [
    ("image", "init_image", "20", "image"), ("image", "mask", "20", "image"), ("green", "mask", "22", "image"),
    ("green", "mask_channel", "22", "channel")])
def test_the_daemons_refusal_of_an_image_field_lands_on_its_loader(mask, field, node, name):
    """What the daemon says at submit (a missing upload, a size without a pack) on the node that carries the field."""
    from orchestrator.http.comfy_graph import field_error
    g = image_graph(mask=mask)
    job = graph_to_job(g, names=NAMES, sizes=SIZES)
    err = field_error(g, job, field, f"prompt.json: field '{field}': 96x64 is not the job's 64x64")
    assert list(err.node_errors) == [node]
    assert err.node_errors[node]["errors"][0]["details"] == f"{name} - 96x64 is not the job's 64x64"


def test_the_job_takes_the_uploads_size_as_comfyui_encodes_it(tmp_path):
    """The HTTP front's step after graph_to_job: the upload's size (EXIF orientation applied, as LoadImage does) with a
    pack for it becomes the job's; one without is refused on the LoadImage naming the sizes there are."""
    from PIL import Image
    from orchestrator.http.comfy_graph import sized_to_image
    from orchestrator.engine.inputs import save_upload, upload_size
    im = Image.new("RGB", (96, 64))
    exif = im.getexif()
    exif[0x0112] = 6                                                          # rotated 90 degrees: 64 wide, 96 high
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif)
    save_upload(tmp_path, "input", "t", "init.jpg", buf.getvalue(), overwrite=True)
    size = upload_size(tmp_path, "t/init.jpg [input]")
    assert size == (64, 96)
    assert upload_size(tmp_path, "t/missing.png [input]") is None and upload_size(tmp_path, "../x.png") is None
    g = image_graph(mask=None, image="t/init.jpg [input]")
    sizes = [(64, 64), (64, 96)]
    job = sized_to_image(g, graph_to_job(g, names=NAMES, sizes=sizes), size, sizes)
    assert (job.spec["width"], job.spec["height"]) == (64, 96)
    assert parse_prompt_obj(job.spec, resolution=sizes).height == 96
    with pytest.raises(GraphError) as e:
        sized_to_image(g, graph_to_job(g, names=NAMES, sizes=SIZES), size, SIZES)
    _custom(e.value, "20", "image", "the image is 64x96, a size without a model pack; the sizes with one: 64x64")


def test_the_daemons_refusal_of_grow_mask_by_lands_on_vae_encode_for_inpaint():
    from orchestrator.http.comfy_graph import field_error
    g = inpaint_graph(mask="red")
    err = field_error(g, graph_to_job(g, names=NAMES, sizes=SIZES), "grow_mask_by", "stand-in refusal")
    assert list(err.node_errors) == ["21"] and err.node_errors["21"]["class_type"] == "VAEEncodeForInpaint"
    assert err.node_errors["21"]["errors"][0]["details"] == "grow_mask_by - stand-in refusal"


def test_bad_node_inputs_are_comfyuis_node_errors():
    g = image_graph(mask="red")
    g["22"]["inputs"]["channel"] = "purple"
    assert [x["type"] for x in _refused(g).node_errors["22"]["errors"]] == ["value_not_in_list"]
    g = image_graph(mask="image")
    g["23"]["inputs"]["mask"] = ["20", 0]                                   # LoadImage's IMAGE is not a MASK
    assert [x["type"] for x in _refused(g).node_errors["23"]["errors"]] == ["return_type_mismatch"]
    g = image_graph(mask=None)
    del g["21"]["inputs"]["pixels"]
    assert [x["type"] for x in _refused(g).node_errors["21"]["errors"]] == ["required_input_missing"]
    g = image_graph(mask=None)
    g["20"]["inputs"]["image"] = 5
    assert [x["type"] for x in _refused(g).node_errors["20"]["errors"]] == ["invalid_input_type"]


def test_object_info_lists_the_image_nodes():
    info = object_info(node_table(NAMES))
    assert info["VAEEncode"]["input"]["required"] == {"pixels": ["IMAGE"], "vae": ["VAE"]}
    assert info["SetLatentNoiseMask"]["input"]["required"] == {"samples": ["LATENT"], "mask": ["MASK"]}
    assert info["LoadImage"]["output"] == ["IMAGE", "MASK"]


# ---------------------------------------------------------------- the mask rule, and one job through the flow

W = H = 64


def _png(a: np.ndarray, mode: str) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(a, mode).save(buf, format="PNG")
    return buf.getvalue()


def _rgba(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random pixels and an alpha transparent (0) on whole 8x8 blocks of the left half and 255 elsewhere: ComfyUI
    repaints where 1 - alpha is 1, the left half; bilinear to the latent's size keeps each block's value."""
    rgb = np.random.default_rng(seed).integers(0, 256, (H, W, 3), dtype=np.uint8)
    alpha = np.full((H, W), 255, np.uint8)
    alpha[:, : W // 2] = 0
    return rgb, alpha


def test_load_image_mask_rule_is_read_not_a1111s(tmp_path):
    """The same RGBA upload as prompt.json's mask: A1111's rule repaints where alpha is high, mask_channel alpha
    (LoadImage's MASK) where it is low; the kept mask.png is exactly 255 - alpha."""
    from orchestrator.engine.inputs import save_upload
    from orchestrator.engine.job_inputs import job_inputs, mask_array
    rgb, alpha = _rgba(2)
    alpha[3, 40] = 77                                                         # one translucent pixel
    save_upload(tmp_path, "input", "t", "init.png", _png(np.dstack([rgb, alpha]), "RGBA"), overwrite=True)
    base = {"prompt": "x", "init_image": "t/init.png [input]", "mask": "t/init.png [input]", "width": W, "height": H}
    comfy = mask_array(job_inputs(tmp_path, parse_prompt_obj({**base, "mask_channel": "alpha"}))["mask"])
    np.testing.assert_array_equal(np.round(comfy * 255), 255 - alpha.astype(np.float64))
    a1111 = mask_array(job_inputs(tmp_path, parse_prompt_obj(base))["mask"])
    np.testing.assert_array_equal(a1111, (alpha > 128).astype(np.float32))   # A1111's mask_round


def test_mask_channel_without_a_mask_is_refused_naming_it():
    from orchestrator.engine.prompt_spec import PromptError
    with pytest.raises(PromptError) as e:
        parse_prompt_obj({"prompt": "x", "init_image": "a.png", "mask_channel": "red"})
    assert e.value.field == "mask_channel"
    with pytest.raises(PromptError) as e:
        parse_prompt_obj({"prompt": "x", "init_image": "a.png", "mask": "m.png", "mask_channel": "purple"})
    assert e.value.field == "mask_channel"


@pytest.fixture(scope="module")
def d():
    from tests.doubles_harness import Doubles
    root = Path(tempfile.mkdtemp(prefix="anima-comfy-image-"))
    with Doubles.start(root, [(W, H)]) as d:
        yield d



def test_a_vae_encode_for_inpaint_graph_runs_grey_under_the_mask_with_the_grown_mask(d):
    """The one job through the daemon and the flow (stand-in stages): VAEEncodeForInpaint on LoadImage's MASK
    (1 - alpha, read by mask_channel): the stand-in encoder sees the pixels under the mask grey (its latent: each 8x8
    block's mean of the grey-filled image, computed here), DENOISE gets the mask grown by 6 (ComfyUI's conv2d box,
    then bilinear to the latent's size: torch here; the stand-in scheduler's latent is 2 * init + mask + denoise);
    the PNG keeps a graph that maps back onto the job."""
    import torch
    from orchestrator.engine.inputs import save_upload
    rgb, alpha = _rgba(7)
    alpha[:, : W // 2 + 1] = 0          # one column past a block: grown by 6 it reaches the next latent sample
    save_upload(d.rf.root, "input", "t", "inp.png", _png(np.dstack([rgb, alpha]), "RGBA"), overwrite=True)
    g = inpaint_graph(mask="image", grow=6)
    g["20"]["inputs"]["image"] = "t/inp.png [input]"
    job = graph_to_job(g, names=NAMES, sizes=SIZES)
    name = d.submit({**job.spec, "steps": 3})
    info = d.wait(name)
    assert info.state == "done", info
    jd = d.rf.jobs / name
    init = np.load(jd / "init_latent.npy")
    masked = torch.from_numpy(1.0 - alpha.astype(np.float32) / 255.0)[None, None]
    x = torch.from_numpy(rgb.astype(np.float32) / 255.0)
    x = ((x - 0.5) * (1.0 - masked.round())[0, 0, :, :, None] + 0.5) * 2.0 - 1.0
    want_init = torch.nn.functional.avg_pool2d(x.permute(2, 0, 1)[None].double(), 8)[0].numpy()
    want_init = want_init[[c % 3 for c in range(init.shape[0])]]
    assert np.abs(init - want_init).max() < 1.01e-3                          # the double's jitter is below 1e-3
    assert np.abs(want_init[:, :, : W // 16]).max() < 1e-6                    # grey: 0 in the encoder's range
    grown = torch.clamp(torch.nn.functional.conv2d(masked.round(), torch.ones((1, 1, 6, 6)), padding=3), 0, 1)
    grown = grown[:, :, :H, :W].round()
    noise_mask = torch.nn.functional.interpolate(grown, size=(H // 8, W // 8), mode="bilinear")[0, 0].numpy()
    assert (noise_mask[:, W // 16] == 0.5).all()                            # grown (0 without the grow)
    want = (2 * init + noise_mask[None].astype(np.float32) + np.float32(0.8)).astype(np.float32)
    np.testing.assert_allclose(np.load(jd / "latent.npy"), want, rtol=0, atol=1e-6)
    from PIL import Image
    png = next(p for p in sorted(jd.glob("*.png")) if p.name not in ("init_image.png", "mask.png"))
    with Image.open(png) as im:
        text = dict(im.text)
    anima = json.loads(text["anima"])
    assert (anima["mask_channel"], anima["grow_mask_by"]) == ("alpha", 6)
    graph = json.loads(text["prompt"])                                        # the graph it shows maps back on it
    again = graph_to_job(graph, names=ModelNames(), sizes=SIZES).spec
    keys = ("init_image", "mask", "mask_channel", "grow_mask_by", "denoise")
    assert {k: again.get(k) for k in keys} == {k: job.spec[k] for k in keys}


@pytest.mark.parametrize("size, status", [((128, 128), 200), ((96, 64), 400)])
def test_post_prompt_sizes_the_job_to_the_upload(tmp_path, size, status):
    """POST /prompt over a stand-in daemon (one 128x128 pack): an upload of the pack's size is submitted at it (the
    graph names no size); another is 400 on the LoadImage naming the sizes with a pack, and nothing is submitted."""
    from orchestrator.engine.inputs import save_upload
    from tests.test_graph_front_hardening import Front
    f = Front(tmp_path)
    f.front.rf.root.mkdir(mode=0o700, exist_ok=True)
    rgb = np.zeros((size[1], size[0], 3), np.uint8)
    save_upload(f.front.rf.root, "input", "t", "init.png", _png(rgb, "RGB"), overwrite=True)
    try:
        code, body = f.request("POST", "/prompt", {"prompt": image_graph(mask=None)})
    finally:
        f.front.link = None
    assert code == status, body
    if status == 200:
        prompt = f.link.submitted[0].prompt
        assert (prompt.width, prompt.height, prompt.init_image, prompt.denoise) == (128, 128, "t/init.png [input]", 0.6)
    else:
        assert f.link.submitted == []
        details = [e["details"] for e in body["node_errors"]["20"]["errors"]]
        assert details == ["image - the image is 96x64, a size without a model pack; the sizes with one: 128x128"]