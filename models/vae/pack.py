"""VAE packs: the Qwen-Image VAE decoder converted for one resolution — a trunk graph (latent resolution, whole image,
with the middle block's attention) and one fixed-shape upsampler tile graph, FP32 ONNX, plus a manifest with hashes,
the tiling plan and the FP16 calibration. Built into a temporary sibling folder and renamed into place, like DiT packs
(models/packs/pack.py); `anima-models compile` compiles both graphs for the NPU into the same folder.

    PACK/manifest.json   kind "anima-vae-pack"; source, config, resolution, tiling, fp16, branches [trunk, tile]
    PACK/onnx/trunk.onnx z [1, 16, h, w] (VAE space) -> feats [1, 384, h, w]
    PACK/onnx/tile.onnx  feats [1, 384, th, tw] -> image [1, 3, 8 th, 8 tw]
    PACK/rknn/{trunk,tile}.rknn + rknn/logs/   after `anima-models compile PACK --target rk3588`

The models are listed under `branches` (name, kind, onnx, sha256, inputs, outputs) so the one compile path, the
manifest check and the rknn backend serve DiT and VAE packs alike.
"""
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from models.base.durable import atomic_write, building_folder, fsync_dir
from models.records.manifest import (MANIFEST, BranchEntry, ManifestRecord, file_sha256, manifest_header, read_manifest,
                             source_entry, write_manifest)
from models.packs.pack import PACK_KIND as DIT_PACK_KIND
from models.packs.pack import PackError, Resolution, check_files, pack_member, refuse_replacing
from models.dit.partition import Geometry
from models.base.schema import Float, Int
from models.vae.keys import VAEConfig
from models.vae.tiled import DEFAULT_OVERLAP, DEFAULT_TILE, check_tiling, tile_grid

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
PACK_KIND = "anima-vae-pack"
ONNX_DIR = "onnx"
MODELS = ("trunk", "tile")                 # execution order
CALIBRATION_SEEDS = (0, 1)                 # model-space N(0, 1) latents the FP16 scales are measured on


class VaePackError(PackError):
    """A VAE pack that is missing, incomplete, of another kind, or whose files differ from its manifest."""


class VaeConfigEntry(ManifestRecord, frozen=True):
    z_dim: Int(1, 4096)
    base_dim: Int(1, 1 << 16)
    dim_mult: list[Int(1, 64)]
    num_res_blocks: Int(0, 64)
    out_channels: Int(1, 64) = 3


class TilingEntry(ManifestRecord, frozen=True):
    tile: Int(1, 1 << 16)
    overlap: Float(0.0, 1.0)
    rows: list[int]
    cols: list[int]


class VaeManifest(ManifestRecord, frozen=True):
    """A VAE pack's manifest (the fields load_vae_pack reads)."""
    schema: int
    config: VaeConfigEntry
    resolution: Resolution
    tiling: TilingEntry
    branches: list[BranchEntry]


