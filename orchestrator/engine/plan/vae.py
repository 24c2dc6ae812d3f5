"""The VAE's steps: EncodeImage (img2img's init latent), PixelStart (the hires fix's pixel path) and Decode (each
image's PNG, with its metadata), through the VAE stage: the job's arena, or inline when the VAE is remote or the
arena is not the image's size."""
from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np

from models.base.durable import atomic_write
from orchestrator.engine.job_files import INIT_LATENT_FILE, MASK_FILE
from orchestrator.engine.plan.job_io import load_npy, save_npy
from orchestrator.engine.plan.steps import VAE
from orchestrator.engine.png_text import ImageText, LoaderFiles, png_text
from orchestrator.engine.stage_control import StageFailed
from protocol import messages as m
from protocol.tensors import from_inline

log = logging.getLogger("orchestrator.engine.plan")


class VaeSteps:
    """The VAE's steps of a job's runner (orchestrator.engine.plan.run.PlanRunner)."""

    def _init_latent(self) -> np.ndarray | None:
        return load_npy(self.dir / INIT_LATENT_FILE, self.pack.latent_shape)            # [C, H/8, W/8] f32

    def _step_encode_image(self, step) -> None:
        """EncodeImage (img2img): a kept upload (init_image.png, or init_mix's mix_image.png) through the VAE stage's
        encoder into its latent file (init_latent.npy; with init_mix init_encoded.npy / mix_encoded.npy), once: a
        resume reads the file, so the job samples from the same latent bitwise."""
        from orchestrator.engine.job_inputs import image_tensor
        remote, source = self.cfg.is_remote("vae"), self.dir / step.inputs[0]
        try:
            grey = (self.dir / MASK_FILE).read_bytes() if MASK_FILE in step.inputs else None
            image = image_tensor(source.read_bytes(), grey)                         # [3, H, W] f32 in [-1, 1]
        except (OSError, ValueError) as e:     # removed or damaged since submit: the job cannot start from it
            what = "init_mix image" if step.mix else "init image"
            raise StageFailed("orchestrator", f"the job's {what} {source} cannot be read ({e}); submit the job "
                                              "again") from None
        self._need_up(VAE)
        save_npy(self.dir / step.outputs[0], self._vae_encode(image, self.pack.latent_shape, inline=remote))

    def _vae_encode(self, image: np.ndarray, shape: tuple, inline: bool) -> np.ndarray:
        """VAE_ENCODE of an image [3, H, W] f32 in [-1, 1] -> its latent, checked to be `shape` and finite: through the
        arena's image and init-latent slots, or `inline` (a remote VAE; an arena of another size or without them)."""
        if inline:
            from protocol.tensors import InlineFrames
            frames = InlineFrames()
            msg = m.VaeEncode(job=self.job.id, image=frames.add(image), inline=tuple(frames.frames))
        else:
            self.arena.write(self.image_slot, image)
            msg = m.VaeEncode(job=self.job.id, image=self.image_slot, arena=self.arena.name, latent=self.init_latent)
        reply = m.expect(self.control.call("vae", msg, self.settings.decode_timeout_s), m.VaeEncoded, "vae")
        if reply.latent.inline:
            latent = from_inline(reply.latent, reply.inline)
        elif inline or reply.latent.slot != self.init_latent.slot:
            raise StageFailed("vae", f"VAE_ENCODED points at slot {reply.latent.slot!r}, expected "
                                     f"{'an inline latent' if inline else repr(self.init_latent.slot)}")
        else:
            latent = self.arena.read(self.init_latent)
        if tuple(latent.shape) != tuple(shape) or not np.isfinite(latent).all():
            raise StageFailed("vae", f"the encoded latent is {list(latent.shape)}, expected {list(shape)} and finite")
        self.report.vae_encode_timings = dict(reply.timings)
        return np.ascontiguousarray(latent, dtype=np.float32)

    def _step_pixel_start(self, step) -> None:
        """PixelStart, the pixel path (ImageScale[By] + VAEEncode) for image `step.pos`: its first latent decoded at
        the first size (first.png, kept; base.png with hires.keep_base), scaled to the second size, encoded again
        (hires_init.npy, kept: a resume never encodes twice, so it samples from the same latent bitwise)."""
        from models.sampling.latent_ops import image_scale
        pos, shape = step.pos, self.hires_pack.latent_shape
        first = self._batch_latent(pos)
        if first is None:
            raise StageFailed("orchestrator", f"{self.dir / step.inputs[0]} is missing or unusable (resume the job)")
        self._need_up(VAE)
        pixels = self._first_image(step, first)                                      # [H, W, 3] uint8
        unit = image_scale(pixels, self.hires_pack.width, self.hires_pack.height, self.spec.hires.method)
        # bicubic's overshoot clipped: the encoder takes [-1, 1] (ComfyUI's VAEEncode is not given it clipped)
        image = np.clip(unit, 0.0, 1.0) * np.float32(2.0) - np.float32(1.0)
        save_npy(self.dir / step.outputs[0], self._vae_encode(image, shape, inline=True))

    def _first_image(self, step, latent: np.ndarray) -> np.ndarray:
        """Image `step.pos`'s first pass as 8-bit pixels: its PNG when whole (first.png, first_1.png ... as scratch;
        base.png ... when the job keeps it, with the PNG's metadata), else the latent decoded by the VAE stage
        (inline both ways: it is not the arena's size) and kept there. The pixels are the VAE's 8 bits either way,
        what ComfyUI's SaveImage writes of the same VAEDecode."""
        from PIL import Image
        kept = len(step.outputs) > 1
        path = self.dir / (step.outputs[1] if kept else step.scratch[0])
        try:
            with Image.open(path) as im:
                return np.asarray(im.convert("RGB"), dtype=np.uint8)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:            # torn by a power cut: decoded again (the same pixels)
            log.warning("%s is unusable: %s", path, e)
        data = self._decode_inline(latent, self._metadata(step.pos, self.first_pack) if kept else {})
        atomic_write(path, data)
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)

    def _decode_inline(self, latent: np.ndarray, metadata: dict) -> bytes:
        """DECODE of `latent` sent and its PNG returned inline (a remote VAE; a latent not of the arena's size)."""
        from protocol.tensors import InlineFrames
        frames = InlineFrames()
        desc = frames.add(np.ascontiguousarray(latent, dtype=np.float32))
        msg = m.Decode(job=self.job.id, latent=desc, return_png=True, metadata=metadata, inline=tuple(frames.frames))
        reply = m.expect(self.control.call("vae", msg, self.settings.decode_timeout_s), m.Decoded, "vae")
        if reply.png is None:
            raise StageFailed("vae", "DECODED has no PNG, which DECODE asked for (return_png)")
        self.report.vae_timings = dict(reply.timings)
        return from_inline(reply.png, reply.inline).tobytes()

    def _step_decode(self, step) -> None:
        """Decode: image `step.pos`'s final latent (its second pass's with a hires fix) to its PNG; a `base` step its
        first pass's latent (hires.keep_base), inline at the first size."""
        if step.base:
            latent = self._batch_latent(step.pos)
        else:
            if self.spec.hires is not None:
                self._to_hires_arena()
            latent = self._final_latent(step.pos)
        if latent is None:
            raise StageFailed("orchestrator", f"{self.dir / step.inputs[0]} is missing or unusable (resume the job to "
                                              "denoise it again)")
        self._need_up(VAE)
        if step.base:
            atomic_write(self.dir / step.outputs[0],
                         self._decode_inline(latent, self._metadata(step.pos, self.first_pack)))
            return
        self.arena.write(self.latent, latent)
        self._decode_one(step.pos, self.dir / step.outputs[0])

    def _metadata(self, pos: int, pack) -> dict:
        return png_text(self.d.png_formats, ImageText(self.spec, pack, self.job.id, self._model_files(),
                                                      self._client_graph(), self.lora_hashes or {}, pos))

    def _decode_one(self, pos: int, image: Path) -> None:
        if self.cfg.is_remote("vae"):
            atomic_write(image, self._decode_inline(self.arena.read(self.latent), self._metadata(pos, self.pack)))
            return
        msg = m.Decode(job=self.job.id, latent=self.latent, arena=self.arena.name, output=str(image),
                       metadata=self._metadata(pos, self.pack))
        reply = m.expect(self.control.call("vae", msg, self.settings.decode_timeout_s), m.Decoded, "vae")
        if reply.png is not None:
            atomic_write(image, from_inline(reply.png, reply.inline).tobytes())
        elif reply.path != str(image):
            raise StageFailed("vae", f"DECODED names {reply.path!r}, expected {image}")
        self.report.vae_timings = dict(reply.timings)

    def _client_graph(self) -> dict | None:
        """The API graph a ComfyUI client sent for this job (its node ids, titles, loader names, optional nodes), as
        ComfyUI itself would store it in the PNG; None for jobs from elsewhere (their graph is made from the job)."""
        origin = self.job.origin or {}
        graph = origin.get("graph") if origin.get("api") == "comfyui" else None
        return graph if isinstance(graph, dict) and graph else None

    def _model_files(self) -> LoaderFiles:
        """The loaders' file names in the PNG's graph: the pack's checkpoint, the text encoder's and VAE's
        (Daemon.model_files: a bundle's packs' sources, else the models folder's files)."""
        files = self.d.model_files()
        return LoaderFiles(unet=tuple(filter(None, [self.pack.source_name])),
                           clip=tuple(filter(None, [files.get("text_encoder")])),
                           vae=tuple(filter(None, [files.get("vae")])))
