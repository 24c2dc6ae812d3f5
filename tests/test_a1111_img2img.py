"""A1111's /sdapi/v1/img2img run as a job: the request's images kept in RUN/temp/a1111/ and named by the job's prompt
(init_image, mask, denoise), the mask blurred and the masked part filled as A1111 does, the original pasted back over
the unmasked part of the returned image; what is not supported yet is 422 naming the field. The job itself is a
stand-in (its image a flat colour) so the paste-back is seen exactly; the flow runs it in tests/test_img2img_flow.py."""
from __future__ import annotations

import asyncio
import base64
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tests.test_uploads import Uploads, b64, png

RNG = np.random.default_rng(11)
GREEN = (0, 200, 0)


@pytest.fixture
def front(tmp_path, monkeypatch):
    f = Uploads(tmp_path)
    f.front.rf.root.mkdir(mode=0o700)
    f.link.sizes = ((128, 128), (64, 64))            # the stand-in jobs' size has a pack: checked before decoding
    f.ran = []

    async def run_job(front_, spec, image=1, images=1):   # the job: a flat green picture with a PNG text chunk
        from PIL.PngImagePlugin import PngInfo
        f.ran.append(spec)
        buf, info = io.BytesIO(), PngInfo()
        info.add_text("parameters", "from the job")
        Image.new("RGB", (spec["width"], spec["height"]), GREEN).save(buf, "PNG", pnginfo=info)
        job = SimpleNamespace(id="job1", spec={"seed": 5, **spec}, info=SimpleNamespace(created=0.0))  # 5: drawn
        return job, buf.getvalue()
    monkeypatch.setattr("orchestrator.http.a1111.run_job", run_job)
    yield f


def _body(**kw) -> dict:
    init = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return {"prompt": "a cat", "steps": 3, "width": 64, "height": 64, "init_images": [b64(png(init))],
            "denoising_strength": 0.6, "inpaint_full_res": False, **kw}


def _image(b64_png: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64_png))) as im:
        return np.asarray(im.convert("RGB"))


def _kept(front, ref: str) -> np.ndarray:
    sub, _, rest = ref.partition("/")
    name, kind = rest.rsplit(" [", 1)
    with Image.open(front.front.rf.root / kind.rstrip("]") / sub / name) as im:
        return np.asarray(im)


