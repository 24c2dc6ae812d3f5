"""The conditioning cache (orchestrator/engine/cond_cache.py): keying, LRU eviction by size, torn entries never trusted; and
through the real pipeline (the board's ONNX encoder on the tiny bundle): queued jobs share one encoder start, a later
job with an earlier prompt starts none and gives the cold job's latent and pixels bitwise."""
from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest

from orchestrator.engine.cond_cache import CondCache, CondEntry, cache_key

SHAPE = (8, 4)
ENC = "e" * 64


def _entry(seed: int) -> CondEntry:
    rng = np.random.default_rng(seed)
    return CondEntry(rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(SHAPE).astype(np.float32),
                     5 + seed, 3, False)


def _key(prompt: str, **kw) -> str:
    args = dict(negative="", rows=SHAPE[0], loras=[], encoder=ENC) | kw
    return cache_key(prompt, args["negative"], args["rows"], args["loras"], args["encoder"])


def test_the_key_changes_with_every_input_the_encoder_reads():
    base = _key("a cat")
    others = [_key("a cat "), _key("(a cat:1.2)"), _key("a cat", negative="dog"), _key("a cat", rows=16),
              _key("a cat", loras=[["x", 1.0, 1.0, []]]), _key("a cat", loras=[["x", 1.0, 0.5, []]]),
              _key("a cat", encoder="f" * 64)]
    assert base == _key("a cat")
    assert len({base, *others}) == len(others) + 1


def test_a_zeroed_or_averaged_context_never_shares_a_plain_ones_key():
    """The key the encode step looks a job's contexts up by (orchestrator.engine.plan.encode: build.cond_entries of the
    spec) differs for a ConditioningZeroOut negative, a ConditioningAverage prompt and the plain pair, and a plain
    pair's key is what it was before conditioning entries existed."""
    from orchestrator.engine.plan.build import cond_entries
    from orchestrator.engine.prompt_spec import parse_prompt_obj

    def key_of(obj: dict) -> str:
        spec = parse_prompt_obj({"seed": 1, "width": 64, "height": 64, **obj})
        return cache_key(spec.prompt, spec.negative_prompt, 512, [], ENC, cond_entries(spec))
    plain = key_of({"prompt": "a cat", "negative_prompt": "dog"})
    keys = [key_of({"prompt": "a cat", "negative": [{"text": "dog", "zero_out": True}]}),
            key_of({"positive": [{"text": "a cat", "zero_out": True}], "negative_prompt": "dog"}),
            key_of({"positive": [{"text": "a cat", "average": {"text": "a dog", "weight": 0.5}}],
                    "negative_prompt": "dog"}),
            key_of({"positive": [{"text": "a cat", "average": {"text": "a dog", "weight": 0.25}}],
                    "negative_prompt": "dog"}),
            key_of({"positive": [{"text": "a cat", "average": {"text": "a cow", "weight": 0.5}}],
                    "negative_prompt": "dog"})]
    assert len({plain, *keys}) == len(keys) + 1
    assert key_of({"positive": [{"text": "a cat"}], "negative": [{"text": "dog"}]}) == plain   # plain entries
    assert plain == cache_key("a cat", "dog", 512, [], ENC)


def test_an_entry_reads_back_bitwise_and_a_miss_is_none(tmp_path):
    cache = CondCache(tmp_path, 1.0)
    e = _entry(1)
    cache.put(_key("a"), e)
    got = cache.get(_key("a"), SHAPE)
    assert got.cond.tobytes() == e.cond.tobytes() and got.uncond.tobytes() == e.uncond.tobytes()
    assert (got.tokens_cond, got.tokens_uncond, got.truncated) == (6, 3, False)
    assert cache.get(_key("b"), SHAPE) is None
    assert cache.get(_key("a"), (16, 4)) is None            # another shape is not this pack's: not trusted
    assert not (tmp_path / "cache" / "cond" / f"{_key('a')}.npz").exists()


def test_off_keeps_nothing(tmp_path):
    cache = CondCache(tmp_path, 0)
    cache.put(_key("a"), _entry(1))
    assert cache.get(_key("a"), SHAPE) is None and not (tmp_path / "cache").exists()


