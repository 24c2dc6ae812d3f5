"""Issue 27 items 6 and 8, the image decoder (models/images): bombs refused from the header before decoding, not an
image refused clearly, 16-bit / CMYK / palette / LA / RGBA / EXIF-rotated files converted as ComfyUI's LoadImage and
LoadImageMask convert them (checked against numpy computations on the file's raw values), A1111's mask rule and its
resize modes. Every file is made here, a few pixels each."""
from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from models.images import (ImageInputError, ImageSizeError, a1111_mask, fit_image, load_image, load_image_mask,
                           open_bounded)

RNG = np.random.default_rng(27)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def raw_png(width: int, height: int, depth: int, color: int, rows: bytes | None = None) -> bytes:
    """A PNG written byte by byte (no Pillow): IHDR as given, the rows (filter 0) compressed, or no IDAT at all."""
    out = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0))
    if rows is not None:
        out += _chunk(b"IDAT", zlib.compress(rows))
    return out + _chunk(b"IEND", b"")


def saved(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("data, words", [
    (b"", "empty"), (b"hello, this is text", "not an image"), (b"%PDF-1.7\n" + b"x" * 100, "not an image"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 30, "not"),
], ids=["empty", "text", "pdf", "broken-png-header"])
def test_not_an_image_is_refused_clearly(data, words):
    with pytest.raises(ImageInputError, match=words):
        load_image(data)


def test_truncated_pixel_data_is_refused():
    full = saved(Image.fromarray(RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    with pytest.raises(ImageInputError, match="cannot be decoded"):
        load_image(full[:len(full) // 2])


def test_bomb_header_100000_square_is_refused_before_decoding():
    """A 100000x100000 RGB PNG (30 GB decoded) whose IDAT would be tiny: refused from the header, in milliseconds."""
    bomb = raw_png(100_000, 100_000, 8, 2, rows=b"\x00" * 1000)
    t0 = time.perf_counter()
    with pytest.raises(ImageInputError, match="decompression bomb|100000x100000"):
        load_image(bomb)
    assert time.perf_counter() - t0 < 0.5


def test_pillow_bomb_warning_is_an_error():
    """Between Pillow's warning level (89 Mpixel) and its error level: Pillow only warns; refused here."""
    with pytest.raises(ImageInputError, match="decompression bomb"):
        open_bounded(raw_png(10_000, 9_000, 8, 0), max_pixels=2**40)


def test_own_bound_refuses_below_pillows_and_names_the_sizes():
    with pytest.raises(ImageInputError, match=r"5000x5000 \(25000000 pixels\).*at most 16777216"):
        load_image(raw_png(5000, 5000, 8, 0))
    small = saved(Image.new("RGB", (40, 30)))
    with pytest.raises(ImageInputError, match="40x30"):
        load_image(small, max_pixels=1000)
    assert load_image(small, max_pixels=1200).size == (40, 30)


# ---------------------------------------------------------------- conversions against numpy


def test_16_bit_grey_is_scaled_to_full_range():
    grey = RNG.integers(0, 65536, (9, 13), dtype=np.uint16)
    rows = b"".join(b"\x00" + grey[y].astype(">u2").tobytes() for y in range(9))
    img = load_image(raw_png(13, 9, 16, 0, rows))
    assert img.mask is None and img.size == (13, 9)
    np.testing.assert_allclose(img.pixels, np.repeat(grey[:, :, None] / 65535.0, 3, axis=2), atol=1e-6)


def test_16_bit_rgb_keeps_the_high_byte():
    rgb = RNG.integers(0, 65536, (5, 7, 3), dtype=np.uint16)
    rows = b"".join(b"\x00" + rgb[y].astype(">u2").tobytes() for y in range(5))
    img = load_image(raw_png(7, 5, 16, 2, rows))
    np.testing.assert_allclose(img.pixels, (rgb >> 8) / 255.0, atol=1e-6)


def test_cmyk_jpeg_converts_as_pillow_multiplies_by_k():
    cmyk = RNG.integers(0, 256, (16, 16, 4), dtype=np.uint8)
    data = saved(Image.fromarray(cmyk, "CMYK"), "JPEG", quality=95)
    stored = np.asarray(Image.open(io.BytesIO(data)), dtype=np.float64)       # the decoded C, M, Y, K
    assert stored.shape == (16, 16, 4)
    k = 255.0 - stored[:, :, 3:]
    expect = (255.0 - stored[:, :, :3]) * k / 255.0 / 255.0
    np.testing.assert_allclose(load_image(data).pixels, expect, atol=1.01 / 255)


def test_palette_with_transparency_gives_colours_and_mask():
    palette = RNG.integers(0, 256, (4, 3), dtype=np.uint8)
    alpha = np.array([255, 0, 128, 40], dtype=np.uint8)
    index = RNG.integers(0, 4, (6, 8), dtype=np.uint8)
    im = Image.fromarray(index, "P")
    im.putpalette(palette.reshape(-1).tolist())
    data = saved(im, transparency=alpha.tobytes())
    img = load_image(data)
    np.testing.assert_allclose(img.pixels, palette[index] / 255.0, atol=1e-6)
    np.testing.assert_allclose(img.mask, 1.0 - alpha[index] / 255.0, atol=1e-6)


def test_palette_without_transparency_has_no_mask():
    im = Image.fromarray(RNG.integers(0, 3, (4, 4), dtype=np.uint8), "P")
    im.putpalette([10, 20, 30, 40, 50, 60, 70, 80, 90])
    assert load_image(saved(im)).mask is None


def test_la_and_rgba_give_comfyui_mask_one_minus_alpha():
    la = RNG.integers(0, 256, (5, 6, 2), dtype=np.uint8)
    img = load_image(saved(Image.fromarray(la, "LA")))
    np.testing.assert_allclose(img.pixels, np.repeat(la[:, :, :1] / 255.0, 3, axis=2), atol=1e-6)
    np.testing.assert_allclose(img.mask, 1.0 - la[:, :, 1] / 255.0, atol=1e-6)
    rgba = RNG.integers(0, 256, (5, 6, 4), dtype=np.uint8)
    img = load_image(saved(Image.fromarray(rgba, "RGBA")))
    np.testing.assert_allclose(img.pixels, rgba[:, :, :3] / 255.0, atol=1e-6)
    np.testing.assert_allclose(img.mask, 1.0 - rgba[:, :, 3] / 255.0, atol=1e-6)


def test_load_image_mask_channels():
    rgba = RNG.integers(0, 256, (5, 6, 4), dtype=np.uint8)
    data = saved(Image.fromarray(rgba, "RGBA"))
    for i, channel in enumerate(("red", "green", "blue")):
        np.testing.assert_allclose(load_image_mask(data, channel), rgba[:, :, i] / 255.0, atol=1e-6)
    np.testing.assert_allclose(load_image_mask(data, "alpha"), 1.0 - rgba[:, :, 3] / 255.0, atol=1e-6)
    grey = RNG.integers(0, 256, (5, 6), dtype=np.uint8)
    g = saved(Image.fromarray(grey, "L"))
    np.testing.assert_allclose(load_image_mask(g, "red"), grey / 255.0, atol=1e-6)
    np.testing.assert_allclose(load_image_mask(g, "alpha"), 0.0)           # an opaque file masks nothing
    with pytest.raises(ImageInputError, match="channel 'luma'"):
        load_image_mask(data, "luma")


def test_exif_orientation_is_applied():
    """Orientation 6 (the camera was turned): shown turned 90 degrees clockwise, as ImageOps.exif_transpose does."""
    rgb = RNG.integers(0, 256, (4, 7, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    img = load_image(saved(Image.fromarray(rgb), exif=exif.tobytes()))
    assert img.size == (4, 7)
    np.testing.assert_allclose(img.pixels, np.rot90(rgb, k=-1) / 255.0, atol=1e-6)


def test_a1111_mask_rule():
    rgb = RNG.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    c = rgb.astype(np.float64)
    luma = (c[:, :, 0] * 299 + c[:, :, 1] * 587 + c[:, :, 2] * 114) / 1000.0       # ITU-R 601-2
    np.testing.assert_allclose(a1111_mask(saved(Image.fromarray(rgb))) * 255, luma, atol=1.0)
    rgba = np.concatenate([rgb, RNG.integers(0, 256, (6, 5, 1), dtype=np.uint8)], axis=2)
    expect = (rgba[:, :, 3] > 128).astype(np.float32)
    np.testing.assert_array_equal(a1111_mask(saved(Image.fromarray(rgba, "RGBA"))), expect)
    opaque = rgba.copy()
    opaque[:, :, 3] = 255                                   # all opaque: the greyscale of the colours
    np.testing.assert_allclose(a1111_mask(saved(Image.fromarray(opaque, "RGBA"))) * 255, luma, atol=1.0)


# ---------------------------------------------------------------- A1111's resize modes


def _blocks(width: int, height: int, block: int) -> np.ndarray:
    """Flat colour blocks of `block` pixels: Lanczos keeps a block's inside exact at an integer scale."""
    colours = RNG.integers(0, 256, (height // block, width // block, 3), dtype=np.uint8)
    return np.repeat(np.repeat(colours, block, axis=0), block, axis=1)


def test_wrong_size_without_a_mode_names_both_sizes():
    im = Image.new("RGB", (96, 64))
    with pytest.raises(ImageSizeError, match="96x64 but the job is 64x64.*0 just resize"):
        fit_image(im, 64, 64, None, what="init_images[0]")
    with pytest.raises(ImageSizeError, match="resize mode 3"):
        fit_image(im, 64, 64, 3)
    assert fit_image(im, 96, 64, None) is im


def _inner(n: int, block: int) -> list[int]:
    """Output positions at least 3 pixels inside their block (Lanczos' reach at a 2x downscale)."""
    return [x for x in range(n) if 3 <= x % block <= block - 4]


def test_just_resize_stretches():
    src = _blocks(128, 64, 32)                     # 2:1 onto 64x64: width halved, height kept
    out = np.asarray(fit_image(Image.fromarray(src), 64, 64, 0))
    expect = src[:, ::2]
    inside = np.ix_(_inner(64, 32), _inner(64, 16))
    np.testing.assert_array_equal(out[inside], expect[inside])


def test_crop_and_resize_keeps_the_centre():
    src = _blocks(256, 128, 32)                    # 2:1 onto 1:1: height fits (128 -> 64), the middle 64 columns kept
    out = np.asarray(fit_image(Image.fromarray(src), 64, 64, 1))
    centre = src[::2, ::2][:, 32:96]               # the exact halving of the block image, its centre
    inside = np.ix_(_inner(64, 16), _inner(64, 16))
    np.testing.assert_array_equal(out[inside], centre[inside])


def test_resize_and_fill_stretches_the_edges():
    src = _blocks(128, 64, 16)                     # 2:1 into 1:1 at 64: the image 64x32 in the middle rows 16..47
    out = np.asarray(fit_image(Image.fromarray(src), 64, 64, 2)).astype(int)
    half = src[::2, ::2].astype(int)
    rows, cols = _inner(32, 8), _inner(64, 8)
    np.testing.assert_array_equal(out[16:48][np.ix_(rows, cols)], half[np.ix_(rows, cols)])
    # the strips above and below repeat the resized image's first and last rows
    for y in range(16):
        assert np.abs(out[y, cols] - half[0, cols]).max() <= 2
        assert np.abs(out[48 + y, cols] - half[-1, cols]).max() <= 2


def _a1111_crop_and_resize(im, width, height):
    """A1111's resize_image mode 1 as it is written: the whole image to its cover size, then the centre pasted."""
    ratio, src_ratio = width / height, im.width / im.height
    src_w = width if ratio > src_ratio else im.width * height // im.height
    src_h = height if ratio <= src_ratio else im.height * width // im.width
    resized = im.resize((src_w, src_h), resample=Image.LANCZOS)
    out = Image.new(im.mode, (width, height))
    out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    return out


def _random_images(n, seed):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        w, h = (int(v) for v in rng.integers(8, 300, 2))
        mode = ("RGB", "L", "RGBA")[int(rng.integers(0, 3))]
        a = rng.integers(0, 256, (h, w, {"RGB": 3, "L": 1, "RGBA": 4}[mode]), dtype=np.uint8)
        yield Image.fromarray(a[..., 0] if mode == "L" else a, mode), 16 * int(rng.integers(2, 30)), \
            16 * int(rng.integers(2, 30))


def _cover(im, w, h):
    """A1111's cover size of `im` for a w x h job."""
    wider = w / h <= im.width / im.height
    return (im.width * h // im.height, h) if wider else (w, im.height * w // im.width)


def test_crop_and_resize_equals_a1111s_scale_then_crop(monkeypatch):
    import models.images.fit as fit
    checked = 0
    for im, w, h in _random_images(60, 1):                  # about the job's aspect: the whole resize, as A1111
        cw, ch = _cover(im, w, h)
        if cw * ch <= fit.FULL_RESIZE_LIMIT * w * h:
            checked += 1
            np.testing.assert_array_equal(np.asarray(fit_image(im, w, h, 1)),
                                          np.asarray(_a1111_crop_and_resize(im, w, h)))
    # only the window computed (what a thin image gets), on ordinary sizes whose short side is enlarged: the same
    monkeypatch.setattr(fit, "FULL_RESIZE_LIMIT", 0)
    for im, w, h in _random_images(80, 2):
        cw, ch = _cover(im, w, h)
        if (ch == h and h > im.height) or (cw == w and w > im.width):
            checked += 1
            np.testing.assert_array_equal(np.asarray(fit_image(im, w, h, 1)),
                                          np.asarray(_a1111_crop_and_resize(im, w, h)),
                                          err_msg=f"{im.mode} {im.size} -> {w}x{h}")
    assert checked >= 60


@pytest.mark.parametrize("size", [(8192, 1), (1, 8192), (16384, 3)])
def test_a_thin_image_is_cropped_without_its_cover_size(monkeypatch, size):
    # an 8192x1 image for a 256x256 job was resized whole to 2,097,152x256 (the daemon 68 -> 2,221 MB)
    real = Image.Image.resize

    def bounded(self, dims, *args, **kwargs):
        assert dims[0] * dims[1] <= 4 * 256 * 256 * 64, f"resized to {dims}"   # the job's size times a long side
        return real(self, dims, *args, **kwargs)
    rng = np.random.default_rng(3)
    line = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    im = Image.fromarray(line)
    monkeypatch.setattr(Image.Image, "resize", bounded)
    out = np.asarray(fit_image(im, 256, 256, 1))
    monkeypatch.setattr(Image.Image, "resize", real)
    assert out.shape == (256, 256, 3)
    if 1 in size:                               # one row (column): every output row (column) is its resized window
        wide = size[1] == 1
        src = size[0] if wide else size[1]
        cover = src * 256                      # the long side at the cover size, computed alone as a reference
        ref = np.asarray(im.resize((cover, 1) if wide else (1, cover), resample=Image.LANCZOS))
        start = cover // 2 - 128
        want = ref[0, start:start + 256] if wide else ref[start:start + 256, 0]
        got = out[0] if wide else out[:, 0]
        np.testing.assert_array_equal(got, want)
        assert (out == (out[:1] if wide else out[:, :1])).all()


@pytest.mark.parametrize("size", [(8192, 1), (1, 8192), (300, 1)])
def test_resize_and_fill_keeps_a_thin_image_at_one_pixel(size):
    # A1111's resize height int(1 * 256 / 8192) = 0: "height and width must be > 0" (a 409 naming no field here)
    im = Image.fromarray(np.full((size[1], size[0], 3), 200, np.uint8))
    out = np.asarray(fit_image(im, 256, 256, 2))
    assert out.shape == (256, 256, 3) and (out == 200).all()


def test_load_image_holds_one_float_copy_of_the_pixels():
    """The IMAGE is made in place: its peak is the float32 pixels and the decoded bytes, not a second float copy
    (a 4096x4096 upload was ~450 MB at its peak). tracemalloc sees numpy's buffers; the values are LoadImage's."""
    import tracemalloc
    from PIL import Image as PILImage
    from models.images.decode import load_image
    rng = np.random.default_rng(3)
    side = 1024
    raw = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(raw).save(buf, "PNG", compress_level=0)
    tracemalloc.start()
    try:
        got = load_image(buf.getvalue())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    floats = side * side * 3 * 4
    assert peak < 1.75 * floats, (peak, floats)          # the floats, the decoded bytes and the file; two floats: 2.5x
    assert np.array_equal(got.pixels, raw.astype(np.float32) / 255.0)
