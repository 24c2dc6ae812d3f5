"""One valid example of every message kind (inline tensors included), for tests, fuzzing and docs."""

from __future__ import annotations

import numpy as np

from protocol import messages as m
from protocol.prompt import PromptFile
from protocol.tensors import InlineFrames, TensorDesc


def _slot(name: str, dtype: str, shape: tuple[int, ...], offset: int = 0) -> TensorDesc:
    return TensorDesc(dtype, shape, slot=name, offset=offset)


def example_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """The arrays the inline examples carry: bf16 bits, a non-contiguous view, an empty tensor, png bytes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 8), dtype=np.float32)
    return {
        "x_f32": x,  # [6, 8] f32, the source of xn_bf16
        "xn_bf16": (x.view(np.uint32) >> 16).astype(np.uint16),  # xn: [6, 8] bf16 bits (truncated)
        "ctx_t": rng.standard_normal((8, 5)).astype(np.float16).T,  # context: [5, 8] f16, transposed view
        "empty": np.zeros((0, 8), np.float32),  # [0, 8]
        "y": rng.standard_normal((6, 8), dtype=np.float32)[:, ::2],  # y: [6, 4] f32, strided view
        "png": np.frombuffer(b"\x89PNG\r\n\x1a\n" + bytes(range(40)), np.uint8),  # [48] u8
        "latent": rng.standard_normal((16, 4, 4), dtype=np.float32),  # [C, h, w]
    }


def _vae_encode_examples(a: dict) -> dict[str, m.Message]:
    """VAE_ENCODE from the job arena into a latent slot; VAE_ENCODED with the latent inline (a remote VAE)."""
    f = InlineFrames()
    lat = f.add(a["latent"])
    return {"VAE_ENCODE": m.VaeEncode(job="job-1", image=_slot("image", "f32", (3, 512, 512)),
                                      arena="anima_0badcafe_job-1", latent=_slot("latent", "f32", (16, 64, 64), 2**22),
                                      tile=m.TileSettings(tile=32, overlap=0.5)),
            "VAE_ENCODED": m.VaeEncoded(job="job-1", latent=lat, timings={"encode_s": 1.2}, inline=tuple(f.frames))}


def _submit_examples() -> dict[str, m.Message]:
    return {"SUBMIT": m.Submit(prompt=PromptFile(prompt="1girl", steps=20), base_dir="/home/user",
                               origin='{"api": "comfyui", "client_id": "c1"}'),
            "SUBMITTED": m.Submitted(job="job-2", seed=2**63 + 5, position=1),
            "ESTIMATE": m.EstimateJob(prompt=PromptFile(prompt="1girl", cfg=1.0), base_dir="/home/user"),
            "ESTIMATED": m.Estimated(estimate='{"job_s": 540.5, "calls": 11, "passes": 1, "label": "modelled"}')}


def examples(seed: int = 0) -> dict[str, m.Message]:
    """kind -> a valid message of that kind (every kind in KINDS)."""
    a = example_arrays(seed)
    out: dict[str, m.Message] = {
        "HELLO": m.Hello(peer="orchestrator", pid=1234, version="0.1.0"),
        "READY": m.Ready(stage="executor", pid=99, version="0.1.0", info={"backend": "onnx", "threads": 2}),
        "HEARTBEAT": m.Heartbeat(peer="orchestrator"),
        "PONG": m.Pong(stage="scheduler", pid=7, busy=True, job="job-1", uptime_s=12.5, rss_mb=812.0),
        "CANCEL": m.Cancel(job="job-1"),
        "SHUTDOWN": m.Shutdown(reason="job done"),
        "OK": m.Ok(note="cancelled"),
        "ERROR": m.Error(code="bad_request", message="params.steps: 0 is out of range", field="params.steps"),
        "DYING": m.Dying(stage="vae", pid=5, reason="MemoryError in DECODE", job="job-1"),
        "ENCODE": m.Encode(job="job-1", prompt="1girl, masterpiece", negative="lowres", arena="anima_0badcafe_job-1",
                           cond=_slot("cond", "f32", (512, 1024)), uncond=_slot("uncond", "f32", (512, 1024), 2**21)),
        "DENOISE": m.Denoise(job="job-1", job_dir="/run/jobs/job-1", pack_dir="/bundle/pack", arena="anima_0badcafe_job-1",
                             params=m.DenoiseParams(seed=42, steps=20, cfg=4.0, width=512, height=512),
                             cond=_slot("cond", "f32", (512, 1024)), uncond=_slot("uncond", "f32", (512, 1024), 2**21),
                             latent=_slot("latent", "f32", (16, 64, 64), 2**22), scratch=m.Region(offset=2**23,
                             nbytes=2**24), executor="ipc:///run/sock/executor.sock"),
        "PROGRESS": m.Progress(job="job-1", step=3, steps=20, block=27, branch="ffn", elapsed_s=31.5, eta_s=180.0),
        "DENOISED": m.Denoised(job="job-1", latent=_slot("latent", "f32", (16, 64, 64), 2**22),
                               computed_steps=[1, 2, 3, 4, 6], forecast_steps=[5], branch_calls=420,
                               branches={"self": m.PhaseSums(calls=140, load_s=1.0, init_s=0.5, infer_s=9.0,
                                                             release_s=0.1, wait_s=0.2, visible_s=0.3, hidden_s=1.3,
                                                             cached=139)},
                               host_s=3.2, host_hidden_s=1.5, transport_s=0.4, wall_s=20.0),
        "DECODE": m.Decode(job="job-1", latent=_slot("latent", "f32", (16, 64, 64), 2**22), arena="anima_0badcafe_job-1",
                           output="/run/jobs/job-1/image.png", metadata={"prompt": "1girl", "seed": "42"}),
    }
    # inline tensors (remote peers): bf16 bits, a non-contiguous view, an empty tensor
    f = InlineFrames()
    xn, ctx, empty = f.add(a["xn_bf16"], "bf16"), f.add(a["ctx_t"]), f.add(a["empty"])
    out_c = _slot("y_cond", "f32", (6, 4))
    out["BRANCH"] = m.Branch(job="job-1", step=5, block=3, branch="cross", model="onnx/b03_cross.onnx", index=10,
                             passes=[m.BranchPass(name="cond", inputs={"xn": xn, "context": ctx, "pad": empty},
                                                  output=out_c)],
                             next=[m.BranchRef(block=3, branch="ffn", model="onnx/b03_ffn.onnx", index=11),
                                   m.BranchRef(block=4, branch="self", model="onnx/b04_self.onnx", index=12)],
                             hold=True, attempt=2, inline=tuple(f.frames))
    f = InlineFrames()
    y = f.add(a["y"])
    out["BRANCH_DONE"] = m.BranchDone(job="job-1", step=5, block=3, branch="cross", attempt=2,
                                      times=m.PhaseTimes(load_s=0.2, init_s=0.1, infer_s=(0.5,), release_s=0.01,
                                                         wait_s=0.05, prev_release_s=0.02, source="prefetch",
                                                         context_mb=150.5, infer_at=(1234.5,)),
                                      outputs=[y], rss_mb=300.0, inline=tuple(f.frames))
    f = InlineFrames()
    c, u = f.add(a["latent"][0]), f.add(a["empty"])
    out["ENCODED"] = m.Encoded(job="job-1", cond=c, uncond=u, tokens_cond=7, tokens_uncond=0, truncated=False,
                               timings={"encode_s": 1.5}, inline=tuple(f.frames))
    f = InlineFrames()
    png = f.add(a["png"])
    out["DECODED"] = m.Decoded(job="job-1", png=png, width=512, height=512, timings={"decode_s": 2.0},
                               inline=tuple(f.frames))
    # orchestrator CLI <-> daemon
    out.update(_submit_examples())
    out["STATUS"] = m.Status(job=None, detail=True, active=True, before="job-9", limit=24)
    out["JOBS"] = m.Jobs(jobs=[m.JobInfo(job="job-1", state="denoising", created=1.7e9, updated=1.7e9 + 5,
                                         progress=out["PROGRESS"], spec_json='{"prompt": "1girl"}'),
                               m.JobInfo(job="job-2", state="queued", created=1.7e9, updated=1.7e9, position=1)],
                         more=True)
    out["RESUME"] = m.Resume(job="job-1")
    out["INFO"] = m.Info()
    out["PIPELINE"] = m.Pipeline(packs=[m.PackRef(width=512, height=512, dir="/bundle/pack", dtype="f16", blocks=28,
                                                  source_name="anima-preview.safetensors", source_sha256="ab" * 32)],
                                 models={"text_encoder": "qwen_3_06b_base.safetensors"}, max_queue=16, version="0.1.0")
    out["PRUNE"] = m.Prune(keep=10, older_than_s=7 * 86400.0)
    out.update(_vae_encode_examples(a))
    missing = set(m.KINDS) - set(out)
    if missing:
        raise AssertionError(f"examples missing for {sorted(missing)}")
    return out
