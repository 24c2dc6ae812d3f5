"""A1111's `POST /sdapi/v1/img2img`: the request read into a checked record, every bad field a 422 naming it.

The fields beyond txt2img's (stable-diffusion-webui's StableDiffusionImg2ImgProcessingAPI, its defaults):

    init_images              [base64 image] (a "data:image/png;base64," prefix is taken); one init image per request
    mask                     base64 image or null: white = repainted (A1111's create_binary_mask, models/images)
    resize_mode              0 just resize | 1 crop and resize | 2 resize and fill (default 0); 3 (latent) refused
    denoising_strength       in (0, 1] (default 0.75)
    mask_blur                0..64, sets mask_blur_x and mask_blur_y (default 4 each)
    inpainting_fill          0 fill | 1 original | 2 latent noise | 3 latent nothing (default 0)
    inpainting_mask_invert   0 | 1 (default 0: the white part is repainted)
    inpaint_full_res         bool (default true: "only masked"), inpaint_full_res_padding 0..256 (default 32)
    mask_round               bool (default true)

The txt2img fields are read as /sdapi/v1/txt2img reads them (orchestrator/http/a1111.py: `to_spec`). The init image
and the mask are decoded under models/images' bounds and brought to the job's width x height by `resize_mode` as
A1111 does; with a mask, the mask is blurred, the masked part filled (inpainting_fill 0) and, after the job, the
original pasted back over the unmasked part as A1111 does (models/images/inpaint.py). With inpaint_full_res ("only
masked", A1111's default) the job runs on the region around the blurred mask (widened by the padding and grown to the
job's aspect ratio), brought to the job's size by resize-and-fill; the result is resized back into that region of the
original; a blank mask there is dropped and the request runs as plain img2img (A1111 switches so). inpainting_fill 2 / 3 (latent noise / latent nothing) become the prompt's `latent_fill`: the masked part of
the init latent replaced by the seed's noise or by zeros before sampling. The images go to RUN/temp/a1111/, named by their
bytes and written by this front only (orchestrator.engine.inputs.keep_private: uploads cannot write there), and the
job's prompt names them (init_image, mask, denoise = denoising_strength); the daemon keeps them in the job folder
(a refused request's are removed). The
latent mask is ComfyUI's (bilinear to the latent's size, not rounded), where A1111 resizes it with Pillow and rounds
it: docs/workflows.md.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
from collections import Counter
from dataclasses import dataclass

import numpy as np

from aiohttp import web

from models.images import ImageInputError, a1111_mask8, fit_image, image_size, load_rgb8
from models.images import inpaint
from models.images.decode import MAX_INPUT_BYTES
from orchestrator.http import a1111
from orchestrator.http.common import FRONT, BadRequest, json_response, read_json, refuse
from orchestrator.http.image_budget import BUDGET, img2img_cost, paste_cost
from orchestrator.engine.inputs import InputNameError, drop_private, keep_private, private_name
from orchestrator.engine.upload_space import UploadsFull

IMG2IMG_FIELDS = ("init_images", "mask", "resize_mode", "denoising_strength", "mask_blur", "mask_blur_x",
                  "mask_blur_y", "inpainting_fill", "inpainting_mask_invert", "inpaint_full_res",
                  "inpaint_full_res_padding", "mask_round", "include_init_images", "image_cfg_scale",
                  "initial_noise_multiplier", "latent_mask")
MAX_BLUR = 64
MAX_PADDING = 256
LATENT_FILLS = {2: "noise", 3: "nothing"}     # inpainting_fill 2 latent noise, 3 latent nothing -> latent_fill
HELD: Counter = Counter()     # RUN/temp/a1111 names -> the requests in this front holding them (until their SUBMIT)


@dataclass(frozen=True)
class Img2ImgRequest:
    spec: dict                      # the txt2img part, as /sdapi/v1/txt2img makes it
    init_image: bytes               # PNG, RGB: width x height, or its own size under inpaint_full_res with a mask
    mask: bytes | None              # PNG, L (255 = repaint; inpainting_mask_invert applied; not blurred), or None
    denoise: float
    resize_mode: int
    mask_blur_x: int
    mask_blur_y: int
    inpainting_fill: int
    inpaint_full_res: bool
    inpaint_full_res_padding: int
    count: int = 1                  # batch_size x n_iter: one job per image, seeds seed, seed+1, ... as txt2img's


def _base64_image(value, field: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise a1111._bad(field, f"must be a base64 image, got {type(value).__name__}")
    if value.startswith(("http://", "https://")):
        raise a1111._bad(field, "image URLs are not fetched; send the image as base64")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    text = "".join(value.split())
    if len(text) > (MAX_INPUT_BYTES // 3 + 1) * 4:
        raise a1111._bad(field, f"the image is over {MAX_INPUT_BYTES} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise a1111._bad(field, "is not valid base64") from None


def _png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=4)
    return buf.getvalue()


def _decoded(data: bytes, field: str, mask_round: bool | None = None):
    """An image's bytes decoded (bounded) as PIL: the init image in 8-bit RGB (LoadImage's pixels rounded), the
    mask (`mask_round` not None) in L by A1111's rule; no float copy of either."""
    from PIL import Image
    try:
        if mask_round is not None:
            return Image.fromarray(a1111_mask8(data, rounded=mask_round), "L")
        return load_rgb8(data)                                    # 16-bit, CMYK, palette, EXIF as LoadImage
    except ImageInputError as e:
        raise a1111._bad(field, str(e)) from None


