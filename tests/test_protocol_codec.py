"""Codec round-trips of every message kind (bf16, empty, non-contiguous tensors, frame counts) and malformed input."""

import math

import msgpack
import numpy as np
import pytest

from protocol import codec
from protocol import messages as m
from tests.protocol_examples import example_arrays, examples
from protocol.fields import MAX_TEXT_CHARS, ProtocolError
from protocol.tensors import InlineFrames, TensorDesc, from_inline

EXAMPLES = examples()


def _header(kind: str) -> dict:
    return msgpack.unpackb(codec.encode(EXAMPLES[kind])[0], raw=False)


def _decode_with(kind: str, change, frames=None) -> m.Message:
    head = _header(kind)
    change(head)
    rest = list(codec.encode(EXAMPLES[kind])[1:]) if frames is None else frames
    return codec.decode([msgpack.packb(head), *rest])


def test_every_kind_has_an_example():
    assert set(EXAMPLES) == set(m.KINDS)
    assert {"HELLO", "READY", "HEARTBEAT", "PONG", "DYING", "SHUTDOWN", "ERROR", "ENCODE", "ENCODED", "DENOISE",
            "PROGRESS", "DENOISED", "BRANCH", "BRANCH_DONE", "DECODE", "DECODED"} <= set(m.KINDS)


@pytest.mark.parametrize("kind", sorted(m.KINDS))
def test_round_trip_every_kind(kind):
    msg = EXAMPLES[kind]
    frames = codec.encode(msg)
    n_inline = sum(1 for _, d in codec.iter_tensors(msg) if d.inline)
    assert len(frames) == 1 + n_inline == 1 + len(msg.inline)
    back = codec.decode([bytes(f) for f in frames])  # as received: plain bytes
    assert type(back) is type(msg) and back == msg
    assert back.id == msg.id
    head = msgpack.unpackb(frames[0], raw=False)
    assert head["v"] == 1 and head["kind"] == kind
    for (path, d0), (_, d1) in zip(codec.iter_tensors(msg), codec.iter_tensors(back)):
        if d0.inline:
            np.testing.assert_array_equal(from_inline(d1, back.inline), from_inline(d0, msg.inline), err_msg=path)


