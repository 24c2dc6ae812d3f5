"""Issue 27 items 6 and 8, the ways in for images: ComfyUI's /upload/image and /upload/mask (its form fields, the
rename rule "NAME (1).png", overwrite, subfolders, the mask's alpha written into the original), /view of uploads,
LoadImage / LoadImageMask listing the input folder in /object_info, and names that try to leave the input folder
(.., absolute, links, NUL, overlong) or files that are not images: a 400 naming the field, nothing written.

No pipeline: the front's app on aiohttp's test server with the stand-in daemon link of
tests/test_graph_front_hardening.py."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from orchestrator.engine import inputs
from tests.test_graph_front_hardening import Front

RNG = np.random.default_rng(6)


def png(array: np.ndarray, mode: str | None = None, text: dict | None = None) -> bytes:
    meta = PngInfo()
    for k, v in (text or {}).items():
        meta.add_text(k, v)
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, "PNG", pnginfo=meta)
    return buf.getvalue()


PICTURE = png(RNG.integers(0, 256, (8, 12, 3), dtype=np.uint8))
OTHER = png(RNG.integers(0, 256, (8, 12, 3), dtype=np.uint8))


BOUNDARY = "----anima-test-7MA4YWxkTrZu0gW"


def multipart(form: dict) -> tuple[bytes, str]:
    """A multipart/form-data body written byte by byte, file names exactly as given (a browser or curl sends them
    so; aiohttp's own FormData would percent-encode a '/')."""
    out = b""
    for key, value in form.items():
        if isinstance(value, tuple):                         # (file name, bytes[, "rfc5987"])
            name = (f"filename*=UTF-8''{urllib.parse.quote(value[0])}" if value[2:] == ("rfc5987",)
                    else f'filename="{value[0]}"')
            head = f'Content-Disposition: form-data; name="{key}"; {name}\r\nContent-Type: image/png\r\n'
            value = value[:2]
            data = value[1]
        else:
            head, data = f'Content-Disposition: form-data; name="{key}"\r\n', value.encode()
        out += f"--{BOUNDARY}\r\n".encode() + head.encode("utf-8", "surrogatepass") + b"\r\n" + data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode(), f"multipart/form-data; boundary={BOUNDARY}"


class Uploads(Front):
    """Front with multipart requests: `send` runs (method, path, form | params) calls -> [(status, body bytes,
    content type)]."""

    def send(self, calls):
        from aiohttp.test_utils import TestClient, TestServer

        async def go():
            out = []
            async with TestClient(TestServer(self.build_app(self.front))) as client:
                for method, path, arg in calls:
                    if method == "POST":
                        body, ctype = multipart(arg)
                        resp = await client.post(path, data=body, headers={"Content-Type": ctype})
                    else:
                        resp = await client.get(path, params=arg)
                    out.append((resp.status, await resp.read(), resp.content_type))
            return out
        return asyncio.run(go())

    def post(self, path: str, **form) -> tuple[int, dict]:
        status, body, _ = self.send([("POST", path, form)])[0]
        return status, json.loads(body)

    @property
    def input_dir(self):
        return self.front.rf.root / "input"


@pytest.fixture
def front(tmp_path):
    f = Uploads(tmp_path)
    f.front.rf.root.mkdir(mode=0o700)
    f.link.sizes = ((128, 128), (64, 64))            # img2img_body's size has a pack
    yield f


def test_upload_answers_name_subfolder_type_and_writes_the_bytes(front):
    status, body = front.post("/upload/image", image=("cat.png", PICTURE))
    assert (status, body) == (200, {"name": "cat.png", "subfolder": "", "type": "input"})
    assert (front.input_dir / "cat.png").read_bytes() == PICTURE
    status, body = front.post("/api/upload/image", image=("cat.png", PICTURE), subfolder="a/b", type="temp")
    assert (status, body) == (200, {"name": "cat.png", "subfolder": "a/b", "type": "temp"})
    assert (front.front.rf.root / "temp" / "a" / "b" / "cat.png").read_bytes() == PICTURE


def test_taken_name_is_renamed_unless_overwrite_and_same_bytes_keep_the_name(front):
    """ComfyUI: another file under the name -> "cat (1).png", "cat (2).png"; the same bytes again -> the existing
    name, not written twice; overwrite "true" or "1" replaces; any other overwrite value renames."""
    assert front.post("/upload/image", image=("cat.png", PICTURE))[1]["name"] == "cat.png"
    assert front.post("/upload/image", image=("cat.png", OTHER))[1]["name"] == "cat (1).png"
    third = png(RNG.integers(0, 256, (8, 12, 3), dtype=np.uint8))
    assert front.post("/upload/image", image=("cat.png", third), overwrite="false")[1]["name"] == "cat (2).png"
    assert front.post("/upload/image", image=("cat.png", OTHER))[1]["name"] == "cat (1).png"    # the same bytes
    assert sorted(os.listdir(front.input_dir)) == ["cat (1).png", "cat (2).png", "cat.png"]
    assert front.post("/upload/image", image=("cat.png", OTHER), overwrite="1")[1]["name"] == "cat.png"
    assert (front.input_dir / "cat.png").read_bytes() == OTHER
    assert front.post("/upload/image", image=("cat.png", third), overwrite="true")[1]["name"] == "cat.png"
    assert (front.input_dir / "cat.png").read_bytes() == third


@pytest.mark.parametrize("form, field", [
    ({"image": ("../escape.png", PICTURE)}, "image"),
    ({"image": ("/etc/evil.png", PICTURE)}, "image"),
    ({"image": ("a\x00b.png", PICTURE, "rfc5987")}, "image"),
    ({"image": ("x" * 300 + ".png", PICTURE)}, "image"),
    ({"image": (".hidden.png", PICTURE)}, "image"),
    ({"image": ("ok.png", PICTURE), "subfolder": "../.."}, "subfolder"),
    ({"image": ("ok.png", PICTURE), "subfolder": "/tmp"}, "subfolder"),
    ({"image": ("ok.png", PICTURE), "subfolder": "a/../../b"}, "subfolder"),
    ({"image": ("ok.png", PICTURE), "subfolder": "a\\b"}, "subfolder"),
    ({"image": ("ok.png", PICTURE), "type": "models"}, "type"),
    ({"image": ("ok.png", b"GIF89a but not really")}, "image"),
    ({"image": ("ok.png", b"plain text")}, "image"),
    ({"image": "not a file"}, "image"),
    ({}, "image"),
], ids=["dotdot", "absolute", "nul", "overlong", "hidden", "sub-dotdot", "sub-absolute", "sub-escape",
        "sub-backslash", "type", "fake-gif", "text", "image-as-text", "no-image"])
def test_bad_uploads_are_400_naming_the_field_and_write_nothing(front, form, field):
    status, body = front.post("/upload/image", **form)
    assert status == 400, body
    assert body["field"] == field and body["error"].startswith(f"{field}:"), body
    written = [p for p in front.front.rf.root.rglob("*") if p.is_file()]
    assert written == [], written


def test_raw_nul_in_a_part_header_is_a_400(front):
    status, body = front.post("/upload/image", image=("a\x00b.png", PICTURE))
    assert status == 400 and "form cannot be read" in body["error"], body
    assert not front.input_dir.exists()


def test_decompression_bomb_upload_is_refused(front):
    from tests.test_image_inputs import raw_png
    status, body = front.post("/upload/image", image=("bomb.png", raw_png(100_000, 100_000, 8, 2, b"\x00" * 64)))
    assert status == 400 and "decompression bomb" in body["error"], body
    assert not (front.input_dir / "bomb.png").exists()


def test_links_in_the_input_folder_are_never_followed(front, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    front.input_dir.mkdir(mode=0o700)
    (front.input_dir / "out").symlink_to(outside)
    status, body = front.post("/upload/image", image=("x.png", PICTURE), subfolder="out")
    assert status == 400 and body["field"] == "subfolder", body
    assert list(outside.iterdir()) == []
    (outside / "secret.png").write_bytes(PICTURE)
    (front.input_dir / "link.png").symlink_to(outside / "secret.png")
    (st, _, _), (st2, _, _) = front.send([("GET", "/view", {"filename": "link.png", "type": "input"}),
                                          ("GET", "/view", {"filename": "secret.png", "subfolder": "out",
                                                            "type": "input"})])
    assert (st, st2) == (404, 400)
    # an upload under a link's name replaces the link, never writes through it
    assert front.post("/upload/image", image=("link.png", OTHER), overwrite="true")[0] == 200
    assert (outside / "secret.png").read_bytes() == PICTURE and not (front.input_dir / "link.png").is_symlink()


def test_view_serves_uploads_and_refuses_names_that_leave(front):
    front.post("/upload/image", image=("cat.png", PICTURE), subfolder="clipspace")
    got = front.send([
        ("GET", "/view", {"filename": "cat.png", "subfolder": "clipspace", "type": "input"}),
        ("GET", "/api/view", {"filename": "clipspace/cat.png [input]"}),
        ("GET", "/view", {"filename": "cat.png", "type": "input"}),
        ("GET", "/view", {"filename": "../../pipeline.toml", "type": "input"}),
        ("GET", "/view", {"filename": "cat.png", "subfolder": "../../jobs", "type": "input"}),
        ("GET", "/view", {"filename": "cat.png", "type": "nowhere"})])
    assert [g[0] for g in got] == [200, 200, 404, 400, 400, 400]
    assert got[0][1] == PICTURE and got[0][2] == "image/png" and got[1][1] == PICTURE


def test_object_info_lists_the_input_folders_images(front):
    front.post("/upload/image", image=("b.png", PICTURE))
    front.post("/upload/image", image=("a.png", OTHER))
    front.post("/upload/image", image=("deep.png", PICTURE), subfolder="sub")
    front.input_dir.joinpath("notes.txt").write_text("not an image")
    (_, info, _), = front.send([("GET", "/object_info", {})])
    info = json.loads(info)
    assert info["LoadImage"]["input"]["required"]["image"] == [["a.png", "b.png"], {"image_upload": True}]
    assert info["LoadImage"]["output"] == ["IMAGE", "MASK"]
    mask = info["LoadImageMask"]["input"]["required"]
    assert mask["image"][0] == ["a.png", "b.png"] and mask["channel"] == [["alpha", "red", "green", "blue"]]
    assert "KSampler" in info                               # the graph's nodes are all still there


def test_upload_mask_puts_the_masks_alpha_into_the_original(front):
    """ComfyUI's mask editor: the original (RGB, PNG text) with the uploaded file's alpha as its alpha."""
    rgb = RNG.integers(0, 256, (8, 12, 3), dtype=np.uint8)
    front.post("/upload/image", image=("photo.png", png(rgb, text={"parameters": "a cat"})), subfolder="s")
    drawn = RNG.integers(0, 256, (8, 12, 4), dtype=np.uint8)
    ref = json.dumps({"filename": "photo.png", "subfolder": "s", "type": "input"})
    status, body = front.post("/upload/mask", image=("clipspace-mask.png", png(drawn, "RGBA")), original_ref=ref,
                              subfolder="clipspace")
    assert (status, body) == (200, {"name": "clipspace-mask.png", "subfolder": "clipspace", "type": "input"})
    with Image.open(front.input_dir / "clipspace" / "clipspace-mask.png") as im:
        assert im.mode == "RGBA" and im.text.get("parameters") == "a cat"
        out = np.asarray(im)
    np.testing.assert_array_equal(out[:, :, :3], rgb)
    np.testing.assert_array_equal(out[:, :, 3], drawn[:, :, 3])


@pytest.mark.parametrize("ref, status, field", [
    (None, 400, "original_ref"), ("{not json", 400, "original_ref"), ('["photo.png"]', 400, "original_ref"),
    ('{"filename": "../../pipeline.toml", "type": "input"}', 400, "original_ref"),
    ('{"filename": "photo.png", "subfolder": "../..", "type": "input"}', 400, "original_ref"),
    ('{"filename": "photo.png", "type": "models"}', 400, "original_ref"),
    ('{"filename": "absent.png", "type": "input"}', 404, "original_ref"),
], ids=["missing", "not-json", "not-object", "dotdot", "sub-dotdot", "type", "absent"])
def test_bad_original_ref(front, ref, status, field):
    front.post("/upload/image", image=("photo.png", PICTURE))
    form = {"image": ("m.png", png(np.zeros((8, 12, 4), np.uint8), "RGBA"))}
    if ref is not None:
        form["original_ref"] = ref
    got, body = front.post("/upload/mask", **form)
    assert got == status and body["field"] == field, body
    assert not (front.input_dir / "m.png").exists()


def test_mask_of_another_size_is_refused_naming_both(front):
    front.post("/upload/image", image=("photo.png", PICTURE))
    status, body = front.post("/upload/mask", image=("m.png", png(np.zeros((4, 4, 4), np.uint8), "RGBA")),
                              original_ref=json.dumps({"filename": "photo.png", "type": "input"}))
    assert status == 400 and "4x4" in body["error"] and "12x8" in body["error"], body


def test_upload_larger_than_max_body_but_within_max_upload(front):
    """Uploads have their own bound (stage.http.max_upload_mb), above the JSON bodies' max_body_kb."""
    big = png(RNG.integers(0, 256, (400, 400, 3), dtype=np.uint8))         # ~480 KB, over the 256 KB default
    assert len(big) > front.front.settings.max_body_bytes
    assert front.post("/upload/image", image=("big.png", big))[0] == 200


def test_job_inputs_are_kept_durably_in_the_job_folder(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    paths = inputs.keep_in_job(job, {"init_image": PICTURE, "mask": OTHER})
    assert paths["init_image"].read_bytes() == PICTURE and (job / "mask.png").read_bytes() == OTHER
    assert sorted(os.listdir(job)) == ["init_image.png", "mask.png"]          # no temporary left behind
    with pytest.raises(ValueError, match="'style' is not a job input"):
        inputs.keep_in_job(job, {"style": PICTURE})


# ---------------------------------------------------------------- A1111 /sdapi/v1/img2img


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def img2img_body(**kw) -> dict:
    init = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return {"prompt": "a cat", "steps": 3, "width": 64, "height": 64, "init_images": [b64(png(init))],
            "denoising_strength": 0.5, **kw}


@pytest.fixture
def queued(monkeypatch):
    """img2img's job stand-in: the specs it was asked to run; the job queued and failed (its answer names
    `stand_in`; a refused one would have its kept images removed)."""
    from orchestrator.http.common import json_response
    specs = []

    async def run_job(front_, spec, image=1, images=1):
        specs.append(spec)
        return json_response({"error": "JobFailed", "detail": "stand-in: not run", "field": "stand_in"}, 500), None
    monkeypatch.setattr("orchestrator.http.a1111.run_job", run_job)
    return specs


def test_valid_img2img_is_queued_with_its_images_kept(front, queued):
    body = img2img_body(mask=b64(png(np.zeros((64, 64), np.uint8))), inpaint_full_res=False)
    status, answer = front.request("POST", "/sdapi/v1/img2img", body)
    assert answer.get("field") == "stand_in", answer
    spec = queued[0]
    assert spec["denoise"] == 0.5 and spec["init_image"].startswith("a1111/") and spec["mask"].endswith(" [temp]")


def test_img2img_without_a_size_takes_the_default_packs(front, queued):
    """As txt2img: no width/height is the default pack's size (the stand-in daemon's 128x128), so a 128x128 init
    image under resize_mode's default needs no resize and a 64x64 one is resized to it."""
    from orchestrator.http.img2img import to_request
    body = {k: v for k, v in img2img_body().items() if k not in ("width", "height")}
    front.request("POST", "/sdapi/v1/img2img", body)
    assert (queued[0]["width"], queued[0]["height"]) == (128, 128)
    r = to_request(body, (128, 128))
    assert r.spec["width"] == r.spec["height"] == 128 and _pixels(r.init_image).shape == (128, 128, 3)


def test_img2img_body_may_be_larger_than_max_body(front, queued):
    big = png(RNG.integers(0, 256, (400, 400, 3), dtype=np.uint8))
    assert len(b64(big)) > front.front.settings.max_body_bytes
    status, body = front.request("POST", "/sdapi/v1/img2img", img2img_body(init_images=[b64(big)]))
    assert body.get("field") == "stand_in" and len(queued) == 1, body


def _bomb() -> str:
    from tests.test_image_inputs import raw_png
    return b64(raw_png(100_000, 100_000, 8, 2, b"\x00" * 64))


@pytest.mark.parametrize("edit, field", [
    ({"init_images": None}, "init_images"), ({"init_images": []}, "init_images"),
    ({"init_images": "abc"}, "init_images"), ({"init_images": [b64(PICTURE)] * 2}, "init_images"),
    ({"init_images": ["%%% not base64"]}, "init_images[0]"), ({"init_images": [b64(b"text")]}, "init_images[0]"),
    ({"init_images": ["https://example.com/a.png"]}, "init_images[0]"), ({"init_images": [_bomb()]}, "init_images[0]"),
    ({"init_images": [12]}, "init_images[0]"),
    ({"denoising_strength": 0}, "denoising_strength"), ({"denoising_strength": 1.5}, "denoising_strength"),
    ({"denoising_strength": -0.1}, "denoising_strength"), ({"denoising_strength": "half"}, "denoising_strength"),
    ({"mask_blur": -1}, "mask_blur"), ({"mask_blur": 65}, "mask_blur"), ({"mask_blur_x": 2.5}, "mask_blur_x"),
    ({"inpainting_fill": 4}, "inpainting_fill"), ({"inpainting_fill": -1}, "inpainting_fill"),
    ({"inpainting_mask_invert": 2}, "inpainting_mask_invert"), ({"inpaint_full_res": "maybe"}, "inpaint_full_res"),
    ({"inpaint_full_res_padding": 300}, "inpaint_full_res_padding"), ({"resize_mode": 3}, "resize_mode"),
    ({"resize_mode": 7}, "resize_mode"), ({"mask": b64(b"not an image")}, "mask"), ({"mask": 5}, "mask"),
    ({"mask": b64(png(np.zeros((8, 8), np.uint8)))}, "mask"), ({"mask_round": "sometimes"}, "mask_round"),
    ({"steps": 0}, "steps"), ({"batch_size": 9}, "batch_size"), ({"n_iter": 0}, "n_iter"),   # 2..8 run: a job each
    ({"enable_hr": True}, "enable_hr"),
], ids=lambda v: "-".join(f"{k}={str(x)[:12]}" for k, x in v.items()) if isinstance(v, dict) else v)
def test_img2img_bad_fields_are_422_naming_the_field(front, edit, field):
    status, body = front.request("POST", "/sdapi/v1/img2img", img2img_body(**edit))
    assert status == 422, body
    assert body["field"] == field and body["error"].startswith(f"{field}:"), body
    assert front.link.submitted == []


def test_img2img_not_json_is_422(front):
    status, body = front.request("POST", "/sdapi/v1/img2img", [1, 2])
    assert status == 422 and "JSON object" in body["error"], body


def _pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im)


def test_img2img_record_keeps_the_images_as_a1111_reads_them():
    from orchestrator.http.img2img import to_request
    init = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    rgb_mask = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    c = rgb_mask.astype(np.float64)
    luma = np.floor((c[:, :, 0] * 299 + c[:, :, 1] * 587 + c[:, :, 2] * 114) / 1000.0 + 0.5)
    r = to_request(img2img_body(init_images=["data:image/png;base64," + b64(png(init))], mask=b64(png(rgb_mask)),
                                inpaint_full_res=False, mask_blur=6, inpainting_fill=2))
    np.testing.assert_array_equal(_pixels(r.init_image), init)
    assert np.abs(_pixels(r.mask).astype(int) - luma).max() <= 1              # greyscale, not thresholded
    assert (r.denoise, r.mask_blur_x, r.mask_blur_y, r.inpainting_fill, r.inpaint_full_res) == (0.5, 6, 6, 2, False)
    assert r.spec["width"] == 64 and r.spec["prompt"] == "a cat"
    inv = to_request(img2img_body(mask=b64(png(rgb_mask)), inpainting_mask_invert=1, inpaint_full_res=False))
    assert np.abs((255 - _pixels(inv.mask).astype(int)) - luma).max() <= 1
    rgba = np.concatenate([init, RNG.integers(0, 256, (64, 64, 1), dtype=np.uint8)], axis=2)
    alpha = to_request(img2img_body(mask=b64(png(rgba, "RGBA"))))
    np.testing.assert_array_equal(_pixels(alpha.mask), np.where(rgba[:, :, 3] > 128, 255, 0))


def test_img2img_sizes_follow_resize_mode_and_full_res():
    from orchestrator.http.img2img import to_request
    wide = png(RNG.integers(0, 256, (32, 96, 3), dtype=np.uint8))
    mask = png(np.full((32, 96), 255, np.uint8))
    for mode in (0, 1, 2):
        r = to_request(img2img_body(init_images=[b64(wide)], mask=b64(mask), resize_mode=mode,
                                    inpaint_full_res=False))
        assert _pixels(r.init_image).shape == (64, 64, 3) and _pixels(r.mask).shape == (64, 64)
    kept = to_request(img2img_body(init_images=[b64(wide)], mask=b64(mask)))      # only masked: its own size
    assert _pixels(kept.init_image).shape == (32, 96, 3) and _pixels(kept.mask).shape == (32, 96)
    plain = to_request(img2img_body(init_images=[b64(wide)]))                     # no mask: the job's size
    assert _pixels(plain.init_image).shape == (64, 64, 3) and plain.mask is None


def test_job_store_keeps_the_inputs_before_the_job_exists(tmp_path):
    """JobStore.submit writes the inputs into the hidden new folder, then renames it: a job is never seen (or
    acknowledged) without them, and a failing write leaves no job at all."""
    from orchestrator.engine.jobs import JobStore
    store = JobStore(tmp_path)
    job = store.submit({"prompt": "a cat"}, {"api": "a1111"}, inputs={"init_image": PICTURE, "mask": OTHER})
    folder = store.job_dir(job.id)
    assert (folder / "init_image.png").read_bytes() == PICTURE and (folder / "mask.png").read_bytes() == OTHER
    assert store.get(job.id).state == "queued"
    with pytest.raises(ValueError, match="not a job input"):
        store.submit({"prompt": "a dog"}, None, inputs={"../escape": PICTURE})
    assert sorted(os.listdir(tmp_path / "jobs")) == [job.id]                # no second job, no half-made folder
    assert not (tmp_path / "escape").exists()


def test_read_upload_for_a_job(front, tmp_path):
    front.post("/upload/image", image=("cat.png", PICTURE), subfolder="s")
    root = front.front.rf.root
    assert inputs.read_upload(root, "s/cat.png") == PICTURE
    assert inputs.read_upload(root, "s/cat.png [input]") == PICTURE
    with pytest.raises(FileNotFoundError):
        inputs.read_upload(root, "cat.png")
    with pytest.raises(inputs.InputNameError, match="init_image: subfolder"):
        inputs.read_upload(root, "../../jobs/x.png", "init_image")
    (front.input_dir / "s" / "text.png").write_bytes(b"not an image")
    from models.images import ImageInputError
    with pytest.raises(ImageInputError, match="not an image"):
        inputs.read_upload(root, "s/text.png")
    (tmp_path / "secret.png").write_bytes(PICTURE)
    (front.input_dir / "s" / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(FileNotFoundError):
        inputs.read_upload(root, "s/link.png")


def test_upload_over_max_upload_is_413(tmp_path):
    from orchestrator.http.settings import HttpSettings
    f = Uploads(tmp_path)
    f.front.rf.root.mkdir(mode=0o700)
    f.front.settings = HttpSettings(max_upload_mb=1)
    status, body = f.post("/upload/image", image=("big.png", b"\x89PNG" + bytes(1_100_000)))
    assert status == 413, body
    assert not (f.input_dir / "big.png").exists()


def test_upload_mask_on_a_jobs_output_image(front):
    """original_ref of type output (its default) with a job id subfolder: the job's own image.png."""
    job = "20260101-120000-a1b2c3"
    rgb = RNG.integers(0, 256, (8, 12, 3), dtype=np.uint8)
    (front.front.rf.jobs / job).mkdir(parents=True)
    (front.front.rf.jobs / job / "image.png").write_bytes(png(rgb))
    drawn = RNG.integers(0, 256, (8, 12, 4), dtype=np.uint8)
    status, body = front.post("/upload/mask", image=("edit.png", png(drawn, "RGBA")),
                              original_ref=json.dumps({"filename": "image.png", "subfolder": job}))
    assert (status, body) == (200, {"name": "edit.png", "subfolder": "", "type": "input"}), body
    out = _pixels((front.input_dir / "edit.png").read_bytes())
    np.testing.assert_array_equal(out[:, :, :3], rgb)
    np.testing.assert_array_equal(out[:, :, 3], drawn[:, :, 3])
    status, body = front.post("/upload/mask", image=("edit2.png", png(drawn, "RGBA")),
                              original_ref=json.dumps({"filename": "job.json", "subfolder": job}))
    assert status == 404 and body["field"] == "original_ref", body


# ---------------------------------------------------------------- issue 45: whose file a name is

def _victims_request(front, queued, body) -> tuple[str, str]:
    status, answer = front.request("POST", "/sdapi/v1/img2img", body)
    assert answer.get("field") == "stand_in", answer
    spec = queued[-1]
    return spec["init_image"], spec.get("mask")


def test_a_kept_img2img_image_cannot_be_swapped_through_an_upload(front, queued):
    """Item 2: the kept names are public (/queue, /history); an upload over one with overwrite=1 is refused, and the
    victim's next identical request runs on the victim's own pixels (init image and mask alike)."""
    init = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[8:40, 8:40] = 255
    body = img2img_body(init_images=[b64(png(init))], mask=b64(png(mask)), inpaint_full_res=False, mask_blur=0,
                        inpainting_fill=1)
    kept_init, kept_mask = _victims_request(front, queued, body)
    root = front.front.rf.root
    attack = png(RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    for ref in (kept_init, kept_mask):
        sub, name, kind = inputs.annotated(ref, "input")
        for form in ({"subfolder": sub, "type": kind}, {"subfolder": f"./{sub}/.", "type": kind}):
            status, answer = front.post("/upload/image", image=(name, attack), overwrite="1", **form)
            assert status == 403 and answer["field"] == "subfolder", answer
        status, answer = front.post("/upload/mask", image=(name, png(np.zeros((64, 64, 4), np.uint8), "RGBA")),
                                    subfolder=sub, type=kind, overwrite="1",
                                    original_ref=json.dumps({"filename": ref}))
        assert status == 403 and answer["field"] == "subfolder", answer
    status, answer = front.post("/upload/image", image=("a1111", attack), type="temp")   # a file in its place
    assert status == 403 and answer["field"] == "image", answer
    assert _victims_request(front, queued, body) == (kept_init, kept_mask)
    np.testing.assert_array_equal(_pixels(inputs.read_upload(root, kept_init)), init)     # what the job reads
    np.testing.assert_array_equal(_pixels(inputs.read_upload(root, kept_mask)), mask)
    assert sorted(os.listdir(root / "temp" / "a1111")) == sorted(
        inputs.annotated(r, "input")[1] for r in (kept_init, kept_mask))                  # no "(1)" copies


def test_img2img_before_any_kept_image_with_a_file_in_the_folders_place(front, queued):
    """No upload can put a file named a1111 in RUN/temp (it would stop every img2img request), nor page or cli in
    RUN/input (the page's and the CLI's uploads); one put there by hand is a 503 saying what to remove, not a
    traceback."""
    from orchestrator.terminal import cli
    from orchestrator.http import page
    app_js = (Path(page.__file__).parent / "static" / "app.js").read_text()
    assert 'const UPLOAD_FOLDER = "page";' in app_js and ("input", cli.CLI_UPLOADS) in inputs.OWN_FOLDERS
    for kind, name in inputs.OWN_FOLDERS:
        status, answer = front.post("/upload/image", image=(name, PICTURE), type=kind, subfolder=".")
        assert status == 403 and answer["field"] == "image", answer
        assert not (front.front.rf.root / kind / name).exists()
    assert front.post("/upload/image", image=("x.png", PICTURE), subfolder="page")[0] == 200     # into them: yes
    (front.front.rf.root / "temp").mkdir()
    (front.front.rf.root / "temp" / "a1111").write_bytes(PICTURE)
    status, answer = front.request("POST", "/sdapi/v1/img2img", img2img_body())
    assert status == 503 and "RUN/temp/a1111" in answer["error"] and queued == [], answer


def test_a_kept_image_changed_on_disk_is_refused_and_written_again(front, queued):
    body = img2img_body()
    kept = _victims_request(front, queued, body)[0]
    root = front.front.rf.root
    sub, name, kind = inputs.annotated(kept, "input")
    path = root / kind / sub / name
    sent = path.read_bytes()
    path.write_bytes(OTHER)
    with pytest.raises(inputs.InputNameError, match="init_image: .* does not hold the image its name says"):
        inputs.read_upload(root, kept, "init_image")
    assert _victims_request(front, queued, body)[0] == kept and path.read_bytes() == sent


def test_an_upload_named_as_a_folder_is_409_not_a_traceback(front):
    """Item 7: the name of a folder (RUN/input/page and cli, the page's and the CLI's uploads: 403, the name is
    theirs; any other, like ComfyUI's clipspace: 409) was a 500 IsADirectoryError."""
    for name, want in (("page", 403), ("cli", 403), ("clipspace", 409)):
        (front.input_dir / name).mkdir(parents=True)
        status, body = front.post("/upload/image", image=(name, PICTURE), overwrite="1")
        assert status == want and body["field"] == "image" and "folder" in body["error"], body
        assert (front.input_dir / name).is_dir()
    status, body = front.post("/upload/image", image=("clipspace", PICTURE))       # without overwrite: renamed
    assert (status, body["name"]) == (200, "clipspace (1)"), body


def test_output_names_mean_the_jobs_own_files(front):
    """Item 10: "<job>/image.png [output]" is the job's image for /view and for a prompt alike; uploads do not
    write under a job id."""
    job = "20260101-120000-a1b2c3"
    rgb = RNG.integers(0, 256, (8, 12, 3), dtype=np.uint8)
    (front.front.rf.jobs / job).mkdir(parents=True)
    (front.front.rf.jobs / job / "image.png").write_bytes(png(rgb))
    for sub in (job, f"{job}/deeper", f"./{job}"):
        status, body = front.post("/upload/image", image=("image.png", PICTURE), type="output", subfolder=sub)
        assert status == 403 and body["field"] == "subfolder", (sub, body)
    assert not (front.front.rf.root / "output").exists()
    root = front.front.rf.root
    np.testing.assert_array_equal(_pixels(inputs.read_upload(root, f"{job}/image.png [output]")), rgb)
    (st, data, _), = front.send([("GET", "/view", {"filename": "image.png", "subfolder": job, "type": "output"})])
    assert st == 200 and data == (front.front.rf.jobs / job / "image.png").read_bytes()
    with pytest.raises(FileNotFoundError):
        inputs.read_upload(root, f"{job}/job.json [output]")
    # an upload of type output elsewhere keeps its ComfyUI meaning: the output folder
    assert front.post("/upload/image", image=("mine.png", PICTURE), type="output", subfolder="x")[0] == 200
    assert inputs.read_upload(root, "x/mine.png [output]") == PICTURE


def _stored_png(seed: int) -> bytes:
    """A PNG whose size depends on its dimensions only (no compression): many files of one size."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
        buf, "PNG", compress_level=0)
    return buf.getvalue()


def test_an_upload_under_a_much_used_name_reads_no_earlier_file(front, monkeypatch):
    """Item 11: the k-th upload under one name hashed every earlier "NAME (i).EXT" in full and wrote its bytes (with
    an fsync) under each taken name before moving on; now it hashes its own bytes only (files of another size are not
    read; a file's digest is remembered by its identity) and writes once."""
    import hashlib
    hashed = []

    class Counting:
        def __init__(self, data=b""):
            self.h = hashlib.sha256(data)
            hashed.append(len(data))

        def hexdigest(self):
            return self.h.hexdigest()
    monkeypatch.setattr(inputs, "hashlib", type("H", (), {"sha256": Counting}))
    writes = []
    real_write = inputs.atomic_write
    monkeypatch.setattr(inputs, "atomic_write", lambda path, *a, **kw: writes.append(path.name) or real_write(
        path, *a, **kw))
    images = [_stored_png(i) for i in range(8)]
    assert len({len(i) for i in images}) == 1
    front.input_dir.mkdir()
    (front.input_dir / "big.png").write_bytes(images[0])           # a file the front did not write: hashed once
    for k, data in enumerate(images[1:], 1):
        hashed.clear()
        writes.clear()
        assert front.post("/upload/image", image=("big.png", data))[1]["name"] == f"big ({k}).png"
        assert sum(hashed) <= (2 * len(data) if k == 1 else len(data)), (k, hashed)
        assert writes == [f"big ({k}).png"]                     # a taken name is not written (and fsynced) first
    hashed.clear()
    small = png(RNG.integers(0, 256, (4, 4, 3), dtype=np.uint8))
    assert front.post("/upload/image", image=("big.png", small))[1]["name"] == "big (8).png"
    assert sum(hashed) <= len(small)
    hashed.clear()
    assert front.post("/upload/image", image=("big.png", images[5]))[1]["name"] == "big (5).png"   # same bytes
    assert sum(hashed) <= len(images[5])


# ---------------------------------------------------------------- issue 45 item 6: the uploads' quota and pruning

def _big_png(seed: int) -> bytes:
    return png(np.random.default_rng(seed).integers(0, 256, (440, 440, 3), dtype=np.uint8))


def test_uploads_past_their_quota_are_507_naming_it(tmp_path, queued, monkeypatch):
    """Ten 29 MB uploads grew RUN/input by 300 MB with no bound; now stage.http.max_uploads_mb bounds the upload
    folders together (uploads, masks and img2img's kept images): past it a new file is a 507 naming the setting and
    nothing is written; the same bytes again write nothing and still pass."""
    from orchestrator.http.settings import HttpSettings
    f = Uploads(tmp_path)
    f.front.rf.root.mkdir(mode=0o700)
    f.front.settings = HttpSettings(max_uploads_mb=1)
    f.link.sizes = ((440, 440),)                  # the img2img job's size below has a pack
    first, second = _big_png(1), _big_png(2)
    assert 2**20 / 2 < len(first) < 2**20
    walks = []
    from orchestrator.engine import upload_space
    real_size = upload_space.uploads_size
    monkeypatch.setattr(upload_space, "uploads_size", lambda root: walks.append(1) or real_size(root))
    small = [png(RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(4)]
    for i, data in enumerate(small):
        assert f.post("/upload/image", image=(f"s{i}.png", data))[0] == 200
    assert len(walks) == 1                        # the folders are walked once, not at every upload
    for i in range(4):
        os.unlink(f.input_dir / f"s{i}.png")
    assert f.post("/upload/image", image=("a.png", first))[0] == 200
    status, body = f.post("/upload/image", image=("b.png", second))
    assert status == 507 and "stage.http.max_uploads_mb = 1" in body["error"] and "prune" in body["error"], body
    assert f.post("/upload/image", image=("a.png", first), type="temp")[0] == 507
    assert f.post("/upload/image", image=("a.png", first))[1] == {"name": "a.png", "subfolder": "", "type": "input"}
    status, body = f.request("POST", "/sdapi/v1/img2img", img2img_body(
        init_images=[b64(_big_png(3))], width=440, height=440))
    assert status == 507 and "max_uploads_mb" in body["error"], body
    assert queued == [] and real_size(f.front.rf.root) == (1, len(first))
    f.front.settings = HttpSettings(max_uploads_mb=0)                                  # 0: no limit
    assert f.post("/upload/image", image=("b.png", second))[0] == 200


def test_prune_older_than_removes_uploads_of_that_age(inproc_daemon, capsys):
    """`prune` removed jobs only; RUN/input and RUN/temp (temp/a1111 too) grew for ever. With --older-than the
    uploads unchanged for that long go as well (a job keeps its own copy of its inputs at submit)."""
    import time
    from orchestrator.terminal import cli
    rf = inproc_daemon.daemon.rf
    old, new = time.time() - 7200, time.time()
    files = {"input/page/old.png": old, "input/old.png": old, "temp/a1111/" + "0" * 32 + ".png": old,
             "output/x/old.png": old, "input/page/new.png": new, "temp/new.png": new}
    for rel, mtime in files.items():
        (rf.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (rf.root / rel).write_bytes(PICTURE)
        os.utime(rf.root / rel, (mtime, mtime))
    outside = rf.root / "outside.png"
    outside.write_bytes(PICTURE)
    os.utime(outside, (old, old))
    (rf.root / "input" / "link").symlink_to(rf.root)                 # a link is neither followed nor removed
    assert cli.main(["--run", str(rf.root), "prune", "--keep", "5"], connect=inproc_daemon.connect) == 0
    assert all((rf.root / rel).exists() for rel in files)           # --keep alone: no age, no upload removed
    capsys.readouterr()
    assert cli.main(["--run", str(rf.root), "prune", "--older-than", "1h"], connect=inproc_daemon.connect) == 0
    err = capsys.readouterr().err
    assert f"4 upload(s) removed ({4 * len(PICTURE) / 1e6:,.1f} MB)" in err, err
    assert sorted(rel for rel in files if (rf.root / rel).exists()) == ["input/page/new.png", "temp/new.png"]
    assert outside.exists() and (rf.root / "input" / "link").is_symlink() and rf.jobs.is_dir()