def _image_bytes(body: dict) -> tuple[bytes, bytes | None]:
    """(init image, mask or None) as file bytes from the request's base64, checked as A1111 lists them."""
    images = body.get("init_images")
    if not isinstance(images, list) or not images:
        raise a1111._bad("init_images", "must be a list holding one base64 image")
    if len(images) > 1:
        raise a1111._bad("init_images", f"{len(images)} images: one init image per request here (batch_size and "
                                            "n_iter repeat it)")
    init = _base64_image(images[0], "init_images[0]")
    return init, None if body.get("mask") in (None, "") else _base64_image(body["mask"], "mask")


def _size(data: bytes, field: str) -> tuple[int, int]:
    try:
        return image_size(data)
    except ImageInputError as e:
        raise a1111._bad(field, str(e)) from None


def _images(body: dict, spec: dict, resize_mode: int, full_res: bool, data: tuple) -> tuple:
    """(init image, mask or None) as PIL images from their file bytes `data`: both brought to the job's size by resize_mode, or,
    with a mask and inpaint_full_res (A1111 crops around the mask and pastes back), both kept at the init image's
    size."""
    from PIL import ImageOps
    init = _decoded(data[0], "init_images[0]")
    mask = None if data[1] is None else _decoded(data[1], "mask", a1111._bool(body, "mask_round", True))
    if mask is not None and a1111._number(body, "inpainting_mask_invert", 0, integer=True, low=0, high=1):
        mask = ImageOps.invert(mask)
    if mask is not None and full_res:
        if mask.size != init.size:
            raise a1111._bad("mask", f"the mask is {mask.width}x{mask.height} but init_images[0] is "
                                     f"{init.width}x{init.height}")
        if mask.getbbox() is not None:
            return init, mask
        mask = None                 # A1111: "Unable to perform Inpaint Only mask because mask is blank" -> img2img
    w, h = spec["width"], spec["height"]
    try:
        init = fit_image(init, w, h, resize_mode, what="init_images[0]")
        mask = None if mask is None else fit_image(mask, w, h, resize_mode, what="mask")
    except ImageInputError as e:
        raise a1111._bad("resize_mode", str(e)) from None
    return init, mask


def _strength(body: dict) -> float:
    v = a1111._number(body, "denoising_strength", 0.75, integer=False, low=0.0, high=1.0)
    if v <= 0:
        raise a1111._bad("denoising_strength", f"must be in (0, 1], got {v}: 0 would give back the init image")
    return float(v)


