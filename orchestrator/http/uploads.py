"""ComfyUI's image uploads and what serves them (shapes and rules as ComfyUI's server.py has them):

    POST /upload/image  multipart: image (the file), type input|temp|output (default input), subfolder, overwrite
                        -> {"name", "subfolder", "type"}
    POST /upload/mask   the same, and original_ref (JSON {"filename", "subfolder", "type" (default output)}): the
                        original image with the uploaded file's alpha channel put in, saved as PNG (its text kept)
    GET  /view?type=input|temp (and type=output with a subfolder that is not a job id): an uploaded image
    /object_info        LoadImage and LoadImageMask, their `image` choices the input folder's images

Names, folders and the rename rule: orchestrator/engine/inputs.py. Every upload must be an image models/images decodes
(bounded before decoding); anything else is a 400 naming the field. Bodies may be stage.http.max_upload_mb large.
Uploads never write a job's files (type output, a job id subfolder) nor the A1111 img2img requests' own images
(type temp, subfolder a1111): 403 naming `subfolder`; a name a folder holds, with overwrite, is a 409. Past
stage.http.max_uploads_mb (the upload folders together) a new file is a 507 naming it.
"""
from __future__ import annotations

import asyncio
import io
import json
import os

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from models.images import CHANNELS, ImageInputError, image_size, open_bounded
from orchestrator.engine import inputs, upload_space
from orchestrator.http.comfy_nodes import image_nodes, object_info
from orchestrator.http import files
from orchestrator.http.common import FRONT, refuse
from orchestrator.http.image_budget import BUDGET, decode_cost


def _bad(field: str, message: str):
    return refuse(400, f"{field}: {message}", field=field)


async def read_form(request: web.Request):
    """The multipart form, up to stage.http.max_upload_mb, within stage.http.body_timeout_s (else 413 / 408)."""
    settings = request.app[FRONT].settings
    big = request.clone(client_max_size=settings.max_upload_bytes)
    try:
        return await asyncio.wait_for(big.post(), settings.body_timeout_s)
    except asyncio.TimeoutError:
        raise refuse(408, f"the body did not arrive within {settings.body_timeout_s:g} s "
                          "(stage.http.body_timeout_s)") from None
    except (ValueError, HttpProcessingError) as e:          # a malformed multipart body or part header
        raise refuse(400, f"the form cannot be read: {getattr(e, 'message', None) or e}"[:300]) from None


def _text_field(post, name: str, default: str = "") -> str:
    v = post.get(name, default)
    if not isinstance(v, str):
        raise _bad(name, "must be a text field, not a file")
    return v


def _file_field(post) -> tuple[str, bytes]:
    image = post.get("image")
    if image is None or isinstance(image, str) or not hasattr(image, "file"):
        raise _bad("image", "the form must carry the image file in the field 'image'")
    return image.filename or "", image.file.read()


def _checked_image(data: bytes, field: str = "image"):
    try:
        return open_bounded(data, transpose=False)
    except ImageInputError as e:
        raise _bad(field, str(e)) from None


def _checked_size(data: bytes) -> tuple[int, int]:
    try:
        return image_size(data)
    except ImageInputError as e:
        raise _bad("image", str(e)) from None


async def _upload(request: web.Request, make_bytes=None) -> web.Response:
    """ComfyUI's image_upload: the form checked, the file checked to be an image, written by the rename rule."""
    front = request.app[FRONT]
    post = await read_form(request)
    name, data = _file_field(post)
    kind, subfolder = _text_field(post, "type", "input") or "input", _text_field(post, "subfolder")
    overwrite = _text_field(post, "overwrite") in ("true", "1")
    try:
        inputs.check_kind(kind)
        inputs.check_subfolder(subfolder)
        inputs.check_name(name, "image")
        size = await asyncio.to_thread(_checked_size, data)
        # decoded under the front's image budget (waiting for room): /upload/mask decodes the original too
        async with BUDGET.wait_hold(decode_cost(size, len(data), 1 if make_bytes is None else 3), "upload"):
            await asyncio.to_thread(_checked_image, data)
            if make_bytes is not None:
                data = await asyncio.to_thread(make_bytes, front, post, data)
        saved = await asyncio.to_thread(inputs.save_upload, front.rf.root, kind, subfolder, name, data,
                                        overwrite=overwrite, quota_bytes=front.settings.max_uploads_bytes)
    except inputs.InputNameError as e:
        raise refuse(e.status, str(e), field=e.field) from None
    except upload_space.UploadsFull as e:
        raise refuse(507, str(e)) from None
    return web.json_response({"name": saved, "subfolder": subfolder, "type": kind})


