"""Fuzzing: random frame generators for the decoder, and `fuzz_live`, which sends the same mutations as requests to a
real serving process and checks it answers every one, never hangs, never dies and keeps serving (the CI fuzz tests
and bench/fuzz_protocol.py)."""

from __future__ import annotations

import dataclasses
import json
import random
import time
import traceback
from typing import Any, Callable

import msgpack
import zmq

from protocol import codec
from protocol import messages as m
from tests.protocol_examples import examples
from protocol.fields import ProtocolError
from protocol.prompt import PromptFile

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


def mutate(frames: list[bytes], rng: random.Random, protect: frozenset = frozenset()) -> list[bytes]:
    """A randomly broken (or occasionally still valid) variant of a valid message's frames; top-level header fields
    in `protect` are never replaced, deleted or added to (byte-level mutations may still hit them)."""
    op = rng.randrange(8)
    head = msgpack.unpackb(frames[0], raw=False)
    rest = list(frames[1:])
    if op <= 2:  # replace, delete or add a field somewhere in the header
        paths = [p for p in _paths(head) if p[0] not in protect] or [("extra",)]
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


# ---- JSON content (SUBMIT.origin's text, SUBMIT.prompt's record): odd values as raw JSON, incl. what json.dumps cannot write
ODD_JSON: list[str] = [
    "null", "true", "false", "0", "-1", "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1.5", "-0.0",
    "9" * 5000, "-" + "9" * 5000, str(2**64), str(2**63), "1" + "0" * 300, '""', '"x"', '"\\ud800"',
    '"\\udfff\\ud800"', '"\\u0000"', '"' + "é" * 5000 + '"', '"' + "a" * 70_000 + '"', "[]", "{}",
    "[" * 2000 + "]" * 2000, '{"a":' * 2000 + "1" + "}" * 2000, "[1, 2, 3]", '{"enabled": false}', '"(a:1.2)"',
]


def json_variant(base: dict, rng: random.Random, values: dict[str, list[str]] | None = None) -> str:
    """JSON text of `base` with one or two fields replaced by odd values, removed, duplicated or added, or the whole
    text broken. `values` gives the raw JSON candidates of particular fields (the only ones such a field gets: a
    caller keeps e.g. file paths inside a sandbox); those fields are picked half the time."""
    values = values or {}
    items = [(k, json.dumps(v)) for k, v in base.items()]
    for _ in range(rng.randint(1, 2)):
        op = rng.randrange(4)
        keys = list(values) if values and rng.random() < 0.5 else list(base) + list(values) + ["extra", "", "\u0000"]
        key = rng.choice(keys)
        raw = rng.choice(values[key]) if key in values else rng.choice(ODD_JSON)
        if op == 0:                                   # replace (or add) a field
            items = [(k, v) for k, v in items if k != key] + [(key, raw)]
        elif op == 1 and items:                       # drop one
            items.pop(rng.randrange(len(items)))
        elif op == 2:                                 # a duplicate key
            items.append((key, raw))
        elif items:                                   # an existing field gets an odd value
            i = rng.randrange(len(items))
            items[i] = (items[i][0], rng.choice(values.get(items[i][0], ODD_JSON)))
    text = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in items) + "}"
    r = rng.random()
    if r < 0.05:
        text = text[:rng.randrange(len(text) + 1)]    # truncated
    elif r < 0.08:
        text = rng.choice(ODD_JSON)                   # not an object at all
    return text


# ---- live fuzzing of a serving process ---------------------------------------------------------------------------

PROCESS_CHECK_S = 1.0        # while a reply is awaited, how often the serving process is looked at
RESTART_WAIT_S = 120.0       # a process that went away must be back (supervisord) within this long
MAX_PROBLEMS = 20


class _Gone(Exception):
    """The fuzzed process went away and nothing took its place."""


@dataclasses.dataclass
class LiveCounts:
    frames: int = 0          # fuzzed requests sent
    answered: int = 0        # got a reply that decodes
    errors: int = 0          # of which ERROR replies
    hangs: int = 0           # no reply within the timeout while the same process lived
    crashes: int = 0         # the serving process died or was replaced, or a reply did not decode
    probes: int = 0          # valid requests in between, answered as they should be
    failed_probes: int = 0
    wall_s: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)    # the first MAX_PROBLEMS, said plainly

    @property
    def first_problem(self) -> str:
        return self.problems[0] if self.problems else ""

    @property
    def ok(self) -> bool:
        return (self.crashes == 0 and self.hangs == 0 and self.failed_probes == 0 and self.probes > 0
                and self.answered == self.frames)

    def line(self, name: str) -> str:
        return (f"live {name} frames={self.frames} answered={self.answered} errors={self.errors} "
                f"crashes={self.crashes} hangs={self.hangs} probes={self.probes - self.failed_probes}/{self.probes} "
                f"serving={'yes' if self.ok else 'NO'} wall_s={self.wall_s:.1f}")