def _blur(body: dict) -> tuple[int, int]:
    if body.get("mask_blur") is not None:
        b = a1111._number(body, "mask_blur", 4, integer=True, low=0, high=MAX_BLUR)
        return b, b
    return (a1111._number(body, "mask_blur_x", 4, integer=True, low=0, high=MAX_BLUR),
            a1111._number(body, "mask_blur_y", 4, integer=True, low=0, high=MAX_BLUR))


def _resize_mode(body: dict) -> int:
    mode = a1111._number(body, "resize_mode", 0, integer=True, low=0, high=3)
    if mode == 3:
        raise a1111._bad("resize_mode", "3 (just resize, latent upscale) is not supported here; use 0, 1 or 2")
    return mode


@dataclass(frozen=True)
class _Fields:
    """An img2img request's fields checked, its images still file bytes (what the budget is estimated from)."""
    spec: dict
    count: int
    resize_mode: int
    denoise: float
    blur: tuple[int, int]
    fill: int
    full_res: bool
    padding: int
    data: tuple                     # (init image bytes, mask bytes or None)


def _fields(body: dict, size: tuple, sizes=()) -> _Fields:
    """Every field checked (422 naming the first bad one) and the images' base64 decoded; `sizes`: the packs'
    (width, height), a job size none has refused here, before its images are decoded at that size."""
    spec = a1111.to_spec({k: v for k, v in body.items() if k not in IMG2IMG_FIELDS}, size)
    if body.get("enable_hr") not in (None, False):
        raise a1111._bad("enable_hr", "the hires fix is txt2img's; img2img takes none")
    if sizes and (spec["width"], spec["height"]) not in {tuple(s) for s in sizes}:
        have = ", ".join(f"{w}x{h}" for w, h in sizes)
        raise a1111._bad("width", f"{spec['width']}x{spec['height']} has no model pack; the sizes with a pack: {have}")
    count = a1111.image_count(body)
    resize_mode, denoise = _resize_mode(body), _strength(body)
    blur = _blur(body)
    fill = a1111._number(body, "inpainting_fill", 0, integer=True, low=0, high=3)
    a1111._number(body, "inpainting_mask_invert", 0, integer=True, low=0, high=1)
    full_res = a1111._bool(body, "inpaint_full_res", True)
    padding = a1111._number(body, "inpaint_full_res_padding", 32, integer=True, low=0, high=MAX_PADDING)
    a1111._bool(body, "mask_round", True)
    a1111._bool(body, "include_init_images", False)
    return _Fields(spec, count, resize_mode, denoise, blur, fill, full_res, padding, _image_bytes(body))


def _cost(f: _Fields) -> int:
    """The preparation's memory bound (orchestrator.http.image_budget) from the images' headers."""
    init = _size(f.data[0], "init_images[0]")
    mask = None if f.data[1] is None else _size(f.data[1], "mask")
    return img2img_cost(init, mask, (f.spec["width"], f.spec["height"]), sum(len(d or b"") for d in f.data),
                        f.full_res)


def _request(body: dict, f: _Fields) -> tuple[Img2ImgRequest, tuple]:
    """The checked record and its (init, mask) as PIL images (prepare takes them: not decoded from the PNGs again)."""
    init, mask = _images(body, f.spec, f.resize_mode, f.full_res, f.data)
    req = Img2ImgRequest(f.spec, _png(init), None if mask is None else _png(mask), f.denoise, f.resize_mode, *f.blur,
                         f.fill, f.full_res, f.padding, f.count)
    return req, (init, mask)


def to_request(body: dict, size: tuple = (512, 512)) -> Img2ImgRequest:
    """An img2img request body -> the checked record (BadRequest 422 naming the first bad field); `size`: the
    width and height a request without them gets, as txt2img's."""
    return _request(body, _fields(body, size))[0]


