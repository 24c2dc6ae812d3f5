"""ZeroMQ helpers: endpoint checks, socket options, Lazy Pirate resend after a server restart, CURVE, events."""

import faulthandler
import os
import socket
import stat
import threading
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol import codec
from protocol import messages as m
from tests.protocol_examples import examples
from protocol.sockets import (HWM_MESSAGES, CurveClient, CurveServer, EndpointError, EventPull, EventPush,
                              LazyPirate, PeerRefused, PeerUnavailable, Server, ipc_endpoint, make_socket, parse_endpoint,
                              read_keypair, serve, write_keypair)

HANG_GUARD_S = 60


@pytest.fixture(autouse=True)
def hang_guard():
    """A hung test dumps every thread's stack and exits instead of blocking the suite."""
    faulthandler.dump_traceback_later(HANG_GUARD_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    t = threading.Thread(target=c.term, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "context.term() hung: a socket was left open or lingering"


@pytest.fixture
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("s")


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _thread(target, *args):
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def test_endpoint_checks():
    assert parse_endpoint("ipc:///tmp/x.sock") == ("ipc", "/tmp/x.sock")
    assert parse_endpoint("tcp://10.0.0.2:5555") == ("tcp", "10.0.0.2:5555")
    for bad, words in [("ipc://relative.sock", "absolute"), ("ipc:///" + "d" * 120, "too long"),
                       ("udp://1.2.3.4:5", "not ipc or tcp"), ("tcp://host", "port"), ("tcp://h:70000", "port"),
                       ("localhost:5555", "must look like")]:
        with pytest.raises(EndpointError, match=words):
            parse_endpoint(bad)
    with pytest.raises(EndpointError, match="shorter run directory"):
        ipc_endpoint("/tmp/" + "r" * 100, "executor")


def test_plaintext_tcp_is_refused_unless_allowed_on_loopback(ctx):
    port = _free_tcp_port()
    with pytest.raises(EndpointError, match="plaintext TCP is refused"):
        make_socket(ctx, zmq.ROUTER, f"tcp://127.0.0.1:{port}", bind=True)
    with pytest.raises(EndpointError, match="only allowed on a loopback"):
        make_socket(ctx, zmq.ROUTER, f"tcp://0.0.0.0:{port}", bind=True, allow_plaintext=True)
    with pytest.raises(EndpointError, match="only allowed on a loopback"):
        LazyPirate(ctx, f"tcp://10.1.2.3:{port}", allow_plaintext=True)
    s = make_socket(ctx, zmq.ROUTER, f"tcp://127.0.0.1:{port}", bind=True, allow_plaintext=True)
    s.close()


def test_every_socket_gets_linger_0_hwm_and_max_size(ctx, run_dir):
    srv = Server(ctx, ipc_endpoint(run_dir, "a"))
    push = EventPush(ctx, ipc_endpoint(run_dir, "ev"))
    lp = LazyPirate(ctx, srv.endpoint)
    lp._connect()
    for s in (srv.sock, push.sock, lp.sock):
        assert s.getsockopt(zmq.LINGER) == 0
        assert s.getsockopt(zmq.SNDHWM) == HWM_MESSAGES and s.getsockopt(zmq.RCVHWM) == HWM_MESSAGES
        assert s.getsockopt(zmq.MAXMSGSIZE) == codec.MAX_FRAME_BYTES
    # a request nobody will answer, queued to a peer that never reads: close must not block the context
    dead = LazyPirate(ctx, ipc_endpoint(run_dir, "nobody"))
    dead._connect().send_multipart(codec.encode(m.Heartbeat(peer="t")))
    t0 = time.monotonic()
    sent = [push.send(m.Ok()) for _ in range(HWM_MESSAGES * 4)]  # nobody listens: a bounded queue, then drops
    assert sent[0] is True and sent[-1] is False and time.monotonic() - t0 < 2.0
    for closer in (dead.close, lp.close, push.close, srv.close):
        closer()


def test_lazy_pirate_resends_after_a_server_restart(ctx, run_dir):
    endpoint = ipc_endpoint(run_dir, "executor")
    seen = []

    def flaky_server():
        srv = Server(ctx, endpoint)  # 1st life: takes the request and dies without answering
        req = None
        while req is None:
            req = srv.recv(1.0)
        seen.append(req.msg.attempt)
        srv.close()
        time.sleep(0.2)
        srv = Server(ctx, endpoint)  # 2nd life: answers the resend
        req = None
        while req is None:
            req = srv.recv(1.0)
        seen.append(req.msg.attempt)
        msg = req.msg
        srv.reply(req, m.reply_to(msg, m.BranchDone, job=msg.job, step=msg.step, block=msg.block,
                                  branch=msg.branch, attempt=msg.attempt,
                                  times=m.PhaseTimes(infer_s=(0.1,)),
                                  outputs=[p.output for p in msg.passes]))
        time.sleep(0.1)
        srv.close()

    t = _thread(flaky_server)
    branch = examples()["BRANCH"]
    branch = m.Branch(**{f: getattr(branch, f) for f in ("job", "step", "block", "branch", "model", "index")},
                      passes=[m.BranchPass(name="cond", inputs={}, output=branch.passes[0].output)])
    with LazyPirate(ctx, endpoint, peer="executor", timeout_s=0.5, retries=4) as lp:
        reply = m.expect(lp.request(branch), m.BranchDone)
        assert lp.resends >= 1
    t.join(10)
    assert not t.is_alive()
    assert seen[0] == 1 and seen[1] >= 2 and reply.attempt == seen[1] and reply.id == branch.id


def test_lazy_pirate_gives_up_after_bounded_retries_and_honours_stop(ctx, run_dir):
    idle_calls = []
    with LazyPirate(ctx, ipc_endpoint(run_dir, "gone"), peer="vae", timeout_s=0.2, retries=2) as lp:
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match=r"no reply from vae .* after 3 attempt\(s\) of 0.2 s"):
            lp.request(m.Heartbeat(peer="t"), idle=lambda: idle_calls.append(1))
        assert 0.5 < time.monotonic() - t0 < 3.0
        assert lp.resends == 2 and len(idle_calls) >= 3
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match="stopping"):
            lp.request(m.Heartbeat(peer="t"), timeout_s=30, should_stop=lambda: True)
        assert time.monotonic() - t0 < 1.0


