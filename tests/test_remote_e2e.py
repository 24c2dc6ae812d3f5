"""End to end with the VAE on another host: the board's real pipeline (supervisord + the real stages on the tiny
bundle) with `endpoints.vae = tcp://…` pointing at the examples/remote-vae machine (a network namespace, else
127.0.0.2) over CURVE. The job decodes there and the PNG comes back inline; the board never starts its own vae."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq
from PIL import Image

from remote_net import RemoteNet, announce
from remote_vae_machine import RemoteVae
from tests.pipeline_harness import Pipeline

pytestmark = pytest.mark.slow

THREADS = 1
# 2 steps (Spectrum warm-up 1): the shortest job that still denoises; the point here is where it decodes
PROMPT = {"prompt": "1girl, remote", "negative_prompt": "lowres", "seed": 77, "steps": 2, "cfg": 3.0,
          "sampler": "euler", "scheduler": "sgm_uniform", "spectrum": {"warmup": 1}}
JOB_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def remote_vae(pipeline_assets, request):
    models, _ = pipeline_assets
    net = RemoteNet.up("re")
    vae = RemoteVae(net, models)
    ctx = zmq.Context()
    try:
        announce(request.config, f"\ntest_remote_e2e: VAE machine via {net.kind} at {vae.endpoint}")
        vae.start()
        vae.ready = vae.wait_ready(ctx)
        yield vae
    finally:
        vae.close()
        ctx.destroy(linger=0)
        net.down()


def _board_toml(vae: RemoteVae) -> str:
    """The [endpoints]/[security] tables of examples/remote-vae/pipeline-remote-vae.toml, keys by absolute path."""
    keys = vae.folder / "keys"
    return (f'[endpoints]\nvae = "{vae.endpoint}"\n'
            f'[security]\nclient_key = "{keys / "board.key_secret"}"\n'
            f'[security.servers]\nvae = "{keys / "vae.key"}"\n')


def test_a_job_decodes_on_the_remote_vae(pipeline_assets, remote_vae):
    models, pack = pipeline_assets
    with Pipeline.start(models, pack, threads=THREADS, extra_toml=_board_toml(remote_vae)) as p:
        # 1) the CLI health-checks the remote stage over CURVE instead of asking supervisord
        cli = subprocess.run([str(Path(sys.executable).with_name("orchestrator")), "--run", str(p.root), "stages"],
                             capture_output=True, text=True, timeout=120)
        line = next((s for s in cli.stdout.splitlines() if s.startswith("vae")), "")
        assert f"READY     pid {remote_vae.ready.pid}" in line and remote_vae.endpoint in line, cli.stdout + cli.stderr

        # 2) a job runs through; decoding happens on the remote machine
        job = p.submit(PROMPT)
        info = p.wait(job, ("done", "failed", "cancelled"), timeout_s=JOB_TIMEOUT_S)
        assert info.state == "done", f"{info}\n{p.logs()}\n{remote_vae._logs()}"
        report = p.report(job)
        assert report["stages"]["vae"]["remote"] is True and report["teardown"]["vae_remote"] is True
        # the DECODED timings are the remote process's own (its VAE load time, as its READY reported it)
        assert abs(report["vae_timings"]["load_s"] - remote_vae.ready.info["load_s"]) < 2e-3, report["vae_timings"]

        # 3) the board's own vae program was never started
        local_vae = p.sup.info("vae")
        assert local_vae.state == "STOPPED" and local_vae.start == 0, local_vae

        # 4) the PNG: the job's latent decoded by the same VAE file here gives the same pixels; metadata present
        png = Image.open(p.job_dir(job) / "image.png")
        png.load()
        own = json.loads(png.text["anima"])
        assert png.size == (128, 128) and own["seed"] == 77 and own["job"] == job
        assert "Steps: 2" in png.text["parameters"]
        from models.vae.api import VAE
        latent = np.load(p.job_dir(job) / "latent.npy")                                  # [16, 16, 16] f32
        local = VAE.open(remote_vae.ready.info["vae"], threads=1).decode(latent, tile=32, overlap=0.5)
        got = np.asarray(png.convert("RGB"))                                              # [128, 128, 3] u8
        np.testing.assert_array_equal(got, local.image)           # 1 thread each side, one uint8 conversion
        assert p.leftover_segments() == []
    assert remote_vae.wait_ready(zmq.Context.instance()).pid == remote_vae.ready.pid  # still serving, same process