@dataclass(frozen=True)
class Prepared:
    """What the job gets and what is done with its image: the init image and the noise mask as PNGs at the job's
    size, the paste-back mask (None without a mask) and, for only masked, the region of the original it fills."""

    init_image: bytes
    mask: bytes | None = None
    overlay: np.ndarray | None = None
    region: tuple[int, int, int, int] | None = None


def _only_masked(req: Img2ImgRequest, init, blurred: np.ndarray):
    """inpaint_full_res: (init, blurred mask) cropped to the region around the mask, brought to the job's size by
    resize-and-fill, and the region; (init, blurred, None) for an empty mask (A1111 then inpaints the whole
    picture)."""
    from PIL import Image
    box = inpaint.crop_region(blurred, req.inpaint_full_res_padding)
    if box is None:
        return init, blurred, None
    w, h = req.spec["width"], req.spec["height"]
    box = inpaint.expand_region(box, w, h, init.width, init.height)
    init = fit_image(init.crop(box), w, h, 2)
    blurred = np.asarray(fit_image(Image.fromarray(blurred, "L").crop(box), w, h, 2))
    return init, blurred, box


def prepare(req: Img2ImgRequest, images: tuple | None = None) -> Prepared:
    """The job's inputs as A1111 makes them: the mask blurred by mask_blur_x/y, for only masked the region around it
    cut out and sized for the job, the masked part filled for inpainting_fill 0, the latent mask the blurred mask,
    the overlay the full-size blurred mask x 2 (models.images.inpaint). `images`: the request's (init, mask) as PIL
    images when the caller has them (else read from its PNGs)."""
    from PIL import Image
    if req.mask is None:
        return Prepared(req.init_image)
    if images is None:
        with Image.open(io.BytesIO(req.init_image)) as im, Image.open(io.BytesIO(req.mask)) as m:
            images = (im.convert("RGB"), m.convert("L"))
    init, mask = images
    blurred = inpaint.blur_mask(np.asarray(mask), req.mask_blur_x, req.mask_blur_y)
    overlay = inpaint.overlay_mask(blurred)
    region = None
    if req.inpaint_full_res:
        init, blurred, region = _only_masked(req, init, blurred)
    mask_im = Image.fromarray(blurred, "L")
    if req.inpainting_fill == 0:
        init = inpaint.fill(init, mask_im)
    return Prepared(_png(init), _png(mask_im), overlay, region)


def _mask_params(parameters: str, req: Img2ImgRequest, prep: Prepared) -> str:
    """A1111's generation text gets what the job never sees after its pairs: "Mask blur: N" when the mask was
    blurred (N: mask_blur_x when both axes are the same, as A1111's mask_blur property gives), and "Inpaint area:
    Only masked, Masked area padding: P" when the job ran on a region."""
    if (req.mask_blur_x or req.mask_blur_y) and req.mask_blur_x == req.mask_blur_y:
        parameters += f", Mask blur: {req.mask_blur_x}"
    if prep.region is not None:
        parameters += f", Inpaint area: Only masked, Masked area padding: {req.inpaint_full_res_padding}"
    return parameters


def _pasted(png: bytes, req: Img2ImgRequest, prep: Prepared) -> bytes:
    """The job's PNG with the original pasted back over the unmasked part (A1111's apply_overlay; only masked: the
    job's image resized into its region first), its text kept."""
    from PIL import Image, PngImagePlugin
    with Image.open(io.BytesIO(png)) as out, Image.open(io.BytesIO(req.init_image)) as init:
        info = PngImagePlugin.PngInfo()
        for k, v in (out.text or {}).items():
            info.add_itxt(k, _mask_params(v, req, prep) if k == "parameters" else v)
        result = inpaint.paste_back(out, init.convert("RGB"), prep.overlay, at=prep.region)
    buf = io.BytesIO()
    result.save(buf, "PNG", pnginfo=info, compress_level=4)
    return buf.getvalue()


