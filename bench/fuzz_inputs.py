"""bench/fuzz_http.py's image and sampling-bound requests (issue 45): init images of every shape through each way in
(thin, huge, decompression bombs, odd modes, every `resize_mode`), and the bounds of a schedule (a tiny `denoise`,
`steps` past the limits, a hires pass's `denoise` and `steps`) through prompt.json, a ComfyUI graph and A1111.

    images = input_images()                 # {name: PNG/JPEG bytes}, built once
    names = upload(url, images)             # {name: the upload's LoadImage name}
    gen = InputRequests(graph_of, images, names); gen.sampling_page(rng) -> (method, path, JSON text)
"""
from __future__ import annotations

import base64
import io
import json
import random
import struct
import zlib

import numpy as np
import requests
from PIL import Image

DENOISES = (1e-300, 5e-324, 1e-7, 1e-4, 0.0008, 0.02, 0.5, 1.0, 0.0, -1.0, 1.0000001, "0.5", None, True)
STEPS = (1, 8, 200, 201, 1000, 10_000, 0, -1, 2.5, "8")
RESIZE_MODES = (0, 1, 2, 3, None, -1, "1", 1.5, 4, 2**31, "crop", [])


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _bomb(width: int, height: int, color: int = 2) -> bytes:
    """A PNG whose header claims width x height, its IDAT a few compressed bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 4096))
            + _chunk(b"IEND", b""))


def _saved(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def input_images() -> dict[str, bytes]:
    """Thin (both ways, up to 16384 pixels long), huge (4096 square), bombs (header-only giants) and modes."""
    rng = np.random.default_rng(45)

    def rgb(w, h):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    out = {"ok256.png": _saved(rgb(256, 256))}
    for w, h in ((8192, 1), (1, 8192), (16384, 1), (1, 16384), (16384, 2), (3, 9000)):
        out[f"thin_{w}x{h}.png"] = _saved(rgb(w, h))
    out["huge_4096.png"] = _saved(Image.new("RGB", (4096, 4096), (40, 80, 120)))
    out["bomb_100000.png"] = _bomb(100_000, 100_000)
    out["bomb_1x2e9.png"] = _bomb(1, 2_000_000_000, color=0)
    for mode in ("L", "LA", "RGBA", "P", "1", "I;16"):                  # what a PNG holds besides RGB
        im = rgb(96, 64).convert("L" if mode.startswith("I") else mode)
        out[f"mode_{mode.replace(';', '')}.png"] = _saved(im.convert(mode) if mode.startswith("I") else im)
    out["mode_cmyk.jpg"] = _saved(rgb(96, 64).convert("CMYK"), "JPEG")
    return out


def upload(url: str, images: dict[str, bytes], timeout_s: float = 60.0) -> dict[str, str]:
    """Each image through /upload/image -> {name: the name a prompt gives}; the front's refusals left out."""
    names = {}
    for name, data in images.items():
        r = requests.post(url + "upload/image", files={"image": (name, data)}, data={"overwrite": "true"},
                          timeout=timeout_s)
        if r.status_code == 200:
            names[name] = r.json()["name"]
    return names


def denoise_of(rng: random.Random):
    """A denoise: a named edge (DENOISES), a 4-digit fraction, or 10^-323..1 (subnormals to whole)."""
    r = rng.random()
    if r < 0.3:
        return rng.choice(DENOISES)
    return round(rng.random(), 4) if r < 0.65 else 10.0 ** rng.uniform(-323.0, 0.0)


def valid_or(rng: random.Random, valid, odd, p_valid: float = 0.7):
    """A value the job accepts (`valid(rng)`) with probability `p_valid`, else `odd(rng)`: image cases mostly reach
    the image work instead of a refusal of another field."""
    return valid(rng) if rng.random() < p_valid else odd(rng)


def _fraction(rng: random.Random) -> float:
    return round(rng.uniform(0.05, 1.0), 4)


