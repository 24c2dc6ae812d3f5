"""A job's init image and mask at submit: the uploads its prompt names (prompt.json `init_image`, `mask`) read from
the run folder's upload folders (orchestrator.engine.inputs.read_upload: no link followed, bounded decoding), brought to the
job's size (A1111's resize modes with `resize_mode`, else refused naming both sizes) and written as the PNGs the job
folder keeps (JobStore.submit(inputs=...)), so a resumed job reads the same pixels the first run read.

The mask is A1111's rule (models.images.a1111_mask): white (or a translucent RGBA mask's alpha) is repainted; with
`mask_channel` ComfyUI's LoadImageMask of that channel (LoadImage's MASK is "alpha": 1 - alpha), kept 8-bit (exact for
8-bit sources: (255 - a) / 255 is a grey level). The
pixels the flow feeds the VAE encoder and the noise mask at the latent's size come from those kept PNGs."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from orchestrator.engine.inputs import InputNameError, read_upload
from protocol.prompt import PromptError


def _png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _read(run_root: Path, ref: str, field: str) -> bytes:
    from models.images import ImageInputError
    try:
        return read_upload(run_root, ref, field=field)
    except InputNameError as e:
        raise PromptError(field, str(e).removeprefix(f"{field}: ")) from None
    except FileNotFoundError:
        raise PromptError(field, f"{ref[:200]!r} is not an uploaded image (upload it with /upload/image, or give "
                                 "generate --init-image/--mask a file)") from None
    except ImageInputError as e:
        raise PromptError(field, f"{ref[:200]!r}: {e}") from None


def _fit(im, spec, field: str):
    from models.images import ImageInputError, fit_image
    try:
        return fit_image(im, spec.width, spec.height, spec.resize_mode, what=field)
    except ImageInputError as e:
        raise PromptError(field, f"{e}; or set \"resize_mode\"" if spec.resize_mode is None else str(e)) from None


def _rgb(data: bytes, field: str):
    """An upload's pixels as LoadImage's rounded to 8 bits (no float copy of them); PromptError naming `field`."""
    from models.images import ImageInputError, load_rgb8
    try:
        return load_rgb8(data)
    except ImageInputError as e:
        raise PromptError(field, str(e)) from None


def job_inputs(run_root: Path, spec) -> dict[str, bytes]:
    """{init_image, mask, mix_image (init_mix.image)} -> PNG bytes at the job's size (RGB 8-bit; the mask 8-bit
    grey, 255 = repaint); {} for a text-to-image job. PromptError naming the field for a missing upload, a
    non-image or a size that does not fit."""
    from PIL import Image
    from models.images import ImageInputError, a1111_mask8, load_image_mask
    out = {}
    if spec.init_image is None:
        return out
    im = _rgb(_read(run_root, spec.init_image, "init_image"), "init_image")
    out["init_image"] = _png(_fit(im, spec, "init_image"))
    if spec.init_mix is not None:                # the other upload of the start latent's mix, as init_image
        out["mix_image"] = _png(_fit(_rgb(_read(run_root, spec.init_mix.image, "init_mix.image"), "init_mix.image"),
                                     spec, "init_mix.image"))
    if spec.mask is not None:
        data = _read(run_root, spec.mask, "mask")
        try:
            grey = (a1111_mask8(data) if spec.mask_channel is None               # [H, W] uint8, 255 = repaint
                    else np.round(load_image_mask(data, spec.mask_channel) * 255).astype(np.uint8))
        except ImageInputError as e:
            raise PromptError("mask", str(e)) from None
        im = Image.fromarray(grey, "L")
        out["mask"] = _png(_fit(im, spec, "mask"))
    return out


def image_tensor(png: bytes, grey_mask: bytes | None = None) -> np.ndarray:
    """A kept init_image.png as the VAE encoder's input: [3, H, W] f32, 2 * pixel / 255 - 1; with `grey_mask` (a
    kept mask.png) the pixels under it grey first, as VAEEncodeForInpaint does on the float image."""
    from PIL import Image
    with Image.open(io.BytesIO(png)) as im:
        a = np.asarray(im.convert("RGB"), dtype=np.float32)                  # [H, W, 3] 0..255
    rgb = a / 255.0
    if grey_mask is not None:
        from models.images.inpaint import grey_under
        rgb = grey_under(rgb, mask_array(grey_mask))
    return np.ascontiguousarray((rgb * 2.0 - 1.0).transpose(2, 0, 1))


def mask_array(png: bytes, grow_mask_by: int | None = None) -> np.ndarray:
    """A kept mask.png as [H, W] f32 in [0, 1] (1 = repaint); with `grow_mask_by`, VAEEncodeForInpaint's noise mask
    (rounded, grown)."""
    from PIL import Image
    with Image.open(io.BytesIO(png)) as im:
        mask = np.asarray(im.convert("L"), dtype=np.float32) / 255.0
    if grow_mask_by is None:
        return mask
    from models.images.inpaint import grow_mask
    return grow_mask(mask, grow_mask_by)