def _gauss_blur_reference(mask: np.ndarray, sigma: int) -> np.ndarray:
    """cv2.GaussianBlur(mask, (k, 1)) then (1, k), k = 2 * int(2.5 * sigma + 0.5) + 1, reflect-101 borders, by
    explicit loops over pixels and taps (the module convolves whole shifted arrays)."""
    k = 2 * int(2.5 * sigma + 0.5) + 1
    taps = [np.exp(-((i - (k - 1) / 2) ** 2) / (2 * sigma ** 2)) for i in range(k)]
    taps = [t / sum(taps) for t in taps]

    def reflect(i, n):
        while i < 0 or i >= n:
            i = -i if i < 0 else 2 * (n - 1) - i
        return i

    a = mask.astype(np.float64)
    for axis in (1, 0):
        out = np.zeros_like(a)
        n = a.shape[axis]
        for y in range(a.shape[0]):
            for x in range(a.shape[1]):
                pos = x if axis == 1 else y
                acc = 0.0
                for t, w in enumerate(taps):
                    j = reflect(pos + t - k // 2, n)
                    acc += w * (a[y, j] if axis == 1 else a[j, x])
                out[y, x] = acc
        a = np.clip(np.round(out), 0, 255)
    return a.astype(np.uint8)


def test_inpaint_keeps_the_unmasked_area_and_queues_the_blurred_mask(front):
    init = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    status, body = front.request("POST", "/sdapi/v1/img2img", _body(init_images=[b64(png(init))],
                                 mask=b64(png(mask)), mask_blur=4, inpainting_fill=1))
    assert status == 200, body
    spec = front.ran[0]
    assert spec["denoise"] == 0.6 and spec["init_image"].endswith(" [temp]")
    np.testing.assert_array_equal(_kept(front, spec["init_image"]), init)     # fill 1 (original): as sent
    blurred = _gauss_blur_reference(mask, 4)
    assert np.abs(_kept(front, spec["mask"]).astype(int) - blurred).max() <= 1
    out = _image(body["images"][0])
    overlay = np.clip(blurred.astype(np.float32) * 2, 0, 255)
    keep = overlay == 0
    np.testing.assert_array_equal(out[keep], init[keep])                      # A1111's paste-back: the original
    full = overlay == 255
    assert full.any() and (out[full] == GREEN).all()                          # the generated part as generated
    alpha = (255 - overlay[..., None]) / 255.0                               # the edge: blended by the overlay
    blend = alpha * init + (1 - alpha) * np.array(GREEN)
    assert np.abs(out.astype(float) - blend).max() <= 2
    info = json.loads(body["info"])
    assert info["denoising_strength"] == 0.6 and info["infotexts"] == ["from the job, Mask blur: 4"]


def test_inpainting_fill_0_fills_the_masked_part_before_encoding(front):
    init = np.zeros((64, 64, 3), np.uint8)
    init[:, :32] = (200, 10, 10)
    init[:, 32:] = (10, 10, 200)
    mask = np.zeros((64, 64), np.uint8)
    mask[:, 24:40] = 255
    status, body = front.request("POST", "/sdapi/v1/img2img", _body(init_images=[b64(png(init))],
                                 mask=b64(png(mask)), mask_blur=0, inpainting_fill=0))
    assert status == 200, body
    kept = _kept(front, front.ran[0]["init_image"]).astype(int)
    np.testing.assert_array_equal(kept[:, :16], init[:, :16])                 # far from the mask: as it was
    left, right = kept[:, 26], kept[:, 37]                                    # inside: colours from the sides
    assert (left[:, 0] > left[:, 2]).all() and (right[:, 2] > right[:, 0]).all()


def test_img2img_without_mask_returns_the_job_image(front):
    status, body = front.request("POST", "/sdapi/v1/img2img", _body())
    assert status == 200, body
    assert "mask" not in front.ran[0]
    assert (_image(body["images"][0]) == GREEN).all()


@pytest.mark.parametrize("fill, latent_fill", [(2, "noise"), (3, "nothing"), (0, None), (1, None)])
def test_latent_fills_reach_the_job_as_latent_fill(front, fill, latent_fill):
    """inpainting_fill 2 / 3 (latent noise / nothing) were 422; they are the job's latent_fill (what it does to the
    latent: tests/test_img2img_sampling.py), the init image sent as it is."""
    init = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[8:40, 8:40] = 255
    status, body = front.request("POST", "/sdapi/v1/img2img", _body(init_images=[b64(png(init))], mask=b64(png(mask)),
                                 mask_blur=0, inpainting_fill=fill))
    assert status == 200, body
    assert front.ran[0].get("latent_fill") == latent_fill
    if fill != 0:
        np.testing.assert_array_equal(_kept(front, front.ran[0]["init_image"]), init)


def test_only_masked_runs_the_region_around_the_mask_and_pastes_it_back(front):
    """inpaint_full_res (A1111's default) was 422. The job runs on the mask's bounding box widened by the padding
    and grown to the job's aspect ratio, resized to the job's size; its image goes back into that box of the
    original, the rest of the original kept exactly."""
    init = RNG.integers(0, 256, (96, 128, 3), dtype=np.uint8)
    mask = np.zeros((96, 128), np.uint8)
    mask[20:30, 80:100] = 255                       # 20 x 10 pixels
    body = _body(init_images=[b64(png(init))], mask=b64(png(mask)), mask_blur=0, inpainting_fill=1,
                 inpaint_full_res_padding=4)
    body.pop("inpaint_full_res")                    # A1111's default: only masked
    status, answer = front.request("POST", "/sdapi/v1/img2img", body)
    assert status == 200, answer
    # the box by hand: x 76..104, y 16..34 (28 x 18), grown to 1:1 along y by 10 (5 above, 5 below): y 11..39
    box = (76, 11, 104, 39)
    want_init = np.asarray(Image.fromarray(init).crop(box).resize((64, 64), Image.LANCZOS))
    spec = front.ran[0]
    assert (spec["width"], spec["height"]) == (64, 64)
    np.testing.assert_array_equal(_kept(front, spec["init_image"]), want_init)
    want_mask = np.asarray(Image.fromarray(mask).crop(box).resize((64, 64), Image.LANCZOS))
    np.testing.assert_array_equal(_kept(front, spec["mask"]), want_mask)
    out = _image(answer["images"][0])
    assert out.shape == init.shape                  # the original's size, not the job's
    keep = mask == 0
    np.testing.assert_array_equal(out[keep], init[keep])
    assert (out[mask == 255] == GREEN).all()        # the job's (flat green) image, resized into the box
    assert "Inpaint area: Only masked, Masked area padding: 4" in json.loads(answer["info"])["infotexts"][0]


def test_only_masked_with_an_empty_mask_inpaints_the_whole_picture(front):
    init = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    body = _body(init_images=[b64(png(init))], mask=b64(png(np.zeros((64, 64), np.uint8))), inpaint_full_res=True,
                 inpainting_fill=1)
    status, answer = front.request("POST", "/sdapi/v1/img2img", body)
    assert status == 200, answer
    np.testing.assert_array_equal(_kept(front, front.ran[0]["init_image"]), init)
    assert "mask" not in front.ran[0]                  # A1111 switches to img2img: the whole picture repainted
    assert "Inpaint area" not in json.loads(answer["info"])["infotexts"][0]


@pytest.mark.parametrize("box, size, image, want", [
    ((10, 0, 50, 5), (64, 64), (128, 96), (10, 0, 50, 40)),      # at the top edge: pushed down inside the image
    ((10, 90, 50, 95), (64, 64), (128, 96), (10, 56, 50, 96)),   # at the bottom: pushed up
    ((0, 0, 10, 40), (128, 64), (100, 40), (0, 0, 80, 40)),      # wider: grown along x from the left edge
    ((0, 0, 90, 40), (64, 64), (100, 30), (0, 0, 90, 30)),       # taller than the image: cut at its edge
])
def test_expand_region_keeps_the_box_inside_the_image(box, size, image, want):
    from models.images.inpaint import expand_region
    assert expand_region(box, *size, *image) == want


def test_crop_region_is_the_padded_bounding_box():
    from models.images.inpaint import crop_region
    m = np.zeros((20, 30), np.uint8)
    assert crop_region(m, 4) is None
    m[5, 7] = m[9, 12] = 1
    assert crop_region(m, 0) == (7, 5, 13, 10) and crop_region(m, 3) == (4, 2, 16, 13)
    assert crop_region(m, 50) == (0, 0, 30, 20)


def test_png_parameters_name_the_denoising_strength_and_the_mask_blur(front):
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    from orchestrator.http.png_formats import png_metadata
    pack = SimpleNamespace(width=64, height=64, source_name="m.safetensors", source_sha256="ab" * 32)
    spec = parse_prompt_obj({"prompt": "a cat", "seed": 1, "init_image": "a.png", "mask": "m.png", "denoise": 0.6},
                            resolution=(64, 64))
    meta = png_metadata(spec, pack, "j")
    pairs = dict(p.split(": ", 1) for p in meta["parameters"].splitlines()[-1].split(", "))
    assert pairs["Denoising strength"] == "0.6"
    assert json.loads(meta["anima"])["denoise"] == 0.6
    plain = png_metadata(parse_prompt_obj({"prompt": "a cat", "seed": 1}, resolution=(64, 64)), pack, "j")
    assert "Denoising strength" not in plain["parameters"]                   # txt2img: A1111 writes none
    mask = np.zeros((64, 64), np.uint8)
    mask[8:24, 8:24] = 255
    status, body = front.request("POST", "/sdapi/v1/img2img", _body(mask=b64(png(mask)), mask_blur=3))
    assert status == 200, body
    assert json.loads(body["info"])["infotexts"] == ["from the job, Mask blur: 3"]


def test_img2img_batches_run_one_job_per_image_with_a1111s_seeds(front):
    """batch_size x n_iter were 422 on img2img: now each image its own job with seed, seed+1, ... (as txt2img),
    each pasted back, every image answered with its own infotext."""
    init = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[8:40, 8:40] = 255
    status, body = front.request("POST", "/sdapi/v1/img2img", _body(init_images=[b64(png(init))], mask=b64(png(mask)),
                                 mask_blur=0, inpainting_fill=1, seed=40, batch_size=2, n_iter=2))
    assert status == 200, body
    assert [s["seed"] for s in front.ran] == [40, 41, 42, 43]
    assert len(body["images"]) == 4
    for b in body["images"]:
        out = _image(b)
        np.testing.assert_array_equal(out[mask == 0], init[mask == 0])
    info = json.loads(body["info"])
    assert info["batch_size"] == 2 and len(info["infotexts"]) == 4
    status, answer = front.request("POST", "/sdapi/v1/img2img", _body(enable_hr=True))
    assert status == 422 and answer["field"] == "enable_hr"
    status, answer = front.request("POST", "/sdapi/v1/img2img", _body(batch_size=9))
    assert status == 422 and answer["field"] == "batch_size"


def test_img2img_counts_steps_as_a1111_and_its_graph_says_so(front):
    """A1111's img2img at steps 20, denoising_strength 0.5 computes 11 steps (ComfyUI's KSampler denoise 0.5 would
    compute 20): the job's denoise_steps is "a1111", and the ComfyUI graph made of such a job is the equivalent
    KSamplerAdvanced window, which maps back to a job with the same sigmas."""
    from models.sampling.img2img import LatentPlan, plan_sigmas
    from orchestrator.http.comfy_graph import ModelNames, graph_to_job, job_to_graph
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    status, body = front.request("POST", "/sdapi/v1/img2img", _body(steps=20, denoising_strength=0.5))
    assert status == 200, body
    spec = front.ran[0]
    assert spec["denoise_steps"] == "a1111" and spec["denoise"] == 0.5 and spec["steps"] == 20
    full = parse_prompt_obj({**spec, "init_image": "a.png", "seed": 1}, resolution=(64, 64)).to_dict()
    names = ModelNames(unet=("u.safetensors",), clip=("c.safetensors",), vae=("v.safetensors",))
    graph = job_to_graph(full, names=names)
    (ks,) = [n for n in graph.values() if n["class_type"].startswith("KSampler")]
    assert ks["class_type"] == "KSamplerAdvanced" and ks["inputs"]["start_at_step"] == 9
    back = graph_to_job(graph, names=names, sizes=[(64, 64)]).spec

    def sigmas(s):
        return plan_sigmas(s["sampler"], s["scheduler"], s["steps"], 3.0, LatentPlan(
            denoise=s.get("denoise", 1.0), denoise_steps=s.get("denoise_steps", "comfyui"),
            start_step=s.get("start_step"), last_step=s.get("end_step")))
    assert len(sigmas(full)) == 12
    np.testing.assert_array_equal(sigmas(back), sigmas(full))


def test_a_blank_mask_under_only_masked_is_img2img_of_the_resized_init(front):
    """A1111 ("Unable to perform Inpaint Only mask because mask is blank, switch to img2img mode"): an all-black
    mask with inpaint_full_res drops the mask and runs img2img on the init image brought to the job's size by
    resize_mode. It was refused naming init_image (kept at its own 96x64 for a 64x64 job)."""
    from models.images import fit_image
    init = RNG.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    body = _body(init_images=[b64(png(init))], mask=b64(png(np.zeros((64, 96), np.uint8))), inpaint_full_res=True,
                 resize_mode=1)
    status, answer = front.request("POST", "/sdapi/v1/img2img", body)
    assert status == 200, answer
    spec = front.ran[0]
    assert "mask" not in spec and "latent_fill" not in spec
    want = np.asarray(fit_image(Image.fromarray(init, "RGB"), 64, 64, 1))
    np.testing.assert_array_equal(_kept(front, spec["init_image"]), want)
    assert _image(answer["images"][0]).shape == (64, 64, 3)


def test_a_refused_img2img_leaves_no_kept_images(front, monkeypatch):
    """The daemon refuses the job (a field, a full queue): the request's images in RUN/temp/a1111 are removed (a
    queued job has its own copies), unless another request in flight holds the same bytes."""
    from orchestrator.http.common import refuse
    from orchestrator.http import img2img
    folder = front.front.rf.root / "temp" / "a1111"

    async def refused(front_, spec, image=1, images=1):
        front.ran.append((spec["init_image"], sorted(p.name for p in folder.iterdir())))   # there for the SUBMIT
        raise refuse(429, "the queue is full")
    monkeypatch.setattr("orchestrator.http.a1111.run_job", refused)
    mask = np.zeros((64, 64), np.uint8)
    mask[8:20, 8:20] = 255
    body = _body(mask=b64(png(mask)))
    status, answer = front.request("POST", "/sdapi/v1/img2img", body)
    assert status == 429, answer
    ref, listed = front.ran[0]
    assert len(listed) == 2 and list(folder.iterdir()) == []
    held = ref.partition("/")[2].rsplit(" [", 1)[0]
    img2img.HELD[held] += 1                                # another request holds the same init image meanwhile
    try:
        status, _ = front.request("POST", "/sdapi/v1/img2img", body)
        assert status == 429 and [p.name for p in folder.iterdir()] == [held]
    finally:
        img2img.HELD[held] -= 1
        del img2img.HELD[held]
    assert not img2img.HELD


def test_the_mask_blur_is_a1111s_and_its_cost_does_not_grow_with_the_radius():
    """Issue 45 item 5: the blur was a sum of 2 * int(2.5 * blur + 0.5) + 1 shifted copies (321 at mask_blur 64:
    75 s on a 4096² mask); as FFT products it gives the same uint8 mask (checked against the explicit per-pixel
    loop, kernels longer than the line included) and blur 64 costs about what blur 2 does."""
    import time
    from models.images.inpaint import blur_mask
    mask = (RNG.random((40, 48)) > 0.6).astype(np.uint8) * 255
    for sigma in (1, 9, 23):
        assert np.abs(blur_mask(mask, sigma, sigma).astype(int) - _gauss_blur_reference(mask, sigma)).max() <= 1
    big = (RNG.random((1024, 1024)) > 0.5).astype(np.uint8) * 255

    def cost(sigma):
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            blur_mask(big, sigma, sigma)
            best = min(best, time.perf_counter() - t)
        return best
    small, large = cost(2), cost(64)
    assert large < 3 * small, (small, large)                 # the tap sum: ~9x (0.3 s -> 2.7 s here)


def test_img2img_preparation_past_the_image_budget_is_503_with_retry_after(front, monkeypatch):
    """Issue 45 item 5: preparation was bounded by a count (two at once: two 4096² RGBA inpaints took the front past
    1 GB); now by bytes (orchestrator.http.image_budget): a request whose estimate does not fit beside the work under
    way is 503 with Retry-After, and room freed takes it."""
    from aiohttp.test_utils import TestClient, TestServer
    from orchestrator.http import image_budget
    budget = image_budget.ImageBudget()
    monkeypatch.setattr("orchestrator.http.img2img.BUDGET", budget)
    budget.used = budget.total - 1000                   # a 64² request's estimate is more than 1000 bytes

    async def go():
        async with TestClient(TestServer(front.build_app(front.front))) as client:
            r = await client.post("/sdapi/v1/img2img", json=_body())
            return r.status, r.headers.get("Retry-After"), await r.json()
    status, retry, answer = asyncio.run(go())
    assert status == 503 and retry == str(image_budget.RETRY_AFTER_S) and "image work" in answer["error"], answer
    assert front.ran == [] and budget.used == budget.total - 1000
    budget.used = 0
    status, answer = front.request("POST", "/sdapi/v1/img2img", _body())
    assert status == 200 and budget.used == 0, answer


def test_a_job_size_without_a_pack_is_refused_before_the_images_are_decoded(front, monkeypatch):
    """The front fitted the init image to any width x height up to 16384 (a 16384² RGB image: 1 GB in Pillow)
    before the daemon refused the size for having no pack; now the size is checked against the packs first."""
    def no_decoding(*a, **k):
        raise AssertionError("decoded")
    monkeypatch.setattr("orchestrator.http.img2img.load_rgb8", no_decoding)
    status, body = front.request("POST", "/sdapi/v1/img2img", _body(width=16384, height=16384))
    assert status == 422 and body["field"] == "width" and "no model pack" in body["error"], body
    assert front.ran == []


def test_img2img_parameters_echo_what_ran(front):
    """img2img echoed the request as it came (no sampler at all when left out, the seed drawn added): now the job's
    settings in A1111's names, as txt2img's answer gives them; the images stay out of the echo."""
    status, body = front.request("POST", "/sdapi/v1/img2img", _body(sampler_name="DPM++ 2M Karras", seed=-1))
    assert status == 200, body
    ran = {**front.ran[0], "seed": 5}                 # the stand-in job's spec: what ran (seed 5 drawn)
    assert (ran["sampler"], ran["scheduler"]) == ("dpmpp_2m", "karras")
    p = body["parameters"]
    assert {k: p[k] for k in ("sampler_name", "scheduler", "steps", "cfg_scale", "seed", "width", "height")} == {
        "sampler_name": "DPM++ 2M", "scheduler": "Karras", "steps": ran["steps"], "cfg_scale": ran["cfg"],
        "seed": 5, "width": 64, "height": 64}
    assert p["denoising_strength"] == 0.6 and "init_images" not in p and "mask" not in p


def test_decoding_the_init_image_holds_no_float_copy():
    """A 4096² init image was decoded through three float32 copies at once (36 bytes a pixel: ~600 MB; the two
    requests preparing together took the front to 1.37 GB in bench/fuzz_http.py), then one (15): now none, the
    8-bit pixels straight from the file (models.images.load_rgb8: LoadImage's values rounded, the same bytes)."""
    import tracemalloc
    from orchestrator.http import img2img
    n = 1024
    pixels = RNG.integers(0, 256, (n, n, 3), dtype=np.uint8)
    data = png(pixels)
    tracemalloc.start()
    try:
        im = img2img._decoded(data, "init_images[0]")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(np.asarray(im), pixels)                 # the same pixels, 8-bit in and out
    assert peak / (n * n) < 4, f"{peak / (n * n):.1f} bytes a pixel"