def test_an_exception_in_idle_leaves_the_client_usable(ctx, run_dir):
    """The daemon's idle pump raised inside a request once; the REQ socket stayed between send and receive and every
    later request failed with "Operation cannot be accomplished in current state"."""
    endpoint = ipc_endpoint(run_dir, "slow")
    stop = threading.Event()
    srv = Server(ctx, endpoint)

    def handle(msg):
        time.sleep(0.3)                     # slow enough that the client's idle callback runs while it waits
        return m.reply_to(msg, m.Ok, note=msg.KIND)

    t = _thread(lambda: serve(srv, handle, should_stop=stop.is_set))

    def boom():
        raise KeyError("raised by the idle callback")
    try:
        with LazyPirate(ctx, endpoint, peer="slow", timeout_s=5.0, retries=0) as lp:
            with pytest.raises(KeyError):
                lp.request(m.Heartbeat(peer="t"), idle=boom)
            for _ in range(2):
                assert isinstance(lp.request(m.Cancel(job="j")), m.Ok)
            with pytest.raises(KeyError):
                lp.request(m.Heartbeat(peer="t"), should_stop=boom)
            assert lp.request(m.Cancel(job="j")).note == "CANCEL"
    finally:
        stop.set()
        t.join(5)
        srv.close()
    assert not t.is_alive()