@dataclasses.dataclass
class LiveTarget:
    """A serving process to fuzz: where it listens, what to mutate, and how to tell it is the same live process."""

    endpoint: str
    bases: list[m.Message]                                   # valid requests; frame i mutates bases[i % len]
    pid: Callable[[], int]                                   # the serving process now (0: none)
    probe: Callable[[], m.Message]                           # a valid request ...
    probe_ok: Callable[[m.Message], bool]                    # ... and what its reply must satisfy
    payload: Callable[[dict, random.Random], None] | None = None   # edits a header (a dict) before mutate()
    protect: frozenset = frozenset()                         # header fields mutate() leaves alone
    corpus: list = dataclasses.field(default_factory=list)   # known bad requests, sent first: messages, or
    #                                                          (message, header edit) pairs for what no message holds
    timeout_s: float = 30.0                                  # a reply later than this is a hang


def _frames_with_fresh_id(msg: m.Message, rng: random.Random,
                          payload: Callable[[dict, random.Random], None] | None = None) -> list[bytes]:
    frames = [bytes(f) for f in codec.encode(msg)]
    head = msgpack.unpackb(frames[0], raw=False)
    head["id"] = rng.randrange(1, m.MAX_ID)                  # a resend is not what is being tested
    if payload is not None:
        payload(head, rng)
    return [msgpack.packb(head, use_bin_type=True), *frames[1:]]


def carried(text: str):
    """A JSON variant as the msgpack map a client would send it in (a SUBMIT's prompt record): decoded, where msgpack
    can carry the values; integers past 64 bits and lone surrogates cannot be packed, so those variants stay text
    (the record then gets a string where it wants an object, which it refuses)."""
    try:
        obj = json.loads(text, parse_int=lambda t: int(t) if len(t) <= 19 else float("inf"))
        msgpack.packb(obj, use_bin_type=True)
        return obj
    except (ValueError, RecursionError, OverflowError, TypeError, UnicodeEncodeError):
        return text


def submit_frames(prompt_text: str, base_dir: str) -> list[bytes]:
    """A SUBMIT whose prompt record is the JSON text as a client would carry it (`carried`): odd values that no
    PromptFile could hold, for a daemon to refuse."""
    base = m.Submit(prompt=PromptFile(prompt="x"), base_dir=base_dir)
    return _frames_with_fresh_id(base, random.Random(), lambda head, rng: head.__setitem__("prompt",
                                                                                           carried(prompt_text)))