def test_inline_tensor_values_bf16_empty_non_contiguous():
    a = example_arrays()
    back = codec.decode([bytes(f) for f in codec.encode(EXAMPLES["BRANCH"])])
    inputs = back.passes[0].inputs
    xn = from_inline(inputs["xn"], back.inline)
    assert inputs["xn"].dtype == "bf16" and xn.dtype == np.uint16
    np.testing.assert_array_equal(xn, a["xn_bf16"])
    # the received bf16 bits widen back to the source float32 values within bf16 precision (8 mantissa bits)
    x32 = (xn.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_allclose(x32, a["x_f32"], rtol=2**-7, atol=0)
    assert not np.array_equal(x32, a["x_f32"])  # really truncated, not passed through as f32
    ctx = from_inline(inputs["context"], back.inline)
    assert not a["ctx_t"].flags.c_contiguous and ctx.shape == (5, 8) and ctx.dtype == np.float16
    np.testing.assert_array_equal(ctx, a["ctx_t"])
    empty = from_inline(inputs["pad"], back.inline)
    assert empty.shape == (0, 8) and bytes(back.inline[2]) == b""
    y = codec.decode(codec.encode(EXAMPLES["BRANCH_DONE"]))
    np.testing.assert_array_equal(from_inline(y.outputs[0], y.inline), a["y"])


def test_contiguous_arrays_travel_without_copy_and_big_endian_is_converted():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = InlineFrames()
    d = f.add(x)
    assert np.shares_memory(np.frombuffer(f.frames[0], np.float32), x)
    be = np.arange(6, dtype=">f4")
    d2 = f.add(be)
    assert d2.dtype == "f32" and bytes(f.frames[1]) == np.arange(6, dtype="<f4").tobytes()
    assert d.frame == 1 and d2.frame == 2
    with pytest.raises(ValueError, match="bf16"):
        f.add(np.zeros(3, np.uint16))  # uint16 must say it is bf16
    with pytest.raises(ValueError, match="no wire dtype"):
        f.add(np.zeros(3, np.float64))


def test_validation_on_construction_names_the_field():
    with pytest.raises(ProtocolError) as e:
        m.Encode(job="bad/job", prompt="x")
    assert e.value.field == "job"
    with pytest.raises(ProtocolError) as e:
        m.Denoise(**{**{f: getattr(EXAMPLES["DENOISE"], f) for f in ("job", "job_dir", "pack_dir", "arena", "cond",
                                                                       "uncond", "latent", "scratch", "executor")},
                     "params": {"seed": 1, "steps": 20, "cfg": 4.0, "width": 512, "height": 512,
                                "spectrum": {"w": 1.5}}})
    assert e.value.field == "params.spectrum.w"


@pytest.mark.parametrize("key,value,words", [
    ("lam", 200.0, "[0.0, 100.0]"), ("window", 60.0, "[1.0, 50.0]"), ("flex", 20.0, "[0.0, 10.0]"),
    ("m", 0, "[1, 8]"), ("warmup", 201, "[0, 200]"), ("stop", 0.0, "(0.0, 1.0]")])
def test_the_wire_carries_prompt_jsons_spectrum_record_with_its_bounds(key, value, words):
    """One Spectrum record from prompt.json to the sampler: DENOISE refuses what prompt.json refuses (the wire took
    lam up to 1e6, window and flex up to 100, m = 0 and stop = 0 before)."""
    from models.sampling.spectrum import SpectrumSettings
    from orchestrator.engine.prompt_spec import SpectrumSettings as PromptSpectrum
    assert m.SpectrumSettings is SpectrumSettings is PromptSpectrum
    assert _header("DENOISE")["params"]["spectrum"] == {"enabled": True, "w": 0.4, "m": 3, "lam": 1.0, "window": 2.0,
                                                        "flex": 0.5, "warmup": 4, "stop": 0.9}
    with pytest.raises(ProtocolError) as e:
        _decode_with("DENOISE", _set(["params", "spectrum", key], value))
    assert e.value.field == f"params.spectrum.{key}" and words in str(e.value), str(e.value)


def _set(path, value):
    def change(head):
        obj = head
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
    return change


def _drop(key):
    return lambda head: head.pop(key)


MALFORMED = [
    # (kind, change to the header, field named, error code)
    ("HELLO", _set(["kind"], "HELO"), "kind", "unknown_kind"),
    ("HELLO", _set(["kind"], 7), "kind", "unknown_kind"),
    ("HELLO", _set(["v"], 2), "v", "version"),
    ("HELLO", _set(["v"], True), "v", "version"),
    ("HELLO", _drop("v"), "v", "version"),
    ("HELLO", _drop("id"), "id", "missing_field"),
    ("HELLO", _set(["id"], -1), "id", "bad_field"),
    ("HELLO", _set(["id"], "7"), "id", "bad_field"),
    ("ENCODE", _drop("job"), "job", "missing_field"),
    ("ENCODE", _set(["bogus"], 1), "bogus", "unknown_field"),
    ("ENCODE", _set(["prompt"], "x" * (MAX_TEXT_CHARS + 1)), "prompt", "too_large"),
    ("ENCODE", _set(["prompt"], "a\x00b"), "prompt", "bad_field"),
    ("ENCODE", _set(["job"], "../etc"), "job", "bad_field"),
    ("ENCODE", _set(["cond", "dtype"], "f64"), "cond.dtype", "bad_field"),
    ("ENCODE", _set(["cond", "shape"], [512, -1]), "cond.shape[1]", "bad_field"),
    ("ENCODE", _set(["cond", "shape"], [1] * 9), "cond.shape", "too_large"),
    ("ENCODE", _set(["cond", "shape"], [2**20, 2**20]), "cond.shape", "too_large"),
    ("ENCODE", _set(["cond", "where"], {"slot": "c", "offset": 0, "frame": 1}), "cond.where", "bad_field"),
    ("ENCODE", _set(["cond", "where"], {"slot": "c", "offset": -5}), "cond.where.offset", "bad_field"),
    ("ENCODE", _set(["cond", "extra"], 1), "cond.extra", "unknown_field"),
    ("DENOISE", _set(["params", "steps"], "20"), "params.steps", "bad_field"),
    ("DENOISE", _set(["params", "steps"], 0), "params.steps", "bad_field"),
    ("DENOISE", _set(["params", "cfg"], math.nan), "params.cfg", "bad_field"),
    ("DENOISE", _set(["params", "cfg"], math.inf), "params.cfg", "bad_field"),
    ("DENOISE", _set(["params", "seed"], 1.5), "params.seed", "bad_field"),
    ("DENOISE", _set(["params", "spectrum", "enabled"], 1), "params.spectrum.enabled", "bad_field"),
    ("DENOISE", _set(["params"], [1, 2]), "params", "bad_field"),
    ("DENOISE", _set(["resume"], "yes"), "resume", "bad_field"),
    ("PROGRESS", _set(["block"], True), "block", "bad_field"),
    ("PROGRESS", _set(["branch"], "attn"), "branch", "bad_field"),
    ("DENOISED", _set(["computed_steps"], [1, 0]), "computed_steps[1]", "bad_field"),
    ("DENOISED", _set(["branches", "mlp"], {}), "branches.<key>", "bad_field"),
    ("DENOISED", _set(["computed_steps"], list(range(1, 1002))), "computed_steps", "too_large"),
    ("BRANCH", _set(["passes"], []), "passes", "bad_field"),
    ("BRANCH", _set(["attempt"], 0), "attempt", "bad_field"),
    ("BRANCH", _set(["passes", 0, "name"], "neg"), "passes[0].name", "bad_field"),
    ("BRANCH", _set(["next", 1, "branch"], "x"), "next[1].branch", "bad_field"),
    ("BRANCH", _set(["next"], [{"block": 0, "branch": "ffn", "model": "m", "index": 2}] * 9), "next", "too_large"),
    ("BRANCH", _set(["hold"], 1), "hold", "bad_field"),
    ("BRANCH_DONE", _set(["times", "source"], "cache"), "times.source", "bad_field"),
    ("BRANCH_DONE", _set(["times", "infer_s"], []), "times.infer_s", "bad_field"),
    ("BRANCH_DONE", _set(["times", "wait_s"], -1.0), "times.wait_s", "bad_field"),
    ("BRANCH_DONE", _set(["times", "bogus"], 1.0), "times.bogus", "unknown_field"),
    ("BRANCH_DONE", lambda head: head["times"].pop("load_s"), "times.load_s", "missing_field"),
    ("DENOISED", _set(["branches", "self", "cached"], 1.5), "branches.self.cached", "bad_field"),
    ("DECODE", _set(["metadata"], {"a b": "x"}), "metadata.<key>", "bad_field"),
    ("DECODE", _set(["metadata", "seed"], 42), "metadata.seed", "bad_field"),
    ("DECODE", _set(["tile", "overlap"], 2.0), "tile.overlap", "bad_field"),
    ("ERROR", _set(["code"], "oops"), "code", "bad_field"),
    ("READY", _set(["info", "nested"], {"a": 1}), "info.nested", "bad_field"),
]


@pytest.mark.parametrize("kind,change,field,code", MALFORMED, ids=[f"{k}-{f}-{i}" for i, (k, _, f, _) in
                                                                  enumerate(MALFORMED)])
def test_malformed_header_names_the_field(kind, change, field, code):
    with pytest.raises(ProtocolError) as e:
        _decode_with(kind, change)
    assert e.value.field == field, str(e.value)
    assert e.value.code == code, str(e.value)
    reply = m.error_reply(7, e.value)
    assert reply.field == field and reply.code in m.ERROR_CODES


def test_malformed_frames():
    good = codec.encode(EXAMPLES["BRANCH"])
    cases = [
        ([], "frames", "bad_frames"),
        ([b"\xc1"], "frame0", "bad_request"),  # 0xc1 is never valid msgpack
        ([msgpack.packb([1, 2])], "frame0", "bad_field"),  # not a map
        ([msgpack.packb({1: 2})], "frame0", "bad_request"),  # non-string key (strict_map_key)
        ([msgpack.packb({"v": 1, "kind": "OK", "id": 1, "note": b"bin"}, use_bin_type=True)], "frame0",
         "bad_request"),
        ([msgpack.packb({"v": 1, "kind": "OK", "id": 1}) + b"\x00"], "frame0", "bad_request"),  # trailing data
        ([b"\x00" * (codec.MAX_HEADER_BYTES + 1)], "frame0", "too_large"),
        ([good[0]] + [b""] * codec.MAX_FRAMES, "frames", "too_large"),
        (good[:2], "passes[0].inputs.context.where.frame", "bad_frames"),  # a frame missing
        ([*good, b"spare"], "frames", "bad_frames"),  # a frame nobody references
        ([good[0], good[1], bytes(good[2])[:-2], good[3]], "passes[0].inputs.context.where.frame", "bad_frames"),
        ([good[0], good[2], good[1], good[3]], "passes[0].inputs.xn.where.frame", "bad_frames"),  # swapped sizes
    ]
    for frames, field, code in cases:
        with pytest.raises(ProtocolError) as e:
            codec.decode(frames)
        assert (e.value.field, e.value.code) == (field, code), (frames[:1], str(e.value))


def test_duplicate_frame_reference_is_refused():
    with pytest.raises(ProtocolError) as e:
        _decode_with("BRANCH", _set(["passes", 0, "inputs", "pad", "where"], {"frame": 1}),
                     frames=codec.encode(EXAMPLES["BRANCH"])[1:3])
    assert e.value.field.endswith("where.frame") and e.value.code == "bad_frames"


def test_encode_checks_frames_too():
    d = TensorDesc("f32", (4,), frame=1)
    with pytest.raises(ProtocolError, match="missing"):
        codec.encode(m.Decoded(job="j", png=d, width=1, height=1))
    with pytest.raises(ProtocolError, match="needs 16"):
        codec.encode(m.Decoded(job="j", png=d, width=1, height=1, inline=(b"abc",)))


def test_peek_id_and_expect():
    frames = codec.encode(m.Hello(id=77, peer="x", pid=1, version="1"))
    assert codec.peek_id(frames[0]) == 77 and codec.peek_id(b"\xc1") == 0
    err = m.Error(id=1, code="busy", message="later", retry=True)
    with pytest.raises(m.RemoteError, match="busy"):
        m.expect(err, m.Ok)
    with pytest.raises(ProtocolError):
        m.expect(m.Ok(), m.Pong)
    assert m.expect(err, m.Error) is err