def test_input_on_a_wake_socket_runs_idle_at_once(ctx, run_dir, monkeypatch):
    """The daemon waits on a stage (HELLO while it starts, a branch call) with its own clients' requests served by
    `idle`: a CLI request that came meanwhile waited for the end of the poll slice; on a `wake` socket it is served
    at once. Here the slice is 10 s and the stage answers after 1 s: only the wake socket can run idle before that."""
    monkeypatch.setattr("protocol.sockets.POLL_SLICE_S", 10.0)
    endpoint = ipc_endpoint(run_dir, "slow")
    stop = threading.Event()
    srv = Server(ctx, endpoint)

    def handle(msg):
        time.sleep(1.0)
        return m.reply_to(msg, m.Ok, note=msg.KIND)

    t = _thread(lambda: serve(srv, handle, should_stop=stop.is_set))
    pull = make_socket(ctx, zmq.PULL, ipc_endpoint(run_dir, "clients"), bind=True)
    push = make_socket(ctx, zmq.PUSH, ipc_endpoint(run_dir, "clients"), bind=False)
    served = []

    def idle():
        while pull.poll(0, zmq.POLLIN):
            served.append((pull.recv(), time.monotonic()))
    try:
        with LazyPirate(ctx, endpoint, peer="slow", timeout_s=5.0, retries=0) as lp:
            msg = m.Heartbeat(peer="t")
            lp.send(msg)
            sent = time.monotonic()
            _thread(lambda: (time.sleep(0.1), push.send(b"status")))
            reply = lp.request(msg, idle=idle, wake=(pull,), sent=True)
            answered = time.monotonic()
        assert reply.note == "HEARTBEAT"
        assert [b for b, _ in served] == [b"status"]
        assert served[0][1] - sent < 0.8 < answered - sent       # served while the stage was still working
    finally:
        stop.set()
        t.join(5)
        srv.close()
        push.close(0)
        pull.close(0)
    assert not t.is_alive()


def test_a_wake_socket_without_idle_does_not_spin_the_wait(ctx, run_dir):
    """Input waiting on a `wake` socket that no `idle` serves would make every poll return at once: the wait would
    spin a core until the reply. Without `idle`, the wake sockets are not watched."""
    endpoint = ipc_endpoint(run_dir, "slow")
    stop = threading.Event()
    srv = Server(ctx, endpoint)

    def handle(msg):
        time.sleep(1.0)
        return m.reply_to(msg, m.Ok, note=msg.KIND)

    t = _thread(lambda: serve(srv, handle, should_stop=stop.is_set))
    pull = make_socket(ctx, zmq.PULL, ipc_endpoint(run_dir, "clients"), bind=True)
    push = make_socket(ctx, zmq.PUSH, ipc_endpoint(run_dir, "clients"), bind=False)
    try:
        push.send(b"status")
        assert pull.poll(2000, zmq.POLLIN)                     # unread input on the wake socket
        with LazyPirate(ctx, endpoint, peer="slow", timeout_s=5.0, retries=0) as lp:
            cpu0 = time.process_time()
            reply = lp.request(m.Heartbeat(peer="t"), wake=(pull,))
            cpu = time.process_time() - cpu0
        assert reply.note == "HEARTBEAT"
        assert cpu < 0.5, f"the 1 s wait took {cpu:.2f} CPU-s"
    finally:
        stop.set()
        t.join(5)
        srv.close()
        push.close(0)
        pull.close(0)
    assert not t.is_alive()


def test_serve_answers_bad_messages_with_errors_and_keeps_serving(ctx, run_dir):
    endpoint = ipc_endpoint(run_dir, "echo")
    stop = threading.Event()
    srv = Server(ctx, endpoint)

    def handle(msg):
        return m.reply_to(msg, m.Ok, note=msg.KIND)

    t = _thread(lambda: serve(srv, handle, should_stop=stop.is_set))
    req = make_socket(ctx, zmq.REQ, endpoint, bind=False)
    try:
        for frames, field in [([b"\xc1"], "frame0"), ([codec.encode(m.Ok(id=5))[0], b"extra"], "frames"),
                              ([codec.encode(m.Hello(id=9, peer="x", pid=1, version="1"))[0][:-3]], "frame0")]:
            req.send_multipart(frames)
            assert req.poll(5000)
            reply = codec.decode(req.recv_multipart())
            assert isinstance(reply, m.Error) and reply.field == field, reply
        assert reply.id == 0
        req.send_multipart(codec.encode(m.Ok(id=5))[:1] + [b"extra"])
        assert req.poll(5000) and codec.decode(req.recv_multipart()).id == 5  # id recovered for the ERROR
        req.send_multipart(codec.encode(m.Cancel(id=11, job="j")))
        assert req.poll(5000)
        reply = codec.decode(req.recv_multipart())
        assert isinstance(reply, m.Ok) and reply.note == "CANCEL" and reply.id == 11
    finally:
        req.close()
        stop.set()
        t.join(5)
        srv.close()
    assert not t.is_alive()


