"""The VAE stage: model-space latent [16, h, w] → PNG with generation metadata (tiled decoding bounds memory).

    python -m stages.vae --config run/pipeline.toml

Local: started by the orchestrator after denoising and stopped after decoding; reads the latent from the job arena
and writes the PNG where DECODE says. Remote (a `tcp://` endpoint under its own supervisord): the latent arrives
inline and the PNG goes back inline (`return_png`).

    [stage.vae]
    backend = "torch"          # torch (the VAE file; any resolution, DECODE's tiling) | onnx | rknn-sim | rknn
    vae = "FILE"               # torch: the VAE file (default: from models_dir)
    vae_pack = "packs/vae-512" # onnx / rknn-sim / rknn: a VAE pack (anima-models pack-vae; compiled for rknn), or a
                               # list of them, one per image size; relative to this file's folder
    vae_encoder_pack = "packs/vae-enc-512"   # onnx / rknn-sim / rknn, VAE_ENCODE: encoder packs, the same way

VAE_ENCODE (an image [3, H, W] in [-1, 1] -> a model-space latent into the slot it names, or inline) is served by the
same process: started for it before denoising and stopped after, exactly as for DECODE (orchestrator/engine/stage_control.py
starts and stops the stage; the encoder is only read by the first VAE_ENCODE, so a decode-only run never holds it).
    core_mask = "auto"         # rknn: NPU cores (auto | 0 | 1 | 2 | 0_1 | 0_1_2 | all); lite = "standin" in tests
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from models.runtime.backends import backend_class, make_branch_backend
from models.runtime.backends.base import BackendError
from models.setup.models_dir import ModelsDirError, resolve_models
from models.packs.pack import PackError
from models.vae.encoder_pack import EncodeError
from models.vae.pack_decoder import DecodeError
from models.vae.png import write_png
from protocol import messages as m
from protocol.fields import ProtocolError
from stages.base import RequestFailed, exit_process, stage_main
from stages.config import ConfigError, PipelineConfig
from stages.tensor_io import ReplyTensors, read_tensor
from stages.vae_limits import DecodeLimits, DecodePlan, check_decode, check_encode

log = logging.getLogger(__name__)


class VaeLogic:
    """Holds the decoder (torch on a VAE file, or a VAE pack on a model backend); DECODE → PNG file (local) or PNG
    bytes (remote); VAE_ENCODE → the image's latent (the VAE file's encoder half, or an encoder pack)."""

    def __init__(self, config: PipelineConfig):
        settings = config.stage_settings("vae")
        self.backend = settings["backend"]              # backend and vae_pack checked when the config was read
        self.threads = int(settings.get("threads", config.threads))
        t0 = time.perf_counter()
        if self.backend == "torch":
            from models.vae.api import VAE                  # torch: imported only by this backend
            try:
                paths = resolve_models(config.models_dir, {"vae": settings.get("vae")}, need=("vae",))
            except ModelsDirError as e:
                raise ConfigError(f"{config.path}: vae: {e}") from None
            self.vae, self.decoders, self.path = VAE.open(paths.vae, threads=self.threads), {}, paths.vae
            self.z_dim = self.vae.config.z_dim
        else:
            self.vae, self.decoders = None, self._pack_decoders(config, settings)
            self.path = [str(d.pack.dir) for d in self.decoders.values()]
            self.z_dim = next(iter(self.decoders.values())).config.z_dim
        self.load_s = time.perf_counter() - t0
        self.limits = DecodeLimits.from_config(config, self.z_dim, fixed_tiling=self.vae is None)
        # VAE_ENCODE: the torch encoder is read from the VAE file on the first request (a decode-only stage never
        # holds it); the pack backends' encoder packs are checked now, run on the decoders' backend instance
        self.torch_encoder, self.encoders, self.encoder_load_s = None, {}, 0.0
        if self.vae is None and settings.get("vae_encoder_pack"):
            self.encoders = self._encoder_packs(config, settings, next(iter(self.decoders.values())).backend)

    def _pack_decoders(self, config: PipelineConfig, settings: dict) -> dict:
        """{latent shape: PackDecoder} for `vae_pack` (one folder or a list, one per image size), every file checked;
        one backend instance serves them all (one model at a time)."""
        from models.vae.pack import load_vae_pack
        from models.vae.pack_decoder import PackDecoder
        dirs = settings["vae_pack"]
        dirs = [dirs] if isinstance(dirs, str) else list(dirs)
        cls = backend_class(self.backend)
        packs = {}
        for d in dirs:                       # a pack problem is a config exit (2): the same pack fails again
            try:
                pack = load_vae_pack(Path(config.path).parent / str(d))     # relative to the config file
            except PackError as e:
                raise ConfigError(f"{config.path}: stage.vae.vae_pack: {e}") from None
            if cls.needs_compiled_pack and not pack.compiled():
                raise ConfigError(f"stage.vae.vae_pack {pack.dir}: not compiled for the NPU (anima-models compile "
                                  f"{pack.dir} --target rk3588)")
            if pack.latent_shape in packs:
                raise ConfigError(f"stage.vae.vae_pack: {pack.dir} and {packs[pack.latent_shape].dir} are both "
                                  f"{pack.width}x{pack.height}")
            packs[pack.latent_shape] = pack
        problem = cls.runtime_problem(settings)
        if problem:
            raise ConfigError(f"{config.path}: stage.vae.backend = {self.backend!r}: {problem}")
        backend = make_branch_backend(self.backend, self.threads, settings)
        return {shape: PackDecoder(pack, backend) for shape, pack in packs.items()}

    def _encoder_packs(self, config: PipelineConfig, settings: dict, backend) -> dict:
        """{image shape: PackEncoder} for `vae_encoder_pack` (a folder or a list, one per image size), checked."""
        from models.vae.encoder_pack import load_vae_encoder_pack
        from models.vae.pack_encoder import PackEncoder
        dirs = settings["vae_encoder_pack"]
        dirs = [dirs] if isinstance(dirs, str) else list(dirs)
        needs_npu = backend_class(self.backend).needs_compiled_pack
        encoders = {}
        for d in dirs:                       # a pack problem is a config exit (2), as for the decoder packs
            try:
                pack = load_vae_encoder_pack(Path(config.path).parent / str(d))
            except PackError as e:
                raise ConfigError(f"{config.path}: stage.vae.vae_encoder_pack: {e}") from None
            if needs_npu and not pack.compiled():
                raise ConfigError(f"stage.vae.vae_encoder_pack {pack.dir}: not compiled for the NPU (anima-models "
                                  f"compile {pack.dir} --target rk3588)")
            if pack.image_shape in encoders:
                raise ConfigError(f"stage.vae.vae_encoder_pack: {pack.dir} and {encoders[pack.image_shape].pack.dir} "
                                  f"are both {pack.width}x{pack.height}")
            encoders[pack.image_shape] = PackEncoder(pack, backend)
        return encoders

    def _encoder(self, shape: tuple):
        """The encoder for an image of `shape` [3, H, W]: the torch one (read now if not yet), or that size's pack."""
        if self.vae is not None:
            if self.torch_encoder is None:
                from models.vae.checkpoint import VAEError
                from models.vae.encode import TorchEncoder
                t0 = time.perf_counter()
                try:
                    self.torch_encoder = TorchEncoder.open(self.path, threads=self.threads)
                except VAEError as e:
                    raise RequestFailed(f"cannot encode images: {e}") from None
                self.encoder_load_s = time.perf_counter() - t0
            return self.torch_encoder
        if shape not in self.encoders:
            sizes = ", ".join(f"{e.pack.width}x{e.pack.height}" for e in self.encoders.values()) or "none"
            raise ProtocolError("image", f"{shape[2]}x{shape[1]} pixels: no VAE encoder pack for it "
                                         f"(stage.vae.vae_encoder_pack has {sizes})")
        return self.encoders[shape]

    def on_vae_encode(self, msg: m.VaeEncode, ctx) -> m.VaeEncoded:
        plan = check_encode(msg, self.limits)            # descriptors, size bounds, tiling: ERROR replies
        enc = self._encoder(tuple(msg.image.shape))
        image = read_tensor(ctx, msg.arena, msg.image, msg.inline, field="image", copy=True)   # [3, H, W] f32
        try:
            result = enc.encode(image, tile=plan.tile, overlap=plan.overlap) if self.vae is not None else \
                enc.encode(image)
        except ValueError as e:                             # the encoder's own checks (NaN, range): the request's
            raise RequestFailed(f"cannot encode this image: {e}", code="bad_request", field="image") from None
        except (BackendError, EncodeError) as e:
            raise RequestFailed(f"VAE encoder on {self.backend}: {e}") from None
        ctx.check(msg.job)
        out = ReplyTensors(ctx, msg.arena)
        desc = out.put(result.latent, msg.latent, field="latent")
        timings = {"encode_s": result.seconds, "load_s": self.encoder_load_s,
                   **{f"{k}_{ph}": float(v) for k in ("features", "head")
                      for ph, v in result.timings.get(k, {}).items()}}
        return m.reply_to(msg, m.VaeEncoded, job=msg.job, latent=desc, timings=timings, inline=out.inline)

    def info(self) -> dict:
        return {"vae": ", ".join(self.path) if self.vae is None else str(self.path), "backend": self.backend,
                "threads": self.threads, "load_s": round(self.load_s, 3)}

    def _decode(self, latent, plan: DecodePlan):
        """-> DecodeResult through the configured backend; a VAE pack fixes its own tiling (DECODE's is for torch)."""
        dec = None if self.vae is not None else self.decoders[tuple(latent.shape)]
        try:
            if dec is None:
                return self.vae.decode(latent, tile=plan.tile, overlap=plan.overlap)
            return dec.decode(latent)
        except ValueError as e:                             # the decoder's own input checks: the request's fault
            raise RequestFailed(f"cannot decode this latent: {e}", code="bad_request", field="latent") from None
        except BackendError as e:
            raise RequestFailed(f"VAE pack {dec.pack.dir} on {self.backend}: {e}") from None
        except DecodeError as e:                            # a non-finite image
            raise RequestFailed(str(e)) from None

    def on_decode(self, msg: m.Decode, ctx) -> m.Decoded:
        plan = check_decode(msg, self.limits)            # bounds, tiles, output, metadata: ERROR replies
        if self.vae is None and tuple(msg.latent.shape) not in self.decoders:
            sizes = ", ".join(f"{d.pack.width}x{d.pack.height}" for d in self.decoders.values())
            raise ProtocolError("latent", f"shape {list(msg.latent.shape)}: no VAE pack for it (stage.vae.vae_pack "
                                          f"has {sizes}; anima-models pack-vae --resolution "
                                          f"{msg.latent.shape[2] * 8}x{msg.latent.shape[1] * 8})")
        latent = read_tensor(ctx, msg.arena, msg.latent, msg.inline, field="latent", copy=True)   # [16, h, w] f32
        if not np.isfinite(latent).all():
            raise ProtocolError("latent", "holds NaN or Inf")
        # 1) decode (tiled unless told otherwise; a VAE pack's tiling is its own)
        result = self._decode(latent, plan)
        ctx.check(msg.job)
        # 2) the PNG with its metadata: to the named path, or back inline
        t0 = time.perf_counter()
        out = ReplyTensors(ctx, None)
        png_desc, path = None, plan.output
        if path is not None:
            if not os.path.isdir(os.path.dirname(path)):
                raise RequestFailed(f"output folder {os.path.dirname(path)} does not exist", field="output")
            try:
                write_png(path, result.image, msg.metadata)
            except OSError as e:
                raise RequestFailed(f"cannot write {path}: {e.strerror}", field="output") from None
        if msg.return_png:
            with tempfile.TemporaryDirectory() as tmp:
                p = os.path.join(tmp, "image.png")
                write_png(p, result.image, msg.metadata)
                data = np.frombuffer(open(p, "rb").read(), dtype=np.uint8)
            png_desc = out.put(data, None, field="png")
        h, w = result.image.shape[:2]
        return m.reply_to(msg, m.Decoded, job=msg.job, path=path, png=png_desc, width=w, height=h,
                          timings={"load_s": self.load_s, "decode_s": result.seconds,
                                   "png_s": time.perf_counter() - t0, **_model_timings(result.timings)},
                          inline=out.inline)


def _model_timings(t: dict) -> dict:
    """A VAE pack's per-model phases as flat DECODED timings: trunk_load_s, ..., tile_infer_s, tile_release_s."""
    return {f"{model}_{phase}": float(v) for model in ("trunk", "tile") for phase, v in t.get(model, {}).items()
            if phase != "total_s"}


def main(argv=None) -> int:
    return stage_main("vae", VaeLogic, argv)


if __name__ == "__main__":
    exit_process(main())      # no final GC of torch's objects: a stop takes 0.1 s, not seconds
