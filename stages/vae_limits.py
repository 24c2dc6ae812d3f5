"""What a DECODE (or a VAE_ENCODE: check_encode) may ask of the VAE stage, checked before any work: every violation
is a ProtocolError (an ERROR reply naming the field; the stage keeps serving). For a remote VAE every allowed client
can send these.

- latent: f32 [z, h, w] with the decoder's z channels and 1 <= h, w <= `[stage.vae] max_latent`;
- tile: `tile_min` <= tile <= `tile_max`, and the stride (tile minus overlap) at least `min_stride_fraction` of the
  tile, so the decode work stays under 1/min_stride_fraction² of an untiled one (stride 1 made it quadratic: a 32×32
  latent took 3.9 s instead of 0.1 s); an untiled decode only for latents within `tile_max`. A VAE pack tiles by its
  own plan (fixed shapes), so these fields are not used or bounded there;
- output: refused when the stage listens on tcp (remote peers get the PNG inline: `return_png`); locally an absolute
  `.png` path directly in the job's own folder `RUN/jobs/<job>/`, nowhere else;
- metadata: usable PNG text chunks (models/vae/png.py).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from models.vae.png import png_text_problem
from models.vae.tiled import check_tiling
from protocol import messages as m
from protocol.fields import ProtocolError
from stages.config import PipelineConfig

NAME_MAX_BYTES = 255            # one path component (Linux)


@dataclass(frozen=True)
class DecodeLimits:
    z_dim: int                  # latent channels of the loaded decoder
    max_latent: int             # h and w, latent pixels
    tile_min: int
    tile_max: int
    min_stride_fraction: float
    remote: bool                # the stage listens on tcp: no output paths at all
    jobs_dir: Path              # RUN/jobs, resolved
    fixed_tiling: bool = False  # a VAE pack: its tiling is its own, DECODE's tile fields are not used

    @classmethod
    def from_config(cls, config: PipelineConfig, z_dim: int, fixed_tiling: bool = False) -> "DecodeLimits":
        """`z_dim`: the loaded decoder's latent channels (its VAEConfig; a VAE pack's manifest)."""
        s = config.stage_settings("vae")
        return cls(z_dim=z_dim, max_latent=s["max_latent"], tile_min=s["tile_min"], tile_max=s["tile_max"],
                   min_stride_fraction=s["min_stride_fraction"], remote=config.is_remote("vae"),
                   jobs_dir=Path(os.path.realpath(config.jobs_dir)), fixed_tiling=fixed_tiling)


@dataclass(frozen=True)
class DecodePlan:
    tile: int | None            # None: decode whole
    overlap: float
    output: str | None          # where the PNG goes on this machine


def check_decode(msg: m.Decode, limits: DecodeLimits) -> DecodePlan:
    """The checked request as a plan; ProtocolError naming the field for anything out of bounds."""
    # 1) the latent's descriptor (its bytes are read later, against these bounds)
    lat, z = msg.latent, limits.z_dim
    if lat.dtype != "f32" or len(lat.shape) != 3 or lat.shape[0] != z:
        raise ProtocolError("latent", f"expected f32 [{z}, h, w], got {lat.dtype} {list(lat.shape)}")
    h, w = lat.shape[1:]
    if not (1 <= h <= limits.max_latent and 1 <= w <= limits.max_latent):
        raise ProtocolError("latent", f"latent {h}x{w} is outside 1..{limits.max_latent} per side "
                                      "([stage.vae] max_latent)")
    # 2) tiling
    t = msg.tile
    tile = _tile(t, h, w, limits, "decode")
    # 3) where the PNG goes
    if msg.output is None:
        if not msg.return_png:
            raise ProtocolError("output", "give an output path or ask for return_png")
        output = None
    elif limits.remote:
        raise ProtocolError("output", "a VAE served over tcp writes no files for its clients: ask for return_png")
    else:
        output = _job_output(msg.output, msg.job, limits.jobs_dir)
    # 4) PNG text chunks
    for key, value in msg.metadata.items():
        problem = png_text_problem(key, value)
        if problem:
            raise ProtocolError(f"metadata.{key}"[:200], problem)
    return DecodePlan(tile=tile, overlap=t.overlap, output=output)


def _tile(t: m.TileSettings, h: int, w: int, limits: DecodeLimits, what: str) -> int | None:
    """The tile side for a latent h x w (None: whole, or a VAE pack's own plan); ProtocolError naming the field."""
    if limits.fixed_tiling:                     # a VAE pack tiles by its own plan: the request's tile fields are unused
        return None
    if not t.enabled:
        if max(h, w) > limits.tile_max:
            raise ProtocolError("tile.enabled", f"an untiled {what} is limited to {limits.tile_max} latent pixels per "
                                                f"side ([stage.vae] tile_max); this latent is {h}x{w}")
        return None
    if not limits.tile_min <= t.tile <= limits.tile_max:
        raise ProtocolError("tile.tile", f"tile {t.tile} is outside {limits.tile_min}..{limits.tile_max} "
                                         "([stage.vae] tile_min, tile_max)")
    try:
        stride = check_tiling(t.tile, t.overlap)    # the decoders' own rule (models/vae/tiled.py)
    except ValueError as e:
        raise ProtocolError("tile", str(e)) from None
    least = math.ceil(limits.min_stride_fraction * t.tile)
    if stride < least:
        raise ProtocolError("tile.overlap", f"overlap {t.overlap} leaves a stride of {stride} for tile {t.tile}; "
                                            f"at least {least} is needed ([stage.vae] min_stride_fraction "
                                            f"{limits.min_stride_fraction})")
    return t.tile


def check_encode(msg: m.VaeEncode, limits: DecodeLimits, down: int = 8) -> DecodePlan:
    """A VAE_ENCODE's image and latent descriptors and tiling checked before any byte is read (the latent h x w,
    H/8 x W/8, within [stage.vae] max_latent); -> the plan (no output path: the latent goes to its slot or inline)."""
    img = msg.image
    if img.dtype != "f32" or len(img.shape) != 3 or img.shape[0] != 3:
        raise ProtocolError("image", f"expected f32 [3, H, W] in [-1, 1], got {img.dtype} {list(img.shape)}")
    hh, ww = img.shape[1:]
    if hh < down or ww < down or hh % down or ww % down:
        raise ProtocolError("image", f"{ww}x{hh} pixels: width and height must be positive multiples of {down}")
    h, w = hh // down, ww // down
    if h > limits.max_latent or w > limits.max_latent:
        raise ProtocolError("image", f"{ww}x{hh} pixels: the latent {h}x{w} is outside 1..{limits.max_latent} per "
                                     "side ([stage.vae] max_latent)")
    want = (limits.z_dim, h, w)
    if msg.latent is not None and (msg.latent.dtype != "f32" or tuple(msg.latent.shape) != want):
        raise ProtocolError("latent", f"expected f32 {list(want)} for a {ww}x{hh} image, got {msg.latent.dtype} "
                                      f"{list(msg.latent.shape)}")
    return DecodePlan(tile=_tile(msg.tile, h, w, limits, "encode"), overlap=msg.tile.overlap, output=None)


def _job_output(output: str, job: str, jobs_dir: Path) -> str:
    """`output` when it is an absolute .png path directly in RUN/jobs/<job>/ (links in the folder path resolved)."""
    name = os.path.basename(output)
    if not os.path.isabs(output) or not name.endswith(".png") or name == ".png":
        raise ProtocolError("output", f"{output[:300]!r}: expected an absolute path ending in .png")
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
        raise ProtocolError("output", f"file name of {len(name)} characters is too long")
    folder = os.path.realpath(os.path.dirname(output))
    if folder != str(jobs_dir / job):
        raise ProtocolError("output", f"{output[:300]!r} is not in this job's folder {jobs_dir / job}")
    return os.path.join(folder, name)
