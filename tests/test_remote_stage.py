"""The real `python -m stages.vae` on another 'host' (a network namespace over veth, else 127.0.0.2) over CURVE TCP:
inline DECODE → PNG, unknown keys / plaintext refused, unsafe configs refused at start-up, Lazy Pirate across a restart."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from PIL import Image
from zmq.utils.monitor import recv_monitor_message

from protocol import codec
from protocol import messages as m
from protocol.security import CurveClient, is_loopback, read_keypair
from protocol.sockets import EndpointError, LazyPirate, PeerRefused, PeerUnavailable, configure
from protocol.tensors import InlineFrames, from_inline
from remote_net import RemoteNet, announce
from remote_vae_machine import START_TIMEOUT_S, RemoteVae, alive, hello
from tests.signals import signal_group, signal_process

REFUSED_WAIT_S = 1.5     # "no reply within the timeout" for refused clients
LATENT = (16, 8, 12)     # [C, h, w] → a 96×64 image


@pytest.fixture(scope="module")
def net(request):
    net = RemoteNet.up("rv")
    announce(request.config, f"\ntest_remote_stage: two hosts via {net.kind} "
                             f"(client {net.client_addr} → stage {net.server_addr})")
    yield net
    net.down()


@pytest.fixture(scope="module")
def remote(net, tiny_bundle):
    ctx = zmq.Context()
    vae = RemoteVae(net, tiny_bundle)
    try:
        vae.start()
        vae.ready = vae.wait_ready(ctx)
        yield vae, ctx
    finally:
        vae.close()
        ctx.destroy(linger=0)


def _decode_msg(latent: np.ndarray, metadata: dict[str, str]) -> m.Decode:
    frames = InlineFrames()
    desc = frames.add(latent)
    return m.Decode(job="j1", latent=desc, return_png=True, metadata=metadata, inline=tuple(frames.frames))


def _raw_request(ctx: zmq.Context, endpoint: str, curve: tuple[bytes, bytes, bytes] | None) -> tuple[bool, set[int]]:
    """A bare REQ (no client-side checks): (a reply came within REFUSED_WAIT_S, monitor events seen)."""
    sock = configure(ctx.socket(zmq.REQ))
    mon = sock.get_monitor_socket()
    try:
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
        sock.connect(endpoint)
        sock.send_multipart(codec.encode(hello()))
        replied = bool(sock.poll(int(REFUSED_WAIT_S * 1000), zmq.POLLIN))
        events, deadline = set(), time.monotonic() + 0.3    # bounded: a refused peer reconnects every 100 ms
        while mon.poll(50, zmq.POLLIN) and time.monotonic() < deadline:
            events.add(recv_monitor_message(mon)["event"])
        return replied, events
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)


def test_decode_over_curve_returns_the_png_inline(remote):
    vae, ctx = remote
    from models.vae.api import VAE
    latent = np.random.default_rng(3).standard_normal(LATENT).astype(np.float32)       # [16, 8, 12] f32
    metadata = {"parameters": "a cat\nSteps: 4, Seed: 42", "prompt": "a cat, ネコ", "seed": "42"}
    with vae.link(ctx) as link:
        reply = m.expect(link.request(_decode_msg(latent, metadata)), m.Decoded, "vae")
    assert reply.path is None and reply.png is not None and (reply.width, reply.height) == (96, 64)
    data = from_inline(reply.png, reply.inline).tobytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(io.BytesIO(data))
    img.load()
    assert img.size == (96, 64) and img.mode == "RGB"
    assert {k: img.text[k] for k in metadata} == metadata
    # the pixels are what the same VAE file decodes in this process: 1 thread both sides, the same float32 decode
    # and the one uint8 conversion (models.vae.api.to_uint8), so every byte is equal
    local = VAE.open(vae.ready.info["vae"], threads=1).decode(latent, tile=32, overlap=0.5)
    got = np.asarray(img)                                                              # [64, 96, 3] u8
    assert got.shape == local.image.shape
    np.testing.assert_array_equal(got, local.image)
    assert got.std() > 1.0  # a real image, not a flat fill


def test_a_remote_vae_writes_no_files_and_bounds_every_decode(remote, tmp_path):
    """Over tcp every allowed client could send DECODE: an `output` path is refused (the PNG comes back inline), so are
    an empty latent and a stride-1 tiling; each an ERROR naming the field, from the same process (no file is written
    where a remote request says, and no bad latent ends the stage)."""
    vae, ctx = remote
    latent = np.random.default_rng(4).standard_normal(LATENT).astype(np.float32)
    target = tmp_path / "planted.png"
    frames = InlineFrames()
    desc = frames.add(latent)
    empty = InlineFrames()
    empty_desc = empty.add(np.zeros((16, 0, 4), np.float32))
    bad = [
        (m.Decode(job="j1", latent=desc, output=str(target), inline=tuple(frames.frames)), "output"),
        (m.Decode(job="j1", latent=desc, output=str(target), return_png=True, inline=tuple(frames.frames)), "output"),
        (m.Decode(job="j1", latent=empty_desc, return_png=True, inline=tuple(empty.frames)), "latent"),
        (m.Decode(job="j1", latent=desc, return_png=True, tile=m.TileSettings(tile=16, overlap=0.9),
                  inline=tuple(frames.frames)), "tile.overlap"),
    ]
    with vae.link(ctx) as link:
        for msg, field in bad:
            reply = link.request(msg)
            assert isinstance(reply, m.Error) and (reply.code, reply.field) == ("bad_request", field), reply
        assert not target.exists()
        reply = m.expect(link.request(_decode_msg(latent, {"seed": "1"})), m.Decoded, "vae")
        ready = m.expect(link.request(hello()), m.Ready, "vae")
    assert reply.png is not None and reply.path is None and ready.pid == vae.ready.pid


def test_unknown_client_key_is_refused_and_the_stage_keeps_serving(remote):
    vae, ctx = remote
    s_pub = read_keypair(vae.folder / "keys" / "vae.key")[0]
    stranger = vae.keys("stranger")
    with LazyPirate(ctx, vae.endpoint, timeout_s=REFUSED_WAIT_S, retries=3,
                    curve=CurveClient(*stranger, s_pub)) as lp:
        with pytest.raises(PeerRefused, match="refused this client's CURVE key"):
            lp.request(hello())
        assert lp.resends == 0
    replied, events = _raw_request(ctx, vae.endpoint, (*stranger, s_pub))
    assert not replied and zmq.EVENT_HANDSHAKE_FAILED_AUTH in events
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events
    # an allowed client that expects another server key (a machine posing as the VAE) is refused too
    impostor_pub = read_keypair(vae.folder / "keys" / "impostor.key")[0]
    replied, events = _raw_request(ctx, vae.endpoint, (*vae.keys("board"), impostor_pub))
    assert not replied and zmq.EVENT_HANDSHAKE_SUCCEEDED not in events
    with LazyPirate(ctx, vae.endpoint, timeout_s=1.0, retries=1, curve=CurveClient(*vae.keys("board"), impostor_pub)) as lp:
        with pytest.raises(PeerRefused, match="security.servers.NAME"):
            lp.request(hello())
    with vae.link(ctx) as link:
        ready = m.expect(link.request(hello()), m.Ready, "vae")
    assert ready.pid == vae.ready.pid and alive(ready.pid)


def test_plaintext_client_is_refused(remote):
    vae, ctx = remote
    replied, events = _raw_request(ctx, vae.endpoint, None)
    assert not replied and zmq.EVENT_HANDSHAKE_SUCCEEDED not in events
    if is_loopback(vae.net.server_addr):
        with LazyPirate(ctx, vae.endpoint, timeout_s=REFUSED_WAIT_S, retries=2, allow_plaintext=True) as lp:
            with pytest.raises(PeerRefused, match="handshake failed"):
                lp.request(hello())
    else:  # our own client will not even try plaintext to a non-loopback address
        with pytest.raises(EndpointError, match="only allowed on a loopback"):
            LazyPirate(ctx, vae.endpoint, allow_plaintext=True)
    with vae.link(ctx) as link:
        assert m.expect(link.request(hello()), m.Ready, "vae").pid == vae.ready.pid


def _unsafe_configs(vae: RemoteVae) -> dict[str, tuple[str, str]]:
    """name → (vae.toml text, what the refusal must say)."""
    plain_addr = vae.net.server_addr if not is_loopback(vae.net.server_addr) else "192.0.2.77"
    return {
        "plaintext-remote": (f"""
            [endpoints]
            vae = "tcp://{plain_addr}:{vae.port + 2}"
            [security]
            allow_plaintext_loopback = true
            """, f"plaintext TCP is only allowed on a loopback address, not '{plain_addr}'"),
        "no-keys": (f"""
            [endpoints]
            vae = "tcp://{vae.net.server_addr}:{vae.port + 3}"
            """, "plaintext TCP is refused; configure CURVE keys"),
        "wildcard": (f"""
            [endpoints]
            vae = "tcp://0.0.0.0:{vae.port + 4}"
            [security]
            server_key = "keys/vae.key_secret"
            allowed_clients = ["keys/board.key"]
            """, "binding every network interface (0.0.0.0) is refused"),
        "missing-key-file": (f"""
            [endpoints]
            vae = "tcp://{vae.net.server_addr}:{vae.port + 5}"
            [security]
            server_key = "keys/nope.key_secret"
            allowed_clients = ["keys/board.key"]
            """, "security.server_key: cannot read CURVE key file"),
    }


def test_plaintext_on_a_remote_address_refuses_to_start(remote):
    """The real process: exit 2 (a config error: supervisord does not restart-loop it), one clear line, no bind."""
    vae, _ = remote
    text, expected = _unsafe_configs(vae)["plaintext-remote"]
    p = vae.run_stage(vae.write("plaintext-remote.toml", text), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, err = p.communicate(timeout=START_TIMEOUT_S)
    finally:
        if p.poll() is None:
            signal_group(p.pid)
            p.wait(10)
    err = err.decode()
    assert p.returncode == 2, (p.returncode, err)
    assert expected in err and "plaintext-remote.toml: endpoints.vae" in err, err
    assert "Traceback" not in err and "ready on" not in err, err


@pytest.mark.parametrize("case", ["no-keys", "wildcard", "missing-key-file"])
def test_unsafe_configs_are_refused_before_anything_starts(remote, case, capsys):
    """The same start-up path in this process (stage_main): the logic is never built, nothing binds."""
    from stages.base import EXIT_CONFIG, stage_main
    vae, _ = remote
    text, expected = _unsafe_configs(vae)[case]
    built = []
    code = stage_main("vae", built.append, ["--config", str(vae.write(f"{case}.toml", text))])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG and not built
    assert expected in err and f"{case}.toml" in err, err


def test_stage_dies_and_comes_back_the_client_resends(remote):
    """Killed mid-request, restarted by its supervisord: the board's Lazy Pirate client resends and gets the PNG."""
    vae, ctx = remote
    latent = np.random.default_rng(5).standard_normal(LATENT).astype(np.float32)
    old_pid = vae.ready.pid
    link = vae.link(ctx)
    # 1) connect (CURVE handshake done) and only then freeze the stage, so the first attempt certainly lands on the
    # process that is about to die; frozen before the handshake, ZeroMQ would hold the message and hand it to the
    # restarted process instead, and nothing would need resending
    assert isinstance(link.request(hello()), m.Ready)
    signal_process(old_pid, signal.SIGSTOP)
    result: dict = {}

    def call():
        """As the orchestrator does: Lazy Pirate resends; a `busy` answer (the new process still decodes an earlier
        attempt of this request) is asked again shortly after."""
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                reply = link.request(_decode_msg(latent, {"seed": "5"}))
                if not (isinstance(reply, m.Error) and reply.code == "busy") or time.monotonic() > deadline:
                    break
                result["busy"] = result.get("busy", 0) + 1
                time.sleep(0.5)
            result["reply"] = reply
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e
    t = threading.Thread(target=call, daemon=True)
    t.start()
    try:
        time.sleep(0.5)
        # 2) kill it: supervisord starts a new one on the same address; the client times out, reconnects, resends
        signal_process(old_pid)
        t.join(START_TIMEOUT_S)
        assert not t.is_alive(), "the Lazy Pirate client did not finish"
    finally:
        link.close()
    assert "error" not in result, f"{result.get('error')}: {vae._logs()}"
    reply = m.expect(result["reply"], m.Decoded, "vae")
    assert link.resends >= 1
    png = Image.open(io.BytesIO(from_inline(reply.png, reply.inline).tobytes()))
    assert png.size == (96, 64) and png.text["seed"] == "5"
    vae.ready = vae.wait_ready(ctx)
    assert vae.ready.pid != old_pid and not alive(old_pid)
    # READY comes from the process as soon as it serves; supervisord calls it RUNNING only after startsecs (2 s)
    deadline, status = time.monotonic() + START_TIMEOUT_S, ""
    while time.monotonic() < deadline:
        status = subprocess.run([str(Path(sys.executable).with_name("supervisorctl")), "-c", str(vae.conf),
                                 "status", "vae"], capture_output=True, text=True, timeout=30).stdout
        if "STARTING" not in status:
            break
        time.sleep(0.2)
    assert "RUNNING" in status and f"pid {vae.ready.pid}," in status, status