async def upload_image(request: web.Request) -> web.Response:
    return await _upload(request)


def _original_path(front, ref: dict):
    """The file original_ref names: a job's own file (type output, a job id subfolder) or an upload."""
    sub, name, kind = inputs.annotated(ref["filename"], ref.get("type") or "output")
    if ref.get("subfolder"):
        sub = f"{ref['subfolder']}/{sub}" if sub else ref["subfolder"]
    return inputs.find(front.rf.root, kind, sub, name)


def _original_ref(post) -> dict:
    text = _text_field(post, "original_ref")
    if not text:
        raise _bad("original_ref", "required: JSON {\"filename\", \"subfolder\", \"type\"} of the image masked")
    try:
        ref = json.loads(text)
    except ValueError:
        raise _bad("original_ref", "is not JSON") from None
    if not isinstance(ref, dict) or not isinstance(ref.get("filename"), str) or not ref["filename"]:
        raise _bad("original_ref", "must be a JSON object with a 'filename'")
    for key in ("subfolder", "type"):
        if ref.get(key) is not None and not isinstance(ref[key], str):
            raise _bad("original_ref", f"{key} must be a string")
    return ref


def _masked_png(front, post, mask_data: bytes) -> bytes:
    """The original with the mask file's alpha as its alpha (ComfyUI: convert both to RGBA, putalpha), its PNG text
    chunks kept, compress level 4."""
    from PIL.PngImagePlugin import PngInfo
    ref = _original_ref(post)
    try:
        with open(_original_path(front, ref), "rb") as f:
            original = _checked_image(f.read(), "original_ref")
    except FileNotFoundError:
        raise refuse(404, f"original_ref: no image {ref['filename'][:100]!r} there", field="original_ref") from None
    except inputs.InputNameError as e:                # the form field is original_ref; the message says which part
        raise _bad("original_ref", str(e)) from None
    alpha = _checked_image(mask_data).convert("RGBA").getchannel("A")
    if alpha.size != original.size:
        raise _bad("image", f"the mask is {alpha.width}x{alpha.height} but the original is "
                            f"{original.width}x{original.height}")
    meta = PngInfo()
    for key, value in original.info.items():
        if isinstance(key, str) and isinstance(value, str):
            meta.add_text(key, value)
    out = original.convert("RGBA")
    out.putalpha(alpha)
    buf = io.BytesIO()
    out.save(buf, "PNG", compress_level=4, pnginfo=meta)
    return buf.getvalue()


async def upload_mask(request: web.Request) -> web.Response:
    return await _upload(request, _masked_png)


def serves(kind: str, subfolder: str) -> bool:
    """Is this /view request for an upload (not a job's file)? A malformed subfolder is the upload view's 400."""
    try:
        parts = inputs.check_subfolder(subfolder)
    except inputs.InputNameError:
        return True
    return kind in ("input", "temp") or (kind == "output" and not inputs.job_of(kind, parts))


async def view(request: web.Request, filename: str, subfolder: str, kind: str) -> web.Response:
    """An uploaded image, read without following links; 400 for a name that could not be there, else 404."""
    front = request.app[FRONT]
    sub, name, kind = inputs.annotated(filename, kind)
    sub = f"{subfolder}/{sub}" if subfolder and sub else (subfolder or sub)
    try:
        path = inputs.find(front.rf.root, kind, sub, name)
        ctype = inputs.IMAGE_TYPES.get(os.path.splitext(name)[1].lower())
        if ctype is None:
            raise FileNotFoundError(name)
        data = await files.read_async(path)
    except inputs.InputNameError as e:
        raise refuse(400, str(e), field=e.field) from None
    except OSError:
        raise refuse(404, "no such file") from None
    return web.Response(body=data, content_type=ctype,
                        headers={"Content-Disposition": f'filename="{name}"', "Cache-Control": "no-cache"})


def loader_nodes(images: list[str]) -> dict:
    """/object_info's LoadImage and LoadImageMask, as ComfyUI lists them (its `image` choices: the input folder's
    images, sorted; the upload widget's `image_upload` option)."""
    nodes = [n for n in image_nodes(tuple(images)) if n.class_type in ("LoadImage", "LoadImageMask")]
    return object_info({n.class_type: n for n in nodes})


def input_images(front) -> list[str]:
    return inputs.list_images(front.rf.root)


ROUTES = [("POST", "/upload/image", upload_image), ("POST", "/upload/mask", upload_mask)]
