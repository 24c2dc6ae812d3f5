"""Long-context packs (`anima-models pack --context N`): cross-attention over N context rows plus an additive mask,
so a prompt longer than 512 T5 tokens keeps every row as in ComfyUI, and a shorter one still sees its 512
zero-padded rows exactly. Checked against the torch reference forward fed ComfyUI's context (unpadded when longer
than 512 rows), on the tiny synthetic model; the default pack is unchanged (no mask input)."""
from __future__ import annotations

import numpy as np
import pytest

from models.dit.config import PRESETS
from models.dit.checkpoint import DiTCheckpoint
from models.runtime.dit_runner import DiTRunner
from models.packs.pack import build_pack, load_pack
from models.dit.partition import (MASKED, TEXT_TOKENS, BY_KIND, Geometry, branch_inputs, context_mask, context_rows,
                              resolve)
from models.dit.reference import reference_forward

S_LONG = 640                     # > 512 and small enough for a quick test


def _cos(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_table_rows_and_mask():
    full = PRESETS["full"]["dit"]
    short, long = Geometry.from_resolution(512, 512), Geometry.from_resolution(512, 512, text_tokens=1024)
    assert not short.long_context and long.long_context and long.text_tokens == 1024
    assert [i.name for i in branch_inputs(BY_KIND["cross"], short)] == ["xn", "context"]
    assert [i.name for i in branch_inputs(BY_KIND["cross"], long)] == ["xn", "context", "context_mask"]
    assert resolve("cross", full, long, "fp16")["inputs"][1:] == [
        {"name": "context", "shape": [1024, 1024], "dtype": "f16"},
        {"name": "context_mask", "shape": [1024], "dtype": "f16"}]
    assert resolve("self", full, long, "fp16") == resolve("self", full, short, "fp16")
    # ComfyUI's row count: padded to 512, never truncated; as far as the pack holds it
    assert [context_rows(n, 1024) for n in (1, 200, 512, 513, 900, 1024, 5000)] == [512, 512, 512, 513, 900, 1024,
                                                                                     1024]
    m = context_mask(600, 1024, np.float16)
    assert m.dtype == np.float16 and not m[:600].any() and (m[600:] == np.float16(MASKED)).all()
    assert np.isfinite(m).all()
    for bad in (511, 5000, 600.5):
        with pytest.raises(ValueError, match="context"):
            Geometry.from_resolution(512, 512, text_tokens=bad)


@pytest.fixture(scope="module")
def packs(tiny_dit, tmp_path_factory):
    d = tmp_path_factory.mktemp("long")
    return (build_pack(tiny_dit, d / "p512", (128, 128), "fp32"),
            build_pack(tiny_dit, d / "p640", (128, 128), "fp32", context=S_LONG))


@pytest.fixture(scope="module")
def long_runner(packs):
    """One runner on the 640-row pack for the module's in-process forwards (tests.pipeline_harness.reference_runner:
    its sessions made once, not per forward)."""
    from tests.pipeline_harness import reference_runner
    r = reference_runner(packs[1], threads=1)
    yield r
    r.close()


def test_default_pack_has_no_mask_long_pack_has_one(packs, long_runner):
    p512, p640 = load_pack(packs[0]), load_pack(packs[1])
    cross = [b for b in p512.branches if b["kind"] == "cross"][0]
    assert [i["name"] for i in cross["inputs"]] == ["xn", "context"]
    cross = [b for b in p640.branches if b["kind"] == "cross"][0]
    assert [i["name"] for i in cross["inputs"]] == ["xn", "context", "context_mask"]
    assert p640.geometry.text_tokens == S_LONG and p512.geometry.text_tokens == TEXT_TOKENS
    with pytest.raises(ValueError, match="context_rows"):
        long_runner.forward_passes([np.zeros((16, 16, 16), np.float32)], 0.5,
                                   [np.zeros((S_LONG, p640.config.context_dim), np.float32)],
                                   context_rows=[S_LONG + 1])


@pytest.mark.parametrize("rows", [TEXT_TOKENS, 600])
def test_long_pack_equals_comfyui_context(packs, long_runner, tiny_dit, rows):
    """rows = 512: a short prompt (ComfyUI pads to 512 zero rows, all attended); rows = 600: a long prompt
    (ComfyUI keeps its 600 rows, no padding). The pack's rows past `rows` hold garbage: the mask must hide it."""
    cfg = load_pack(packs[1]).config
    rng = np.random.default_rng(5)
    x = rng.standard_normal((cfg.latent_channels, 16, 16)).astype(np.float32)
    n_real = 300 if rows == TEXT_TOKENS else rows
    ctx = np.zeros((S_LONG, cfg.context_dim), np.float32)
    ctx[:n_real] = rng.standard_normal((n_real, cfg.context_dim))
    ctx[rows:] = 3.0 * rng.standard_normal((S_LONG - rows, cfg.context_dim))     # never seen when masked
    want = reference_forward(DiTCheckpoint.open(tiny_dit), x, 0.6, ctx[:rows])     # ComfyUI's context: `rows` rows
    got = long_runner.forward_passes([x], 0.6, [ctx], context_rows=[rows])[0]
    assert _cos(got, want) > 0.9999999 and np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    unmasked = long_runner.forward_passes([x], 0.6, [ctx], context_rows=[S_LONG])[0]
    assert _cos(unmasked, want) < 0.9999             # the mask is what makes them equal
    if rows == TEXT_TOKENS:                          # a short prompt: the 512-row pack gives the same
        short = DiTRunner(packs[0], threads=1).forward_passes([x], 0.6, [ctx[:TEXT_TOKENS]])[0]
        assert _cos(got, short) > 0.9999999 and np.abs(got - short).max() <= 1e-4 * np.abs(want).max()


def test_each_pass_keeps_its_own_mask_in_every_scheduling(packs, long_runner):
    """Two CFG passes with different row counts (so different masks): lockstep, interleave (one call per pass)
    and dual_core give the same outputs bitwise, and each pass equals running it alone."""
    cfg = load_pack(packs[1]).config
    rng = np.random.default_rng(9)
    x = rng.standard_normal((cfg.latent_channels, 16, 16)).astype(np.float32)
    ctx = [rng.standard_normal((S_LONG, cfg.context_dim)).astype(np.float32) for _ in range(2)]
    rows = [600, TEXT_TOKENS]
    outs = {}
    for policy in ("on-demand", "interleave", "dual_core"):
        r = DiTRunner(packs[1], threads=1, policy=policy)
        outs[policy] = np.stack(r.forward_passes([x, x], 0.6, ctx, context_rows=rows))
        r.close()
    np.testing.assert_array_equal(outs["interleave"], outs["on-demand"])
    np.testing.assert_array_equal(outs["dual_core"], outs["on-demand"])
    alone = long_runner.forward_passes([x], 0.6, [ctx[1]], context_rows=[rows[1]])[0]
    np.testing.assert_array_equal(outs["on-demand"][1], alone)


def test_pipeline_long_prompt_keeps_every_row(pipeline_assets):
    """Through supervisord and the real stages with a 640-row FP16 pack: a prompt over 512 T5 tokens keeps all its
    rows (not truncated), the negative prompt's pass masks the rows past 512, and the final latent equals in-process
    sampling with ComfyUI's row counts (and not the unmasked one)."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from models.sampling.denoise import denoise, make_sampler, start_or_resume
    from models.sampling.spectrum import SpectrumSettings
    from models.setup.models_dir import resolve_models
    from models.text.tokenizers import PromptTokenizer
    from tests.pipeline_harness import RESIDENT_EXECUTOR, Pipeline, reference_runner

    cache = Path(tempfile.mkdtemp(prefix="anima-long-"))     # not pytest's basetemp (see test_e2e_pipeline)
    try:
        models, _ = pipeline_assets                           # the session's tiny models folder (read-only)
        paths = resolve_models(models, {}, need=("dit", "qwen_tokenizer", "t5_tokenizer"))
        pack = build_pack(paths.dit, cache / "pack128-640", (128, 128), "fp16", context=S_LONG)
        prompt = {"prompt": "girl, " * 290 + "(smile:1.2)", "negative_prompt": "lowres", "seed": 7, "steps": 2,
                  "cfg": 4.0, "spectrum": False}
        tok = PromptTokenizer.from_files(str(paths.qwen_tokenizer), str(paths.t5_tokenizer))
        n_cond, n_uncond = len(tok.tokenize(prompt["prompt"]).t5_ids), len(tok.tokenize("lowres").t5_ids)
        assert TEXT_TOKENS < n_cond <= S_LONG and n_uncond < TEXT_TOKENS
        with Pipeline.start(models, pack, threads=1, executor_toml=RESIDENT_EXECUTOR) as pipe:
            job = pipe.submit(prompt)
            info = pipe.wait(job, timeout_s=600.0)
            assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
            r = pipe.report(job)
            jd = pipe.job_dir(job)
            assert r["text"] == {"t5_tokens_prompt": n_cond, "t5_tokens_negative": n_uncond, "context_rows": S_LONG,
                                 "truncated": False}
            assert json.loads((jd / "text.json").read_text()) == r["text"]
            cond, uncond = np.load(jd / "cond.npy"), np.load(jd / "uncond.npy")       # [640, Dc] f32
            assert cond.shape[0] == S_LONG and np.abs(cond[n_cond - 1]).sum() > 0 and not cond[n_cond:].any()
            latent = np.load(jd / "latent.npy")
            assert pipe.leftover_segments() == []
        ld = load_pack(pack)
        g, c = ld.geometry, ld.config
        runner = reference_runner(ld, threads=1)

        def sample(rows):
            sampler = make_sampler(2, 4.0, "sgm_uniform", SpectrumSettings(enabled=False))
            state = start_or_resume(sampler, 7, (c.latent_channels, g.latent_h, g.latent_w))
            return denoise(runner, sampler, state, cond, uncond, context_rows=rows).latent
        np.testing.assert_array_equal(latent, sample((n_cond, TEXT_TOKENS)))
        assert np.abs(sample(None) - latent).max() > 1e-3        # unmasked: the negative's 128 extra zero rows count
        runner.close()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