def test_teardown_leaves_nothing(net, remote):
    """Runs last: kill the VAE machine's processes as the fixture will, and check no process or port is left."""
    vae, ctx = remote
    vae.kill()
    assert vae.leftovers() == [] and not alive(vae.ready.pid)
    with LazyPirate(ctx, vae.endpoint, timeout_s=0.5, retries=0, curve=vae.board.curve_client("vae")) as link:
        with pytest.raises(PeerUnavailable):
            link.request(hello())


@pytest.mark.parametrize("host", ["*", "0.0.0.0"])
def test_a_wildcard_bind_needs_the_explicit_flag(tmp_path, host):
    """In-process: refused by default (with CURVE on), bound with allow_wildcard (security.allow_wildcard_bind)."""
    from protocol.security import CurveServer, check_bind, write_keypair
    from protocol.sockets import Server
    pub, sec = read_keypair(write_keypair(tmp_path, "s")[1])
    curve = CurveServer(pub, sec, frozenset({pub}))
    endpoint = f"tcp://{host}:{47500 + os.getpid() % 400}"
    check_bind("tcp://127.0.0.2:5560")  # a named address needs nothing
    for allow in (False, True):
        ctx = zmq.Context()  # one each: a ZAP handler's inproc endpoint is not reusable at once in the same context
        try:
            if not allow:
                with pytest.raises(EndpointError, match="binding every network interface"):
                    Server(ctx, endpoint, curve=curve)
                continue
            srv = Server(ctx, endpoint, curve=curve, allow_wildcard=True)
            assert srv.sock.getsockopt(zmq.LAST_ENDPOINT).decode().startswith("tcp://0.0.0.0:")
            srv.close()
        finally:
            ctx.destroy(linger=0)