def test_reply_to_a_vanished_peer_is_reported_not_raised(ctx, run_dir):
    srv = Server(ctx, ipc_endpoint(run_dir, "r"))
    req = make_socket(ctx, zmq.REQ, srv.endpoint, bind=False)
    req.send_multipart(codec.encode(m.Heartbeat(peer="t")))
    got = srv.recv(5.0)
    monitor = srv.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        req.close()  # the requester restarts before the answer
        assert monitor.poll(5000), "the server never saw the requester go"   # its disconnect, not a guessed delay
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        # the monitor's event can come a moment before the ROUTER drops the peer's pipe (seen under load): the reply
        # may still go out then; once the pipe is gone it must be reported, never raised
        deadline = time.monotonic() + 5
        while srv.reply(got, m.reply_to(got.msg, m.Ok)) is not False:
            assert time.monotonic() < deadline, "a reply to the vanished requester was never reported"
            time.sleep(0.05)
    finally:
        srv.sock.disable_monitor()
        monitor.close(0)
        srv.close()


def test_curve_allow_list_and_plaintext_refusal(ctx, tmp_path):
    keys = tmp_path / "keys"
    srv_pub_path, srv_sec_path = write_keypair(keys, "server")
    _, good_sec_path = write_keypair(keys, "good")
    _, bad_sec_path = write_keypair(keys, "bad")
    assert stat.S_IMODE(os.stat(srv_sec_path).st_mode) == 0o600 and stat.S_IMODE(os.stat(keys).st_mode) == 0o700
    s_pub, s_sec = read_keypair(srv_sec_path)
    g_pub, g_sec = read_keypair(good_sec_path)
    b_pub, b_sec = read_keypair(bad_sec_path)
    with pytest.raises(EndpointError, match="cannot read CURVE key"):
        read_keypair(tmp_path / "missing.key")
    endpoint = f"tcp://127.0.0.1:{_free_tcp_port()}"
    stop = threading.Event()
    srv = Server(ctx, endpoint, curve=CurveServer(s_pub, s_sec, frozenset({g_pub})))
    t = _thread(lambda: serve(srv, lambda msg: m.reply_to(msg, m.Ok, note="hi"), should_stop=stop.is_set))
    try:
        with LazyPirate(ctx, endpoint, timeout_s=2.0, retries=0, curve=CurveClient(g_pub, g_sec, s_pub)) as lp:
            assert m.expect(lp.request(m.Heartbeat(peer="good")), m.Ok).note == "hi"
        with LazyPirate(ctx, endpoint, timeout_s=1.0, retries=3, curve=CurveClient(b_pub, b_sec, s_pub)) as lp:
            with pytest.raises(PeerRefused, match="refused this client's CURVE key"):
                lp.request(m.Heartbeat(peer="bad"))
            assert lp.resends == 0  # a refusal is final: no resends
        with LazyPirate(ctx, endpoint, timeout_s=1.0, retries=0, allow_plaintext=True) as lp:
            with pytest.raises(PeerRefused, match="handshake failed"):
                lp.request(m.Heartbeat(peer="plain"))
        with pytest.raises(EndpointError, match="plaintext TCP is refused"):
            LazyPirate(ctx, endpoint)
    finally:
        stop.set()
        t.join(5)
        srv.close()
    assert not t.is_alive()


def test_events_push_pull_and_malformed_events_are_skipped(ctx, run_dir):
    endpoint = ipc_endpoint(run_dir, "events")
    pull = EventPull(ctx, endpoint)
    push = EventPush(ctx, endpoint)
    raw = make_socket(ctx, zmq.PUSH, endpoint, bind=False)
    try:
        progress = examples()["PROGRESS"]
        assert push.send(progress)
        assert pull.recv(5.0) == progress
        raw.send_multipart([b"garbage"])
        assert pull.recv(2.0) is None
        assert push.last_word(m.Dying(stage="vae", pid=1, reason="test"))
        got = pull.recv(5.0)
        assert isinstance(got, m.Dying) and got.reason == "test"
    finally:
        raw.close()
        pull.close()