def test_the_least_recently_used_entry_goes_first(tmp_path):
    one = CondCache(tmp_path / "probe", 1.0)
    one.put(_key("probe"), _entry(0))
    size = (tmp_path / "probe" / "cache" / "cond" / f"{_key('probe')}.npz").stat().st_size
    cache = CondCache(tmp_path, 3.5 * size / 2**20)            # room for three entries
    for i, p in enumerate(("a", "b", "c")):
        cache.put(_key(p), _entry(i))
        path = cache.dir / f"{_key(p)}.npz"
        os.utime(path, ns=(time.time_ns(), 1_000_000_000 * (i + 1)))    # a, b, c used in that order
    assert cache.get(_key("a"), SHAPE) is not None            # a used again: b is now the oldest
    cache.put(_key("d"), _entry(3))
    kept = {p for p in "abcd" if (cache.dir / f"{_key(p)}.npz").exists()}
    assert kept == {"a", "c", "d"}


@pytest.mark.parametrize("damage", ["cut", "flip", "empty", "foreign"])
def test_a_damaged_entry_is_removed_not_trusted(tmp_path, damage):
    cache = CondCache(tmp_path, 1.0)
    cache.put(_key("a"), _entry(1))
    path = cache.dir / f"{_key('a')}.npz"
    data = path.read_bytes()
    if damage == "cut":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "foreign":                                  # a whole npz whose contexts are not the checksummed ones
        e = _entry(1)
        good = np.load(io.BytesIO(data))
        buf = io.BytesIO()
        np.savez(buf, cond=e.cond + np.float32(1), uncond=e.uncond, meta=good["meta"])
        path.write_bytes(buf.getvalue())
    else:                                                      # one bit of the stored cond flipped (zip CRC or ours)
        b = bytearray(data)
        b[len(b) // 3] ^= 0x01
        path.write_bytes(bytes(b))
    assert cache.get(_key("a"), SHAPE) is None
    assert not path.exists()


def test_a_bad_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sha256"):
        CondCache(tmp_path, 1.0).get("../../etc/passwd", SHAPE)


def test_a_queued_jobs_encodes_are_its_first_pass_and_its_hires_own_prompts():
    """What the look-ahead asks the encoder for (orchestrator.engine.plan.build.prompt_pairs): each pass's texts at its own pack's rows."""
    from orchestrator.engine.plan.build import prompt_pairs as _prompt_pairs
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    sizes = [(64, 64), (96, 96)]
    packs = {s: f"pack{s[0]}" for s in sizes}
    plain = parse_prompt_obj({"prompt": "a cat", "negative_prompt": "dog", "seed": 1, "width": 64, "height": 64,
                              "hires": {"scale": 1.5}}, resolution=sizes)
    plain_ops = (None, None)
    assert _prompt_pairs(plain, packs) == [("a cat", "dog", "pack64", plain_ops)]    # the second pass reuses the first's
    own = parse_prompt_obj({"prompt": "a cat", "negative_prompt": "dog", "seed": 1, "width": 64, "height": 64,
                            "hires": {"scale": 1.5, "prompt": "a sharp cat"}}, resolution=sizes)
    assert _prompt_pairs(own, packs) == [("a cat", "dog", "pack64", plain_ops), ("a sharp cat", "dog", "pack96", plain_ops)]
    zeroed = parse_prompt_obj({"prompt": "a cat", "negative": [{"text": "dog", "zero_out": True}], "seed": 1,
                               "width": 64, "height": 64}, resolution=sizes)
    (pair,) = _prompt_pairs(zeroed, packs)
    assert pair[:3] == ("a cat", "dog", "pack64") and pair[3][0] is None and pair[3][1].zero_out
    # a second pass with its own prompt keeps the negative it shares with the first: zeroed
    zeroed = parse_prompt_obj({"prompt": "a cat", "negative": [{"text": "dog", "zero_out": True}], "seed": 1,
                               "width": 64, "height": 64, "hires": {"scale": 1.5, "prompt": "a sharp cat"}},
                              resolution=sizes)
    first, second = _prompt_pairs(zeroed, packs)
    assert second[:3] == ("a sharp cat", "dog", "pack96") and second[3][0] is None and second[3][1].zero_out
    assert _prompt_pairs(own, {}) == []                                        # no pack: its own flow fails it


def test_the_encoders_identity_follows_its_files(tmp_path):
    """An encoder pack's file rewritten (same size), or another pack named, is another encoder: its cache entries
    no longer match."""
    from types import SimpleNamespace

    from orchestrator.engine.cond_cache import encoder_identity
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_bytes(b"x" * 64)
    cfg = lambda pack: SimpleNamespace(path=tmp_path / "pipeline.toml",                    # noqa: E731
                                       stage_settings=lambda stage: {"backend": "onnx", "pack": pack})
    first = encoder_identity(cfg("a"))
    assert encoder_identity(cfg("a")) == first
    assert encoder_identity(cfg("b")) != first
    f = tmp_path / "a" / "model.onnx"
    st = f.stat()
    f.write_bytes(b"y" * 64)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert encoder_identity(cfg("a")) != first


def test_the_loras_identity_names_strengths_and_file(tmp_path):
    from models.lora.choice import LoraChoice
    from orchestrator.engine.cond_cache import lora_identity
    (tmp_path / "loras").mkdir()
    f = tmp_path / "loras" / "x.safetensors"
    f.write_bytes(b"z" * 32)
    ident = lambda **kw: lora_identity([LoraChoice(name="x.safetensors", **kw)], tmp_path)      # noqa: E731
    first = ident(strength=1.0)
    assert ident(strength=1.0) == first
    assert ident(strength=0.5) != first and ident(strength=1.0, clip_strength=0.5) != first
    st = f.stat()
    f.write_bytes(b"w" * 32)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert ident(strength=1.0) != first


# ------------------------------------------------------------------ through the real pipeline

@pytest.fixture(scope="module")
def cache_pipeline(pipeline_assets, board_stages):
    """The board's stage set with the conditioning cache on (the shared pipelines run with it off)."""
    from tests.pipeline_harness import Pipeline
    models, pack = pipeline_assets
    p = Pipeline.start(models, pack, threads=1, extra_toml=board_stages, cond_cache_mb=64)
    try:
        yield p
    finally:
        p.stop_clean()


def _encoder_starts(p) -> int:
    return sum(f.read_text(errors="replace").count("encoder ready on") for f in p.rf.logs.glob("encoder*.log"))


def _pixels(path) -> bytes:
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).tobytes()


