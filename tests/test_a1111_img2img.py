"""A1111's /sdapi/v1/img2img run as a job: the request's images kept in RUN/temp/a1111/ and named by the job's prompt
(init_image, mask, denoise), the mask blurred and the masked part filled as A1111 does, the original pasted back over
the unmasked part of the returned image; what is not supported yet is 422 naming the field. The job itself is a
stand-in (its image a flat colour) so the paste-back is seen exactly; the flow runs it in tests/test_img2img_flow.py."""
from __future__ import annotations

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
    f.ran = []

    async def run_job(front_, spec):              # the job: a flat green picture with a PNG text chunk
        from PIL.PngImagePlugin import PngInfo
        f.ran.append(spec)
        buf, info = io.BytesIO(), PngInfo()
        info.add_text("parameters", "from the job")
        Image.new("RGB", (spec["width"], spec["height"]), GREEN).save(buf, "PNG", pnginfo=info)
        job = SimpleNamespace(id="job1", spec={**spec, "seed": 5}, info=SimpleNamespace(created=0.0))
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


@pytest.mark.parametrize("edit, field", [
    ({"inpaint_full_res": True}, "inpaint_full_res"), ({"inpaint_full_res": None}, "inpaint_full_res"),
    ({"inpainting_fill": 2}, "inpainting_fill"), ({"inpainting_fill": 3}, "inpainting_fill"),
])
def test_unsupported_inpaint_modes_are_422_naming_the_field(front, edit, field):
    body = _body(mask=b64(png(np.zeros((64, 64), np.uint8))), **edit)
    if edit.get("inpaint_full_res", False) is None:
        body.pop("inpaint_full_res")                                          # A1111's default is true
    status, answer = front.request("POST", "/sdapi/v1/img2img", body)
    assert status == 422 and answer["field"] == field, answer
    assert front.ran == []


def test_png_parameters_name_the_denoising_strength_and_the_mask_blur(front):
    from orchestrator.prompt_spec import parse_prompt_obj
    from orchestrator.report import png_metadata
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