def steps_of(rng: random.Random):
    """Steps: a named edge (STEPS), 1..255, or anything to a million (negative too)."""
    r = rng.random()
    if r < 0.3:
        return rng.choice(STEPS)
    return rng.randrange(1, 256) if r < 0.8 else rng.randrange(-10, 10**6)


def size_of(rng: random.Random) -> tuple:
    """(width, height): mostly the harness pack's 128x128, sometimes a size no pack has (refused at submit)."""
    return (128, 128) if rng.random() < 0.9 else (rng.randrange(0, 4097, 8), rng.randrange(0, 4097, 8))


class InputRequests:
    """(method, path, JSON text) requests of init images and schedule bounds, one kind (KINDS) at a time, each drawn
    from the Random it is given (bench/fuzz_cases.py gives every case its own). The seed is fixed: two cases differ
    in what the fuzz varies, so counting distinct texts counts distinct cases."""
    KINDS = ("image_page", "image_a1111", "sampling_page", "sampling_comfy", "sampling_a1111")

    def __init__(self, graph_of, images: dict[str, bytes], names: dict[str, str]):
        self.graph_of, self.images, self.names = graph_of, images, names
        self.b64 = {k: base64.b64encode(v).decode() for k, v in images.items()}

    @staticmethod
    def _job(rng: random.Random, **extra) -> dict:
        w, h = size_of(rng)
        return {"prompt": "fuzz", "seed": 1, "steps": 1, "width": w, "height": h, "spectrum": False, **extra}

    def image_page(self, rng: random.Random) -> tuple:
        name = rng.choice(sorted(self.names))
        body = self._job(rng, init_image=self.names[name],
                         resize_mode=valid_or(rng, lambda r: r.choice((0, 1, 2)), lambda r: r.choice(RESIZE_MODES)),
                         denoise=valid_or(rng, _fraction, denoise_of))
        return "POST", "anima/jobs", json.dumps(body)

    def image_a1111(self, rng: random.Random) -> tuple:
        name = rng.choice(sorted(self.b64))
        w, h = size_of(rng)
        body = {"prompt": "fuzz", "steps": 1, "width": w, "height": h, "seed": 1,
                "init_images": [self.b64[name]],
                "resize_mode": valid_or(rng, lambda r: r.choice((0, 1, 2)), lambda r: r.choice(RESIZE_MODES)),
                "denoising_strength": valid_or(rng, _fraction, denoise_of)}
        return "POST", "sdapi/v1/img2img", json.dumps(body)

    def sampling_page(self, rng: random.Random) -> tuple:
        body = self._job(rng, steps=steps_of(rng), denoise=denoise_of(rng))
        if "ok256.png" in self.names and rng.random() < 0.5:
            body.update(init_image=self.names["ok256.png"], resize_mode=1)
        if rng.random() < 0.3:
            body["start_step"] = rng.choice([0, 2, 7, 199, rng.randrange(-5, 10**6)])
        if rng.random() < 0.3:
            body.update(denoise=1.0, hires={"scale": rng.choice([1.5, 1.25, 2.0, 0.5, 8.0]),
                                            "denoise": denoise_of(rng), "steps": steps_of(rng)})
        return "POST", "anima/jobs", json.dumps(body)

    def sampling_comfy(self, rng: random.Random) -> tuple:
        g = self.graph_of()
        g["3"]["inputs"].update(denoise=denoise_of(rng), steps=steps_of(rng))
        return "POST", "prompt", json.dumps({"prompt": g})

    def sampling_a1111(self, rng: random.Random) -> tuple:
        w, h = size_of(rng)
        body = {"prompt": "fuzz", "steps": steps_of(rng), "width": w, "height": h, "seed": 1, "enable_hr": True,
                "hr_scale": rng.choice([1.0, 1.5, 2.0, 0.5]), "denoising_strength": denoise_of(rng),
                "hr_second_pass_steps": steps_of(rng)}
        return "POST", "sdapi/v1/txt2img", json.dumps(body)
