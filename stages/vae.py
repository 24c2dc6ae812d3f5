"""The VAE stage: model-space latent [16, h, w] → PNG with generation metadata (tiled decoding bounds memory).

    python -m stages.vae --config run/pipeline.toml

Local: started by the orchestrator after denoising and stopped after decoding; reads the latent from the job arena
and writes the PNG where DECODE says. Remote (a `tcp://` endpoint under its own supervisord): the latent arrives
inline and the PNG goes back inline (`return_png`). The VAE file comes from `models_dir` or `[stage.vae] vae = FILE`.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

import numpy as np

from models.models_dir import ModelsDirError, resolve_models
from models.vae.api import VAE
from models.vae.png import write_png
from protocol import messages as m
from protocol.fields import ProtocolError
from stages.base import RequestFailed, exit_process, stage_main
from stages.config import PipelineConfig
from stages.tensor_io import ReplyTensors, read_tensor

log = logging.getLogger(__name__)


class VaeLogic:
    """Holds the decoder; DECODE → PNG file (local) or PNG bytes (remote)."""

    def __init__(self, config: PipelineConfig):
        settings = config.stage_settings("vae")
        try:
            paths = resolve_models(config.models_dir, {"vae": settings.get("vae")}, need=("vae",))
        except ModelsDirError as e:
            raise ValueError(f"vae: {e}") from None
        self.threads = int(settings.get("threads", config.threads))
        t0 = time.perf_counter()
        self.vae = VAE.open(paths.vae, threads=self.threads)
        self.load_s = time.perf_counter() - t0
        self.path = paths.vae

    def info(self) -> dict:
        return {"vae": str(self.path), "threads": self.threads, "load_s": round(self.load_s, 3)}

    def on_decode(self, msg: m.Decode, ctx) -> m.Decoded:
        z = self.vae.config.z_dim
        if msg.latent.dtype != "f32" or len(msg.latent.shape) != 3 or msg.latent.shape[0] != z:
            raise ProtocolError("latent", f"expected f32 [{z}, h, w], got {msg.latent.dtype} {list(msg.latent.shape)}")
        latent = read_tensor(ctx, msg.arena, msg.latent, msg.inline, field="latent", copy=True)   # [16, h, w] f32
        if not np.isfinite(latent).all():
            raise ProtocolError("latent", "holds NaN or Inf")
        if msg.output is None and not msg.return_png:
            raise ProtocolError("output", "give an output path or ask for return_png")
        # 1) decode (tiled unless told otherwise)
        tile = msg.tile.tile if msg.tile.enabled else None
        result = self.vae.decode(latent, tile=tile, overlap=msg.tile.overlap)
        ctx.check(msg.job)
        # 2) the PNG with its metadata: to the named path, or back inline
        t0 = time.perf_counter()
        out = ReplyTensors(ctx, None)
        png_desc, path = None, None
        if msg.output is not None:
            path = os.path.abspath(msg.output)
            if not os.path.isdir(os.path.dirname(path)):
                raise RequestFailed(f"output folder {os.path.dirname(path)} does not exist", field="output")
            write_png(path, result.image, msg.metadata)
        if msg.return_png:
            with tempfile.TemporaryDirectory() as tmp:
                p = os.path.join(tmp, "image.png")
                write_png(p, result.image, msg.metadata)
                data = np.frombuffer(open(p, "rb").read(), dtype=np.uint8)
            png_desc = out.put(data, None, field="png")
        h, w = result.image.shape[:2]
        return m.reply_to(msg, m.Decoded, job=msg.job, path=path, png=png_desc, width=w, height=h,
                          timings={"load_s": self.load_s, "decode_s": result.seconds,
                                   "png_s": time.perf_counter() - t0}, inline=out.inline)


def main(argv=None) -> int:
    return stage_main("vae", VaeLogic, argv)


if __name__ == "__main__":
    exit_process(main())      # no final GC of torch's objects: a stop takes 0.1 s, not seconds
