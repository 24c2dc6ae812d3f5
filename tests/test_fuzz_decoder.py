"""Property-based fuzzing of the decoder: mutated valid messages and random bytes for every kind → a message or a
ProtocolError, never another exception; a served stage answers every fuzzed request. (bench/fuzz_protocol.py: 100k+)"""

import faulthandler
import random
import threading

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import codec
from protocol import messages as m
from tests.protocol_examples import examples
from protocol.fields import ProtocolError
from tests.fuzzing import fuzz_kind
from protocol.sockets import make_socket
from stages.base import StageProc
from stages.config import parse_config

EXAMPLES = examples()
CI_EXAMPLES = 40  # hypothesis examples per kind and per test (they shrink failures to a readable case)
CI_RANDOM_FRAMES = 300  # fast random mutations per kind; bench/fuzz_protocol.py runs >= 100k per kind

FUZZ = settings(max_examples=CI_EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10)


def _paths(obj, prefix=()):
    """Every (path) into a decoded header: map keys and list indices."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append(prefix + (i,))
            out.extend(_paths(v, prefix + (i,)))
    return out


def _parent(obj, path):
    for key in path[:-1]:
        obj = obj[key]
    return obj


def _decode_or_protocol_error(frames):
    """The decoder's whole contract: a valid message (that round-trips) or a ProtocolError naming a field."""
    try:
        msg = codec.decode(frames)
    except ProtocolError as e:
        assert isinstance(e.field, str) and e.code
        m.error_reply(0, e)  # every decode error fits into an ERROR reply
        return None
    again = codec.decode(codec.encode(msg))
    assert again == msg
    return msg


@pytest.mark.parametrize("kind", sorted(m.KINDS))
@FUZZ
@given(data=st.data())
def test_mutated_messages(kind, data):
    frames = codec.encode(EXAMPLES[kind])
    head = msgpack.unpackb(frames[0], raw=False)
    paths = _paths(head)
    op = data.draw(st.sampled_from(["replace", "delete", "add", "frames", "truncate", "flip"]))
    rest = [bytes(f) for f in frames[1:]]
    if op == "replace":
        path = data.draw(st.sampled_from(paths))
        _parent(head, path)[path[-1]] = data.draw(values)
    elif op == "delete":
        path = data.draw(st.sampled_from(paths))
        parent = _parent(head, path)
        parent.pop(path[-1])
    elif op == "add":
        head[data.draw(st.text(max_size=12))] = data.draw(values)
    elif op == "frames":
        rest = data.draw(st.lists(st.binary(max_size=64), max_size=5)) if data.draw(st.booleans()) else rest[:-1]
    raw = msgpack.packb(head, use_bin_type=True)
    if op == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    elif op == "flip":
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:pos] + bytes([raw[pos] ^ data.draw(st.integers(1, 255))]) + raw[pos + 1:]
    _decode_or_protocol_error([raw, *rest])


@pytest.mark.parametrize("kind", sorted(m.KINDS))
@FUZZ
@given(frame0=st.binary(max_size=256), extra=st.lists(st.binary(max_size=32), max_size=3), prefix=st.booleans())
def test_random_bytes(kind, frame0, extra, prefix):
    if prefix:  # random bytes behind a valid start, so the parser gets past the first byte
        frame0 = codec.encode(EXAMPLES[kind])[0][:8] + frame0
    assert _decode_or_protocol_error([frame0, *extra]) is None or prefix


@pytest.mark.parametrize("kind", sorted(m.KINDS))
def test_random_mutations_never_crash(kind):
    counts = fuzz_kind(kind, CI_RANDOM_FRAMES, seed=0)
    assert counts.crashes == 0, counts.first_crash
    assert counts.frames == CI_RANDOM_FRAMES and counts.rejected > CI_RANDOM_FRAMES // 2
    assert counts.valid + counts.rejected == CI_RANDOM_FRAMES


class Echo:
    def on_encode(self, msg, ctx):
        return m.reply_to(msg, m.Ok, note="valid")


def test_served_stage_answers_every_fuzzed_request(tmp_path):
    """200 fuzzed requests to a running StageProc: each gets a reply (ERROR for the bad ones) and it keeps serving."""
    faulthandler.dump_traceback_later(60, exit=True)
    cfg = parse_config({"run_dir": str(tmp_path)}, tmp_path / "pipeline.toml")
    ctx = zmq.Context()
    proc = StageProc("encoder", Echo(), cfg, ctx=ctx, install_signals=False)
    t = threading.Thread(target=proc.run, daemon=True)
    t.start()
    req = make_socket(ctx, zmq.REQ, cfg.endpoint("encoder"), bind=False)
    rng = random.Random(1)
    kinds = sorted(set(m.KINDS) - {"SHUTDOWN"})    # a mutated SHUTDOWN may still be valid, and then it stops the stage
    errors = 0
    try:
        for i in range(200):
            frames = [bytes(f) for f in codec.encode(EXAMPLES[kinds[i % len(kinds)]])]
            raw = bytearray(frames[0])
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            req.send_multipart([bytes(raw), *frames[1:]])
            assert req.poll(5000), f"no reply to fuzzed request {i}"
            reply = codec.decode(req.recv_multipart())
            errors += isinstance(reply, m.Error)
        assert errors > 100
        req.send_multipart(codec.encode(m.Encode(job="j", prompt="fine")))
        assert req.poll(5000) and codec.decode(req.recv_multipart()).note == "valid"
        req.send_multipart(codec.encode(m.Shutdown()))
        assert req.poll(5000)
        req.recv_multipart()
        t.join(10)
        assert not t.is_alive()
    finally:
        req.close()
        ctx.term()
        faulthandler.cancel_dump_traceback_later()
