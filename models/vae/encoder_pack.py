"""VAE encoder packs: the Qwen-Image VAE encoder converted for one image size — one fixed-shape **features** tile graph
(conv1 and the downsampling stages) and the **head** graph (latent resolution, the whole image, with the middle
block's attention), FP32 ONNX, plus a manifest with hashes, the tiling plan and the FP16 calibration. Built like the
decoder's VAE packs (models/vae/pack.py) and compiled for the NPU by the same `anima-models compile`.

    PACK/manifest.json      kind "anima-vae-encoder-pack"; source, config, resolution, tiling, fp16, branches
    PACK/onnx/features.onnx image [1, 3, 8 th, 8 tw] in [-1, 1] -> feats [1, 384, th, tw]
    PACK/onnx/head.onnx     feats [1, 384, h, w] -> mean [1, 16, h, w] (VAE space)

models/vae/pack_encoder.py's `PackEncoder` runs one (kept apart so that loading a pack, as models.packs.kinds does,
never imports the runtime that runs it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from models.base.durable import building_folder, fsync_dir
from models.records.manifest import (BranchEntry, ManifestRecord, file_sha256, manifest_header, read_manifest, source_entry,
                             write_manifest)
from models.packs.pack import PACK_KIND as DIT_PACK_KIND
from models.packs.pack import Resolution, check_files, refuse_replacing
from models.dit.partition import Geometry
from models.vae.flops import features_flops, head_flops
from models.vae.keys import VAEConfig
from models.vae.pack import ONNX_DIR, TiledVaeGraphs, TilingEntry, VaeConfigEntry, VaePackError, check_branch_io, write_graphs
from models.vae.tiled import DEFAULT_OVERLAP, DEFAULT_TILE, blend, check_tiling, image_tile_inputs, tile_grid

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
PACK_KIND = "anima-vae-encoder-pack"
MODELS = ("features", "head")              # execution order
CALIBRATION_SEEDS = (0, 1)                 # seeded calibration images (calibration_image)


class EncodeError(RuntimeError):
    """A backend produced an unusable latent (NaN/Inf: e.g. an FP16 overflow on the NPU)."""


class VaeEncoderManifest(ManifestRecord, frozen=True):
    """A VAE encoder pack's manifest (the fields load_vae_encoder_pack reads)."""
    schema: int
    config: VaeConfigEntry
    resolution: Resolution
    tiling: TilingEntry
    branches: list[BranchEntry]


@dataclass
class VaeEncoderPack(TiledVaeGraphs):
    """An encoder pack (load_vae_encoder_pack)."""

    @property
    def image_shape(self) -> tuple:
        return (self.config.out_channels, self.height, self.width)


def calibration_image(seed: int, h: int, w: int) -> np.ndarray:
    """[3, H, W] f32 in [-1, 1]: seed 0 uniform noise (every pixel at its extremes' mix), others smooth colour waves
    with a little noise (the statistics of a photo): the activation ranges cover both."""
    rng = np.random.default_rng(seed)
    if seed == 0:
        return rng.uniform(-1.0, 1.0, (3, h, w)).astype(np.float32)
    yy, xx = np.mgrid[0:h, 0:w] / (8.0 + 4.0 * seed)
    ph = rng.uniform(0.0, 6.28, 3)
    img = 0.9 * np.stack([np.sin(yy + xx + ph[0]), np.cos(1.3 * yy + ph[1]), np.sin(0.7 * xx + ph[2])])
    return np.clip(img + 0.1 * rng.standard_normal((3, h, w)), -1.0, 1.0).astype(np.float32)


def _io(name: str, shape) -> list:
    return [{"name": name, "shape": [int(d) for d in shape], "dtype": "f32"}]


