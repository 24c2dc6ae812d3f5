"""The real `python -m stages.vae` process on a VAE pack, for tests: a short /tmp run folder, its config with a
[stage.vae] table, HELLO until READY, DECODE with the latent inline and the PNG back inline; killed and cleaned after.

    with VaeStage('backend = "onnx"\\nvae_pack = "/path/pack"') as st:
        reply = st.decode(latent)            # m.Decoded (or raises RemoteError)
        st.encode(image)                     # m.VaeEncoded, the latent inline (or in the arena slot it names)
        st.image(reply)                      # the PNG's pixels [H, W, 3] u8
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq
from PIL import Image

from protocol import messages as m
from protocol.sockets import LazyPirate
from protocol.tensors import InlineFrames, from_inline
from stages.config import ConfigError, load_config
from tests.signals import signal_group

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0


class VaeStage:
    def __init__(self, stage_toml: str):
        self.run = Path(tempfile.mkdtemp(prefix="anima-vs-", dir="/tmp"))     # ipc paths stay short
        (self.run / "sock").mkdir()
        self.cfg = self.run / "pipeline.toml"
        self.cfg.write_text(f'run_dir = "{self.run}"\nthreads = 1\n[timeouts]\nrequest_s = 60.0\nretries = 2\n'
                            f"[stage.vae]\n{stage_toml}\n")
        self.log = self.run / "vae.log"
        try:
            self.config = load_config(self.cfg)
        except ConfigError:
            self.config = None                  # a bad setting: the stage itself must say so and exit 2
        self.proc: subprocess.Popen | None = None
        self.ctx = zmq.Context()
        self.ready: m.Ready | None = None

    def __enter__(self) -> "VaeStage":
        self.proc = subprocess.Popen([sys.executable, "-m", "stages.vae", "--config", str(self.cfg)], cwd=ROOT,
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while self.ready is None:
                if self.config is None:
                    self.proc.wait(timeout=START_TIMEOUT_S)
                if self.proc.poll() is not None:
                    raise RuntimeError(f"stages.vae exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
                with LazyPirate(self.ctx, self.config.endpoint("vae"), timeout_s=2.0, retries=0) as link:
                    try:
                        self.ready = m.expect(link.request(m.Hello(peer="test", pid=os.getpid(), version="t")),
                                              m.Ready)
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def decode(self, latent: np.ndarray) -> m.Decoded:
        frames = InlineFrames()
        desc = frames.add(np.ascontiguousarray(latent, np.float32))
        msg = m.Decode(job="j1", latent=desc, return_png=True, metadata={"prompt": "test"},
                       inline=tuple(frames.frames))
        with LazyPirate(self.ctx, self.config.endpoint("vae"), timeout_s=60.0, retries=0) as link:
            return m.expect(link.request(msg), m.Decoded, "vae")

    def request(self, msg: m.Message, reply_cls: type) -> m.Message:
        with LazyPirate(self.ctx, self.config.endpoint("vae"), timeout_s=60.0, retries=0) as link:
            return m.expect(link.request(msg), reply_cls, "vae")

    def encode(self, image: np.ndarray, **fields) -> m.VaeEncoded:
        """VAE_ENCODE with the image inline (unless `fields` name an arena slot); the latent back inline or in the
        slot `latent=` names."""
        frames = InlineFrames()
        desc = fields.pop("image_desc", None) or frames.add(np.ascontiguousarray(image))
        return self.request(m.VaeEncode(job=fields.pop("job", "j1"), image=desc, inline=tuple(frames.frames),
                                        **fields), m.VaeEncoded)

    @staticmethod
    def image(reply: m.Decoded) -> np.ndarray:
        img = Image.open(io.BytesIO(from_inline(reply.png, reply.inline).tobytes()))
        img.load()
        return np.asarray(img)

    def mapped_files(self) -> str:
        """The stage process's /proc/PID/maps (which shared libraries it loaded)."""
        return Path(f"/proc/{self.proc.pid}/maps").read_text()

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self.log.exists():
            print(f"--- {self.log} (tail) ---\n{self.log.read_text()[-3000:]}")
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc.pid)
            self.proc.wait(10)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run, ignore_errors=True)