def test_queued_jobs_share_one_encoder_start_and_a_cached_prompt_starts_none(cache_pipeline):
    p = cache_pipeline
    prompts = [{"prompt": f"a lighthouse at dusk, view {i}", "negative_prompt": "blurry", "seed": 11 + i, "steps": 2}
               for i in range(3)]
    before = _encoder_starts(p)
    jobs = [p.submit(x) for x in prompts]                      # queued at once: the first starts the encoder
    for j in jobs:
        assert p.wait(j, ("done", "failed")).state == "done", p.logs()
    assert [p.report(j)["encoder_started"] for j in jobs] == [True, False, False]
    assert _encoder_starts(p) - before == 1
    assert len(list((p.root / "cache" / "cond").glob("*.npz"))) == 3
    # a later job with the first (cold) job's prompt: no encoder, the same contexts, latent and pixels bitwise
    later = p.submit(prompts[0])
    assert p.wait(later, ("done", "failed")).state == "done", p.logs()
    assert p.report(later)["encoder_started"] is False
    assert _encoder_starts(p) - before == 1
    cold, warm = p.job_dir(jobs[0]), p.job_dir(later)
    for name in ("cond.npy", "uncond.npy", "latent.npy", "text.json"):
        assert (warm / name).read_bytes() == (cold / name).read_bytes(), name
    assert _pixels(warm / "image.png") == _pixels(cold / "image.png")
    # the bench's number: the cold job (its prompt new: the encoder started) and the same prompt warm
    walls = [(p.report(j)["wall_s"], p.report(j)["stages"]["encoder"]["wall_s"]) for j in (jobs[0], later)]
    print(f"tiny job wall_s (encoder wall_s): cold {walls[0][0]:.2f} ({walls[0][1]:.2f}), warm {walls[1][0]:.2f} "
          f"({walls[1][1]:.2f}); load average {os.getloadavg()[0]:.1f}")