def _calibrate(w, cfg, hh: int, ww: int, th: int, tw: int, rows, cols, seeds, threads) -> tuple:
    """Activation ranges of the unscaled graphs on the calibration images (ONNX Runtime FP32) -> (scales, report)."""
    from models.vae.encoder_graphs import features_graph, head_graph
    from models.vae.fp16 import activation_ranges, headroom, norm_scales, ort_session
    feat, feat_norms = features_graph(w, cfg, th, tw)
    head, head_norms = head_graph(w, cfg, hh // cfg.upscale, ww // cfg.upscale)
    imgs = [calibration_image(s, hh, ww)[None] for s in seeds]                   # each [1, 3, H, W]
    tiles = [np.ascontiguousarray(t) for im in imgs for t in image_tile_inputs(im, rows, cols, cfg.upscale)]
    r_feat = activation_ranges(feat, [{"image": t} for t in tiles], threads)
    sess = ort_session(feat, threads)
    feats = [blend((sess.run(None, {"image": t})[0] for t in image_tile_inputs(im, rows, cols, cfg.upscale)),
                   rows, cols, 1)[None] for im in imgs]                            # each [1, C, h, w]
    del sess
    r_head = activation_ranges(head, [{"feats": f} for f in feats], threads)
    scales = {**norm_scales(feat_norms, r_feat), **norm_scales(head_norms, r_head)}
    report = {"features": headroom(r_feat, feat_norms, scales), "head": headroom(r_head, head_norms, scales)}
    return scales, report


def build_vae_encoder_pack(vae_path, out_dir, resolution=(512, 512), tile: int = DEFAULT_TILE,
                           overlap: float = DEFAULT_OVERLAP, overwrite: bool = False, seeds=CALIBRATION_SEEDS,
                           threads: Optional[int] = None) -> Path:
    """Convert the encoder of the VAE file at `vae_path` into an encoder pack at `out_dir` for `resolution` =
    (width, height) pixels."""
    from models.graphs.builder import OPSET
    from models.vae.checkpoint import load_vae_encoder
    from models.vae.encoder_graphs import FEATS_IN, FEATS_OUT, HEAD_IN, HEAD_OUT, features_graph, head_graph
    from models.vae.fp16 import SCALE_TARGET
    t0 = time.perf_counter()
    geom = Geometry.from_resolution(*resolution)                 # validates multiples of 8
    stride = check_tiling(tile, overlap)
    if not seeds:
        raise ValueError("calibration needs at least one seed")
    out = Path(out_dir).absolute()
    weights = load_vae_encoder(vae_path)
    cfg, w = weights.config, weights.tensors
    sha = file_sha256(vae_path)
    refuse_replacing(out, sha, (geom.width, geom.height), overwrite, VaePackError, source="file")
    h, wd, s = geom.latent_h, geom.latent_w, cfg.upscale
    rows, cols = tile_grid(h, wd, tile, overlap, 1)
    th, tw = rows[0][1], cols[0][1]
    scales, report = _calibrate(w, cfg, geom.height, geom.width, th, tw, rows, cols, seeds, threads)
    for name, r in report.items():
        if not r["ok"]:
            log.warning("encoder %s: FP16 headroom %s (largest activation %.1f at %s): the NPU may overflow", name,
                        r["headroom"], r["max_abs"], r["at"])
    graphs = {"features": (features_graph(w, cfg, th, tw, scales)[0], _io(FEATS_IN, (1, cfg.out_channels, s * th,
                           s * tw)), _io(FEATS_OUT, (1, cfg.mid_dim, th, tw)), features_flops(cfg, s * tw, s * th),
                           len(rows) * len(cols)),
              "head": (head_graph(w, cfg, h, wd, scales)[0], _io(HEAD_IN, (1, cfg.mid_dim, h, wd)),
                       _io(HEAD_OUT, (1, cfg.z_dim, h, wd)), head_flops(cfg, h, wd), 1)}
    with building_folder(out) as tmp:                 # renamed to `out` when complete, removed on any error
        manifest = {
            **manifest_header(PACK_KIND, SCHEMA_VERSION),
            "source": {**source_entry(vae_path, sha), "layout": weights.layout},
            "config": cfg.to_dict(), "resolution": {"width": geom.width, "height": geom.height},
            "latent": {"channels": cfg.z_dim, "h": h, "w": wd},
            "tiling": {"tile": tile, "overlap": overlap, "stride": stride, "tile_h": th, "tile_w": tw,
                       "rows": [r[0] for r in rows], "cols": [c[0] for c in cols], "count": len(rows) * len(cols)},
            "attention": "head", "output": "posterior mean, VAE space (normalised on the host)",
            "dtype": "fp32", "io_dtype": "f32", "opset": OPSET,
            "fp16": {"scale_target": SCALE_TARGET, "norm_scales": scales, "models": report,
                     "calibration": {"seeds": list(seeds), "image": "calibration_image"},
                     "ok": all(r["ok"] for r in report.values())},
            "branches": write_graphs(tmp, graphs, MODELS, "vae-encoder"),
        }
        write_manifest(tmp, manifest)
        fsync_dir(tmp / ONNX_DIR)
    log.info("VAE encoder pack %s: %dx%d, %d tiles of %dx%d + head %dx%d, built in %.1f s", out, geom.width,
             geom.height, len(rows) * len(cols), th, tw, h, wd, time.perf_counter() - t0)
    return out


def _check_branches(d: Path, where: str, rec, cfg: VAEConfig, geom, th: int, tw: int) -> None:
    names = [b.name for b in rec.branches]
    if names != list(MODELS):
        raise VaePackError(f"{where}: branches {names}, expected {list(MODELS)}")
    s, h, w = cfg.upscale, geom.latent_h, geom.latent_w
    want = {"features": ([1, cfg.out_channels, s * th, s * tw], [1, cfg.mid_dim, th, tw]),
            "head": ([1, cfg.mid_dim, h, w], [1, cfg.z_dim, h, w])}
    check_branch_io(d, rec.branches, want, where)


def load_vae_encoder_pack(pack_dir, check: bool = True) -> VaeEncoderPack:
    """Read and validate an encoder pack's manifest; with `check`, verify every file's existence and sha256."""
    d = Path(pack_dir).absolute()
    m, rec = read_manifest(d, VaeEncoderManifest, VaePackError, what="VAE encoder pack", kind=PACK_KIND,
                           default_kind=DIT_PACK_KIND, schema=SCHEMA_VERSION,
                           hint=" (make one with models.vae.encoder_pack.build_vae_encoder_pack)", rebuild="rebuild")
    where = str(d / "manifest.json")
    c, t = rec.config, rec.tiling
    try:
        cfg = VAEConfig(c.z_dim, c.base_dim, tuple(c.dim_mult), c.num_res_blocks, c.out_channels)
        geom = Geometry.from_resolution(rec.resolution.width, rec.resolution.height)
        rows, cols = tile_grid(geom.latent_h, geom.latent_w, t.tile, t.overlap, 1)
    except (TypeError, KeyError, ValueError) as e:
        raise VaePackError(f"{where}: bad config/resolution/tiling ({e!r})") from None
    if [r[0] for r in rows] != t.rows or [c[0] for c in cols] != t.cols:
        raise VaePackError(f"{where}: tiling rows/cols do not follow from tile {t.tile} and overlap {t.overlap}")
    _check_branches(d, where, rec, cfg, geom, rows[0][1], cols[0][1])
    if check:
        check_files(d, m, VaePackError)
    return VaeEncoderPack(d, m, cfg, geom.width, geom.height, t.tile, t.overlap)