async def _kept(front, png: bytes, held: list) -> str:
    """The image kept for the job (orchestrator.engine.inputs.keep_private) -> its name; 507 past the uploads' quota.
    `held` gets the PNG: the request holds the file (counted before it is written) until _released."""
    HELD[private_name(png)] += 1
    held.append(png)
    try:
        return await asyncio.to_thread(keep_private, front.rf.root, png, front.settings.max_uploads_bytes)
    except UploadsFull as e:
        raise refuse(507, str(e)) from None
    except InputNameError as e:                 # RUN/temp/a1111 is not a plain folder (a link, a file)
        raise refuse(503, f"RUN/temp/a1111 cannot keep the request's images ({e}): remove what is there") from None


async def _prepared(body: dict, size: tuple, sizes=()) -> tuple[Img2ImgRequest, Prepared]:
    """The fields checked, then the images decoded, sized and blurred on a worker thread under the front's image
    budget (orchestrator.http.image_budget: the cost from the images' headers; past it, 503 with Retry-After)."""
    f = await asyncio.to_thread(_fields, body, size, sizes)
    with BUDGET.hold(await asyncio.to_thread(_cost, f), "img2img"):
        req, images = await asyncio.to_thread(_request, body, f)
        return req, await asyncio.to_thread(prepare, req, images)


async def _released(front, held: list, refused: bool) -> None:
    """The request's hold on its kept images ends; a refused request's images no other request holds are removed
    (a queued job has its own copies in its folder)."""
    gone = []
    for png in held:
        name = private_name(png)
        HELD[name] -= 1
        if HELD[name] <= 0:
            del HELD[name]
            if refused:
                gone.append(png)
    for png in gone:
        await asyncio.to_thread(drop_private, front.rf.root, png)


async def img2img(request: web.Request) -> web.Response:
    """Checked in full (422 naming a field), the images kept for the job, the job run, the original pasted back."""
    front, held, refused = request.app[FRONT], [], False
    try:
        return await _img2img(request, front, held)
    except BadRequest:
        refused = True
        raise
    finally:
        await _released(front, held, refused)


async def _img2img(request: web.Request, front, held: list) -> web.Response:
    try:
        body = await read_json(request.clone(client_max_size=front.settings.max_upload_bytes))
        sizes = (await front.tracker.names()).sizes
        req, prep = await _prepared(body, sizes[0] if sizes else (512, 512), sizes)
        kept = {"init_image": await _kept(front, prep.init_image, held)}
        if prep.mask is not None:
            kept["mask"] = await _kept(front, prep.mask, held)
        spec = {**req.spec, "denoise": req.denoise, "denoise_steps": "a1111", **kept}     # A1111's count: fewer steps
        if prep.mask is not None:
            if req.inpainting_fill in LATENT_FILLS:
                spec["latent_fill"] = LATENT_FILLS[req.inpainting_fill]
    except BadRequest as e:
        raise a1111._unprocessable(e) from None

    async def paste(png: bytes) -> bytes:
        if prep.overlay is None:
            return png
        cost = paste_cost(prep.overlay.shape[::-1], (req.spec["width"], req.spec["height"]))
        async with BUDGET.wait_hold(cost, "paste-back"):
            return await asyncio.to_thread(_pasted, png, req, prep)
    jobs, pngs = await a1111.run_jobs(front, spec, req.count, paste, request)
    if pngs is None:
        return jobs
    job, png = jobs[0], pngs[0]
    names = await front.tracker.names()
    info = a1111._batch_info(a1111._info(job, png, names.unet[0] if names.unet else ""), jobs, pngs,
                             int(body.get("batch_size", 1)))
    images = [base64.b64encode(p).decode() for p in pngs] if a1111._bool(body, "send_images", True) else []
    return json_response({"images": images, "parameters": a1111.parameters(body, job), "info": json.dumps(info)})


def add_routes(app: web.Application) -> None:
    app.router.add_route("POST", "/sdapi/v1/img2img", img2img)
