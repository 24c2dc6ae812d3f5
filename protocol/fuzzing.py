"""Fast random frame generators for fuzzing the decoder (the CI fuzz test and bench/fuzz_protocol.py)."""

from __future__ import annotations

import dataclasses
import random
import traceback
from typing import Any

import msgpack

from protocol import codec
from protocol import messages as m
from protocol.examples import examples
from protocol.fields import ProtocolError

_ODD_VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64 - 1, -(2**63), 0.5, -0.0, 1e308,
                          float("nan"), float("inf"), float("-inf"), "", "x", "\x00", "../..", "é" * 50, "a" * 70_000,
                          b"", b"\x00\x01", [], [1], [[[]]], {}, {"a": 1}, {"": None}, [None] * 20]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.5 or depth > 2:
        return rng.choice(_ODD_VALUES)
    if r < 0.65:
        return rng.randint(-(2**63), 2**64 - 1)
    if r < 0.75:
        return "".join(chr(rng.randint(1, 0x2FF)) for _ in range(rng.randint(0, 12)))
    if r < 0.88:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["v", "kind", "id", "job", "shape", "where", "x"]): _random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out.extend(_paths(v, prefix + (k,)))
    return out


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """A randomly broken (or occasionally still valid) variant of a valid message's frames."""
    op = rng.randrange(8)
    head = msgpack.unpackb(frames[0], raw=False)
    rest = list(frames[1:])
    if op <= 2:  # replace, delete or add a field somewhere in the header
        paths = _paths(head)
        path = rng.choice(paths)
        parent = head
        for key in path[:-1]:
            parent = parent[key]
        if op == 0:
            parent[path[-1]] = _random_value(rng)
        elif op == 1:
            parent.pop(path[-1])
        elif isinstance(parent, dict):
            parent[rng.choice(["extra", "v", "kind", "id", "\x00", ""])] = _random_value(rng)
        else:
            parent.append(_random_value(rng))
        raw = msgpack.packb(head, use_bin_type=True)
    else:
        raw = bytes(frames[0])
    if op == 3:  # flip bytes
        b = bytearray(raw)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        raw = bytes(b)
    elif op == 4:  # truncate or extend
        raw = raw[:rng.randrange(len(raw))] if rng.random() < 0.7 else raw + rng.randbytes(rng.randint(1, 16))
    elif op == 5:  # break the inline frames
        if rest and rng.random() < 0.5:
            i = rng.randrange(len(rest))
            rest[i] = rest[i][:rng.randrange(len(rest[i]) + 1)] + rng.randbytes(rng.randint(0, 3))
        else:
            rest = rest[:-1] if rest and rng.random() < 0.5 else rest + [rng.randbytes(rng.randint(0, 8))]
    elif op == 6:  # random bytes after a valid start
        raw = raw[:rng.randint(0, 12)] + rng.randbytes(rng.randint(0, 64))
    elif op == 7:  # pure noise
        raw = rng.randbytes(rng.randint(0, 64))
    return [raw, *rest]


@dataclasses.dataclass
class FuzzCounts:
    frames: int = 0  # messages tried
    valid: int = 0  # decoded and round-tripped
    rejected: int = 0  # ProtocolError
    crashes: int = 0  # any other exception: a bug
    first_crash: str = ""


def fuzz_kind(kind: str, n: int, seed: int = 0) -> FuzzCounts:
    """Decode `n` mutated variants of the example `kind`; count outcomes (crashes must stay 0)."""
    rng = random.Random(f"{kind}-{seed}")
    base = [bytes(f) for f in codec.encode(examples()[kind])]
    counts = FuzzCounts()
    for _ in range(n):
        frames = mutate(base, rng)
        counts.frames += 1
        try:
            try:
                msg = codec.decode(frames)
            except ProtocolError as e:
                m.error_reply(0, e)  # every rejection must fit an ERROR reply
                counts.rejected += 1
                continue
            if codec.decode(codec.encode(msg)) != msg:
                raise AssertionError("valid message does not round-trip")
            counts.valid += 1
        except Exception:  # noqa: BLE001 - the point: count anything else as a crash
            counts.crashes += 1
            if not counts.first_crash:
                counts.first_crash = f"{frames[:1]!r}\n{traceback.format_exc()}"
    return counts