def request_once(ctx: zmq.Context, endpoint: str, frames: list[bytes], timeout_s: float = 30.0) -> m.Message:
    """Raw frames to a REQ/REP peer and its decoded reply (TimeoutError when none comes)."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply from {endpoint} in {timeout_s:g} s")
        return codec.decode(sock.recv_multipart())
    finally:
        sock.close()


class _LiveSession:
    """One live fuzz: the REQ socket to the target, the pid that serves it, and the counts so far."""

    def __init__(self, ctx: zmq.Context, target: LiveTarget, rng: random.Random):
        self.ctx, self.target, self.rng = ctx, target, rng
        self.counts = LiveCounts()
        self.sock = None
        self.pid0 = 0

    def reopen(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.target.endpoint)

    def problem(self, text: str) -> None:
        if len(self.counts.problems) < MAX_PROBLEMS:
            self.counts.problems.append(f"{time.strftime('%H:%M:%S')} {text}")

    def exchange(self, frames: list[bytes]) -> m.Message | None | str:
        """The decoded reply, None for no reply in time (or the process is gone), or a str saying why the reply is
        broken."""
        self.sock.send_multipart(frames)
        deadline = time.monotonic() + self.target.timeout_s
        while not self.sock.poll(int(PROCESS_CHECK_S * 1000), zmq.POLLIN):
            if time.monotonic() > deadline or self.target.pid() != self.pid0:
                self.reopen()                                # a REQ socket without its reply cannot send again
                return None
        reply = self.sock.recv_multipart()
        try:
            return codec.decode(reply)
        except ProtocolError as e:
            return f"undecodable reply: {e}"

    def await_process(self) -> int:
        """The serving pid, once there is one again (supervisord restarts a dead program); _Gone if none comes."""
        now, deadline = self.target.pid(), time.monotonic() + RESTART_WAIT_S
        while not now and time.monotonic() < deadline:
            time.sleep(0.2)
            now = self.target.pid()
        if not now:
            self.problem(f"no process serves {self.target.endpoint} {RESTART_WAIT_S:.0f} s after it went away")
            raise _Gone()
        return now

    def same_process(self, what: str) -> bool:
        """True when the process that served so far still does; else a crash is counted and the new one awaited."""
        now = self.target.pid()
        if now == self.pid0 and now:
            return True
        self.counts.crashes += 1
        self.problem(f"{what}: the process changed from pid {self.pid0} to {now or 'none'}")
        self.pid0 = self.await_process()
        return False

    def run_probe(self) -> None:
        counts = self.counts
        counts.probes += 1
        reply = self.exchange(_frames_with_fresh_id(self.target.probe(), self.rng))
        if not isinstance(reply, m.Message) or not self.target.probe_ok(reply):
            counts.failed_probes += 1
            self.problem(f"probe after frame {counts.frames}: {reply!r:.500}")
        self.same_process(f"probe after frame {counts.frames}")

    def frames_for(self, i: int) -> list[bytes]:
        """Frame i's request: the corpus first, then a base request with a field's content varied or mutated."""
        target, rng = self.target, self.rng
        if i < len(target.corpus):
            entry = target.corpus[i]
            msg, edit = entry if isinstance(entry, tuple) else (entry, None)
            return _frames_with_fresh_id(msg, rng, edit)
        base = target.bases[i % len(target.bases)]
        if target.payload is not None and rng.random() < 0.6:   # a field's content varied, the rest valid,
            frames = _frames_with_fresh_id(base, rng, target.payload)
            if rng.random() < 0.3:                                # and sometimes broken on top
                frames = mutate(frames, rng, target.protect)
            return frames
        return mutate(_frames_with_fresh_id(base, rng), rng, target.protect)

    def send_frame(self, i: int, frames: list[bytes]) -> None:
        """Sends frame i and counts what came back: an answer, a hang, or a crash."""
        counts = self.counts
        counts.frames += 1
        reply = self.exchange(frames)
        if isinstance(reply, m.Message):
            counts.answered += 1
            counts.errors += isinstance(reply, m.Error)
            if isinstance(reply, m.Error) and reply.code == "internal":    # the fatal tier: it dies now
                counts.crashes += 1
                self.problem(f"frame {i}: {reply.message[:500]}\n{frames[0][:300]!r}")
                time.sleep(0.5)
                self.pid0 = self.await_process()
        elif reply is None:
            if self.same_process(f"frame {i} (no reply)"):
                counts.hangs += 1
                self.problem(f"frame {i}: no reply in {self.target.timeout_s} s\n{frames[0][:300]!r}")
        else:
            counts.crashes += 1
            self.problem(f"frame {i}: {reply}")


def fuzz_live(ctx: zmq.Context, target: LiveTarget, n: int, seed: int = 0, probe_every: int = 200,
              on_progress: Callable[[LiveCounts], None] | None = None) -> LiveCounts:
    """Send `n` mutated requests to the live target, one at a time, each waited for; a valid probe request every
    `probe_every` frames and at the end. No reply within the timeout is a hang if the same process still serves,
    else a crash (and the fuzz goes on with the restarted process)."""
    live, t0 = _LiveSession(ctx, target, random.Random(f"live-{seed}")), time.monotonic()
    counts = live.counts
    live.reopen()
    try:
        live.pid0 = live.await_process()
        for i in range(n):
            live.send_frame(i, live.frames_for(i))
            if (i + 1) % probe_every == 0:
                live.run_probe()
                if on_progress is not None:
                    counts.wall_s = time.monotonic() - t0
                    on_progress(counts)
        live.run_probe()
    except _Gone:
        counts.failed_probes += 1          # it stopped serving: the fuzz ends with what it saw
    finally:
        live.sock.close(0)
        counts.wall_s = time.monotonic() - t0
    return counts