@dataclass
class TiledVaeGraphs:
    """What a VAE pack of either side (the decoder's here, the encoder's in models/vae/encoder_pack.py) is: one
    image size's tiled graphs, named by its manifest's branches."""
    dir: Path
    manifest: dict
    config: VAEConfig
    width: int
    height: int
    tile: int
    overlap: float

    @property
    def latent_shape(self) -> tuple:
        return (self.config.z_dim, self.height // self.config.upscale, self.width // self.config.upscale)

    @property
    def models(self) -> dict:
        return {b["name"]: b for b in self.manifest["branches"]}

    def model_path(self, name: str) -> Path:
        return self.dir / self.models[name]["onnx"]

    def compiled(self) -> bool:
        return all(isinstance(b.get("rknn"), dict) for b in self.manifest["branches"])


@dataclass
class VaePack(TiledVaeGraphs):
    """A decoder pack (load_vae_pack)."""


def _io(name: str, shape) -> list:
    return [{"name": name, "shape": [int(d) for d in shape], "dtype": "f32"}]


def _calibrate(weights, cfg, h: int, w: int, th: int, tw: int, rows, cols, seeds, threads) -> tuple:
    """Activation ranges of the unscaled graphs on seeded latents (ONNX Runtime FP32) -> (scales, fp16 report)."""
    from models.vae.fp16 import activation_ranges, headroom, norm_scales, ort_session
    from models.vae.graphs import trunk_graph, tile_graph
    from models.vae.latent import denormalize
    trunk, trunk_norms = trunk_graph(weights, cfg, h, w)
    tile, tile_norms = tile_graph(weights, cfg, th, tw)
    zs = [denormalize(np.random.default_rng(s).standard_normal((cfg.z_dim, h, w), dtype=np.float32))[None]
          for s in seeds]                                                        # each [1, z, h, w]
    r_trunk = activation_ranges(trunk, [{"z": z} for z in zs], threads)
    sess = ort_session(trunk, threads)
    feats = [sess.run(None, {"z": z})[0] for z in zs]                           # each [1, C, h, w]
    del sess
    tiles = ({"feats": np.ascontiguousarray(f[:, :, y0:y0 + th, x0:x0 + tw])}
             for f in feats for y0, _, _ in rows for x0, _, _ in cols)
    r_tile = activation_ranges(tile, tiles, threads)
    scales = {**norm_scales(trunk_norms, r_trunk), **norm_scales(tile_norms, r_tile)}
    report = {"trunk": headroom(r_trunk, trunk_norms, scales), "tile": headroom(r_tile, tile_norms, scales)}
    return scales, report


def build_vae_pack(vae_path, out_dir, resolution=(512, 512), tile: int = DEFAULT_TILE,
                   overlap: float = DEFAULT_OVERLAP, overwrite: bool = False, seeds=CALIBRATION_SEEDS,
                   threads: Optional[int] = None) -> Path:
    """Convert the VAE file at `vae_path` into a VAE pack at `out_dir` for `resolution` = (width, height) pixels."""
    from models.vae.checkpoint import load_vae

    t0 = time.perf_counter()
    geom = Geometry.from_resolution(*resolution)                 # validates multiples of 8
    stride = check_tiling(tile, overlap)
    if not seeds:
        raise ValueError("calibration needs at least one seed")
    out = Path(out_dir).absolute()
    weights = load_vae(vae_path)
    cfg, w = weights.config, weights.tensors
    if cfg.upscale != 8:
        raise VaePackError(f"{vae_path}: upscale {cfg.upscale}, the pipeline's latents are 1/8 of the image")
    sha = file_sha256(vae_path)
    refuse_replacing(out, sha, (geom.width, geom.height), overwrite, VaePackError, source="file")
    h, wd = geom.latent_h, geom.latent_w
    rows, cols = tile_grid(h, wd, tile, overlap, cfg.upscale)
    th, tw = rows[0][1], cols[0][1]
    # 1) FP16 calibration on the unscaled graphs, 2) the graphs with their norm scales
    scales, report = _calibrate(w, cfg, h, wd, th, tw, rows, cols, seeds, threads)
    _warn_headroom(report)
    graphs = _scaled_graphs(w, cfg, h, wd, th, tw, len(rows) * len(cols), scales)
    tiling = {"tile": tile, "overlap": overlap, "stride": stride, "tile_h": th, "tile_w": tw,
              "rows": [r[0] for r in rows], "cols": [c[0] for c in cols], "count": len(rows) * len(cols)}
    # 3) the graphs and the manifest, in a folder renamed to `out` when complete, removed on any error
    with building_folder(out) as tmp:
        branches = write_graphs(tmp, graphs)
        write_manifest(tmp, _manifest(vae_path, sha, weights, geom, tiling, scales, report, seeds, branches))
        fsync_dir(tmp / ONNX_DIR)                   # the ONNX files' entries, before the folder's rename
    log.info("VAE pack %s: %dx%d, trunk %dx%d + %d tiles of %dx%d, built in %.1f s", out, geom.width, geom.height,
             h, wd, len(rows) * len(cols), th, tw, time.perf_counter() - t0)
    return out


def _warn_headroom(report: dict) -> None:
    for name, r in report.items():
        if not r["ok"]:
            log.warning("%s: FP16 headroom %s (largest activation %.1f at %s): the NPU may overflow; check the "
                        "simulator (anima-models decode --backend rknn-sim)", name, r["headroom"], r["max_abs"], r["at"])


def _scaled_graphs(w, cfg, h: int, wd: int, th: int, tw: int, tiles: int, scales: dict) -> dict:
    """name -> (ONNX model with the norm scales, inputs, outputs, flops, calls per decode)."""
    from models.vae.flops import tile_flops, trunk_flops
    from models.vae.graphs import TILE_IN, TILE_OUT, TRUNK_IN, TRUNK_OUT, tile_graph, trunk_graph
    return {"trunk": (trunk_graph(w, cfg, h, wd, scales)[0], _io(TRUNK_IN, (1, cfg.z_dim, h, wd)),
                      _io(TRUNK_OUT, (1, cfg.mid_dim, h, wd)), trunk_flops(cfg, h, wd), 1),
            "tile": (tile_graph(w, cfg, th, tw, scales)[0], _io(TILE_IN, (1, cfg.mid_dim, th, tw)),
                     _io(TILE_OUT, (1, cfg.out_channels, th * cfg.upscale, tw * cfg.upscale)),
                     tile_flops(cfg, th, tw), tiles)}


def write_graphs(tmp: Path, graphs: dict, names=MODELS, kind: str = "vae") -> list:
    """Each graph of `names` as its ONNX file under tmp/onnx/ -> the manifest's branch entries (kind `kind`-NAME),
    in execution order: the decoder pack's and the encoder pack's (models/vae/encoder_pack.py)."""
    from models.graphs.builder import serialize
    (tmp / ONNX_DIR).mkdir()
    branches = []
    for name in names:
        model, ins, outs, flops, calls = graphs[name]
        data = serialize(model)
        rel = f"{ONNX_DIR}/{name}.onnx"
        atomic_write(tmp / rel, data)
        branches.append({"name": name, "kind": f"{kind}-{name}", "onnx": rel, "sha256": file_sha256(tmp / rel),
                         "bytes": len(data), "inputs": ins, "outputs": outs, "gflop": round(flops / 1e9, 3),
                         "calls": calls})
    return branches


def _manifest(vae_path, sha: str, weights, geom, tiling: dict, scales: dict, report: dict, seeds, branches) -> dict:
    from models.graphs.builder import OPSET
    from models.vae.fp16 import SCALE_TARGET
    cfg = weights.config
    return {
        **manifest_header(PACK_KIND, SCHEMA_VERSION),
        "source": {**source_entry(vae_path, sha), "layout": weights.layout},
        "config": cfg.to_dict(),
        "resolution": {"width": geom.width, "height": geom.height},
        "latent": {"channels": cfg.z_dim, "h": geom.latent_h, "w": geom.latent_w},
        "tiling": tiling,
        "attention": "trunk",             # the middle block's attention is inside the trunk graph
        "dtype": "fp32", "io_dtype": "f32", "opset": OPSET,
        "fp16": {"scale_target": SCALE_TARGET, "norm_scales": scales, "models": report,
                 "calibration": {"seeds": list(seeds), "latent": "model-space N(0, 1)"},
                 "ok": all(r["ok"] for r in report.values())},
        "branches": branches,
    }


def check_branch_io(d: Path, branches, want: dict, where: str) -> None:
    """A VAE (decoder or encoder) pack's branches: every file they name inside the pack folder, each one's input and
    output shapes those `want` gives ({name: (input shape, output shape)}, from the config and tiling)."""
    for b in branches:
        try:                                       # every file it names stays inside the pack folder
            pack_member(d, b.onnx, f"{where} branch {b.name}")
            if b.rknn is not None:
                pack_member(d, b.rknn.get("file"), f"{where} branch {b.name} rknn")
        except PackError as e:
            raise VaePackError(str(e)) from None
        try:
            got = ([int(x) for x in b.inputs[0]["shape"]], [int(x) for x in b.outputs[0]["shape"]])
        except (TypeError, KeyError, IndexError, ValueError):
            got = None
        if got != want[b.name]:
            raise VaePackError(f"{where}: branch {b.name}: input/output shapes {got}, the config and tiling "
                               f"give {list(want[b.name])}")


def load_vae_pack(pack_dir, check: bool = True) -> VaePack:
    """Read and validate a VAE pack's manifest; with `check`, verify every file's existence and sha256."""
    d = Path(pack_dir).absolute()
    m, rec = read_manifest(d, VaeManifest, VaePackError, what="VAE pack", kind=PACK_KIND, default_kind=DIT_PACK_KIND,
                           schema=SCHEMA_VERSION, hint=" (make one with `anima-models pack-vae`)", rebuild="rebuild")
    where = str(d / MANIFEST)
    c, t = rec.config, rec.tiling
    try:
        cfg = VAEConfig(c.z_dim, c.base_dim, tuple(c.dim_mult), c.num_res_blocks, c.out_channels)
        width, height = rec.resolution.width, rec.resolution.height
        geom = Geometry.from_resolution(width, height)
        tile, overlap = t.tile, t.overlap
        rows, cols = tile_grid(geom.latent_h, geom.latent_w, tile, overlap, cfg.upscale)
    except (TypeError, KeyError, ValueError) as e:
        raise VaePackError(f"{where}: bad config/resolution/tiling ({e!r})") from None
    if [r[0] for r in rows] != t.rows or [c[0] for c in cols] != t.cols:
        raise VaePackError(f"{where}: tiling rows/cols do not follow from tile {tile} and overlap {overlap}")
    names = [b.name for b in rec.branches]
    if names != list(MODELS):
        raise VaePackError(f"{where}: branches {names}, expected {list(MODELS)}")
    th, tw, up = rows[0][1], cols[0][1], cfg.upscale
    want = {"trunk": ([1, cfg.z_dim, geom.latent_h, geom.latent_w], [1, cfg.mid_dim, geom.latent_h, geom.latent_w]),
            "tile": ([1, cfg.mid_dim, th, tw], [1, cfg.out_channels, th * up, tw * up])}
    check_branch_io(d, rec.branches, want, where)
    if check:
        check_files(d, m, VaePackError)
    return VaePack(d, m, cfg, width, height, tile, overlap)