def test_key_files_are_private_from_creation_and_loose_secret_files_are_refused(tmp_path, monkeypatch, caplog):
    """Keys are made 0600 in a 0700 folder whatever the caller's umask, with no chmod after writing (a file written
    under the umask is readable until the chmod; an existing looser folder is tightened); a secret file open to
    others is refused."""
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o755)
    keys.chmod(0o755)
    chmods = []
    real_chmod = os.chmod
    monkeypatch.setattr(os, "chmod", lambda p, mode, **kw: (chmods.append((str(p), mode)), real_chmod(p, mode, **kw)))
    old = os.umask(0)
    try:
        public_path, secret_path = write_keypair(keys, "vae")
        write_keypair(tmp_path / "new" / "deeper", "board")
    finally:
        os.umask(old)
    monkeypatch.undo()
    assert [p for p, _ in chmods if p.endswith((".key", ".key_secret"))] == []      # never widened, then narrowed
    for path in (public_path, secret_path, *(tmp_path / "new" / "deeper").iterdir()):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    for folder in (keys, tmp_path / "new", tmp_path / "new" / "deeper"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder        # the loose existing one tightened
    assert sorted(f.name for f in keys.iterdir()) == ["vae.key", "vae.key_secret"]       # no temporaries left
    public, secret = read_keypair(secret_path)
    assert read_keypair(public_path) == (public, None) and len(secret) == 40
    # like ssh: a secret key readable by group or others is refused, naming the file and the fix
    os.chmod(secret_path, 0o640)
    with pytest.raises(EndpointError, match=r"vae.key_secret has mode 0640: group or others may read it.*chmod 600"):
        read_keypair(secret_path)
    os.chmod(public_path, 0o644)
    assert read_keypair(public_path) == (public, None)                        # a public key may be shared
    from stages.config import ConfigError, parse_config
    cfg = parse_config({"run_dir": str(tmp_path), "endpoints": {"vae": "tcp://127.0.0.1:5999"},
                        "security": {"server_key": secret_path, "allowed_clients": [public_path]}},
                       tmp_path / "vae.toml")
    with pytest.raises(ConfigError, match=r"vae.toml: security.server_key: CURVE secret key file .* mode 0640"):
        cfg.check_listener("vae")
    (keys / "junk.key").write_text("curve\n    public-key = \"short\"\n")
    with pytest.raises(EndpointError, match="not 40 z85 characters"):
        read_keypair(keys / "junk.key")


def test_served_elsewhere_tells_another_machines_address():
    """A stage whose tcp endpoint is no address of this machine runs elsewhere (the board's executor program then
    exits 0: docs/remote-executor.md); ipc, wildcards and local addresses are served here."""
    from protocol.security import served_elsewhere
    assert not served_elsewhere("ipc:///tmp/anima/sock/executor.sock")
    assert not served_elsewhere("tcp://127.0.0.1:5561") and not served_elsewhere("tcp://*:5561")
    assert not served_elsewhere("tcp://localhost:5561")
    assert served_elsewhere("tcp://192.0.2.7:5561")           # TEST-NET-1 (RFC 5737): never a local address


def test_an_ipc_socket_is_private_from_the_moment_it_exists(ctx, run_dir, monkeypatch):
    """The socket file is created owner-only, not made so by a chmod after bind: a peer listing the folder between the
    two saw it 0755 (test_chaos caught that window). With chmod disabled the mode must still be 0700 under umask 022."""
    endpoint = ipc_endpoint(run_dir, "private")
    old = os.umask(0o022)
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    try:
        sock = make_socket(ctx, zmq.ROUTER, endpoint, bind=True)
    finally:
        os.umask(old)
    try:
        path = parse_endpoint(endpoint)[1]
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, oct(os.stat(path).st_mode)
        assert os.umask(old) == old                       # the process umask is restored after bind
    finally:
        sock.close(0)
