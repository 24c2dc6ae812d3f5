"""Endpoints and transport security: endpoint checks, CURVE key pairs, the ZAP allow-list, the plaintext-TCP rule."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
import stat
import time
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from models.base.durable import atomic_write

log = logging.getLogger(__name__)

IPC_PATH_MAX_CHARS = 100  # sun_path is 108 bytes on Linux; stay clear of it
ZAP_DOMAIN = "anima"  # the authentication domain of every CURVE server socket


class EndpointError(ValueError):
    """A bad endpoint or an unsafe transport setting, said plainly."""


@dataclasses.dataclass(frozen=True)
class CurveServer:
    """Server side of CURVE: its key pair and the z85 public keys of the clients it accepts."""

    public: bytes
    secret: bytes
    allowed_clients: frozenset[bytes]


@dataclasses.dataclass(frozen=True)
class CurveClient:
    """Client side of CURVE: its own key pair and the server's public key."""

    public: bytes
    secret: bytes
    server_public: bytes


KEYS_DIR_MODE = 0o700
KEY_FILE_MODE = 0o600
_CERT = """#   ****  Generated on {when} by anima (orchestrator keys generate)  ****
#   ZeroMQ CURVE {what} Certificate
#   {note}

metadata
curve
    public-key = "{public}"
"""


def _certificate(public: bytes, secret: bytes | None) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    if secret is None:
        return _CERT.format(when=when, what="Public", note="Give it to the peers that must accept this key.",
                            public=public.decode())
    return _CERT.format(when=when, what="**Secret**", note="DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its "
                        "permissions.", public=public.decode()) + f'    secret-key = "{secret.decode()}"\n'


def _private_folder(directory: str) -> None:
    """A keys folder is ours and 0700: one open to group or others is tightened (a note is logged), one of another
    user is refused."""
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise EndpointError(f"{directory} is not a folder")
    if st.st_uid != os.geteuid():
        raise EndpointError(f"keys folder {directory} belongs to uid {st.st_uid}, not to this user "
                            f"({os.geteuid()}); choose a folder of your own")
    if stat.S_IMODE(st.st_mode) != KEYS_DIR_MODE:
        os.chmod(directory, KEYS_DIR_MODE)
        log.warning("keys folder %s had mode %04o; tightened to %04o", directory, stat.S_IMODE(st.st_mode),
                    KEYS_DIR_MODE)


def write_keypair(directory: str | os.PathLike, name: str) -> tuple[str, str]:
    """Create `NAME.key` (public) and `NAME.key_secret` in `directory`; returns their paths.

    The folder is made 0700 and the files 0600 from the start (umask 077 while they are made; each file is a
    temporary created 0600 in the folder, then renamed into place), never chmodded after being written. An existing
    folder with a looser mode is tightened to 0700; a folder of another user is refused (EndpointError)."""
    directory = os.fspath(directory)
    public, secret = zmq.curve_keypair()                  # z85 bytes
    paths = (os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret"))
    umask = os.umask(0o077)
    try:
        os.makedirs(directory, mode=KEYS_DIR_MODE, exist_ok=True)
        _private_folder(directory)
        atomic_write(paths[1], _certificate(public, secret), mode=KEY_FILE_MODE)
        atomic_write(paths[0], _certificate(public, None), mode=KEY_FILE_MODE)
    finally:
        os.umask(umask)
    return paths


def _parse_certificate(data: bytes, path) -> tuple[bytes, bytes | None]:
    """(public, secret) from a ZeroMQ certificate's text (the format of zmq.auth)."""
    public = secret = None
    for line in data.splitlines():
        line = line.strip()
        if line.startswith(b"public-key"):
            public = line.split(b"=", 1)[1].strip(b" \t'\"")
        elif line.startswith(b"secret-key"):
            secret = line.split(b"=", 1)[1].strip(b" \t'\"")
    if not public:
        raise EndpointError(f"cannot read CURVE key file {path}: no public key in it")
    for what, key in (("public", public), ("secret", secret)):
        if key is not None and len(key) != 40:
            raise EndpointError(f"cannot read CURVE key file {path}: the {what} key is not 40 z85 characters")
    return public, secret


def read_keypair(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys from a certificate file; secret is None for a public-only file.

    A file holding a secret key must not be open to group or others (like ssh's private keys): refused, with the
    chmod that fixes it."""
    try:
        with open(os.fspath(path), "rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            data = f.read(64 * 1024)
    except OSError as e:
        raise EndpointError(f"cannot read CURVE key file {path}: {e.strerror}") from None
    public, secret = _parse_certificate(data, path)
    if secret is not None and mode & 0o077:
        raise EndpointError(f"CURVE secret key file {path} has mode {mode:04o}: group or others may read it, so it "
                            f"is refused; make it private (chmod 600 {path}) or generate a new pair")
    return public, secret


def parse_endpoint(endpoint: str) -> tuple[str, str]:
    """('ipc', path) or ('tcp', 'host:port') after checking the endpoint; EndpointError names the problem."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise EndpointError(f"endpoint {endpoint!r} must look like ipc:///path or tcp://host:port")
    transport, address = endpoint.split("://", 1)
    if transport == "ipc":
        if not address.startswith("/"):
            raise EndpointError(f"ipc endpoint {endpoint!r} needs an absolute path")
        if len(address) >= IPC_PATH_MAX_CHARS:
            raise EndpointError(f"ipc path of {len(address)} chars is too long (< {IPC_PATH_MAX_CHARS}): {address} "
                                "— use a shorter run directory")
        return transport, address
    if transport == "tcp":
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise EndpointError(f"tcp endpoint {endpoint!r} must be tcp://host:port with a port in 1..65535")
        return transport, address
    raise EndpointError(f"endpoint {endpoint!r}: transport {transport!r} is not ipc or tcp")


def served_elsewhere(endpoint: str) -> bool:
    """True for a tcp endpoint whose address belongs to no interface of this machine (a stage that runs on another
    machine, e.g. the executor on a bigger host); False for ipc, wildcards and local addresses."""
    transport, address = parse_endpoint(endpoint)
    host = address.rpartition(":")[0].strip("[]")
    if transport != "tcp" or host in ("*", "0.0.0.0", "::"):
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False                      # unresolvable: let the bind say what is wrong
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
                return False
            except OSError:
                continue
    return True


def ipc_path(run_dir: str | os.PathLike, name: str) -> str:
    """RUN/sock/NAME.sock: where a run folder's unix sockets live (every stage's by default, the daemon's)."""
    return os.path.join(os.path.abspath(os.fspath(run_dir)), "sock", f"{name}.sock")


def ipc_endpoint(run_dir: str | os.PathLike, name: str) -> str:
    """`ipc://RUN/sock/NAME.sock` (the folder is made 0700); EndpointError when the path is too long."""
    path = ipc_path(run_dir, name)
    endpoint = f"ipc://{path}"
    parse_endpoint(endpoint)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    return endpoint


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})  # bind addresses that listen on every interface


def check_bind(endpoint: str, allow_wildcard: bool = False) -> None:
    """A listener binds only the address it names: `tcp://*` / 0.0.0.0 / `::` need `allow_wildcard`."""
    transport, address = parse_endpoint(endpoint)
    host = address.rpartition(":")[0]
    if transport == "tcp" and host in WILDCARD_HOSTS and not allow_wildcard:
        raise EndpointError(f"{endpoint}: binding every network interface ({host}) is refused; name the one address "
                            "to listen on (e.g. tcp://10.0.0.2:5560), or allow it explicitly "
                            "(security.allow_wildcard_bind = true)")


def check_security(endpoint: str, curve: Any, allow_plaintext: bool) -> None:
    transport, address = parse_endpoint(endpoint)
    if transport != "tcp" or curve is not None:
        return
    host = address.rpartition(":")[0]
    if not allow_plaintext:
        raise EndpointError(f"{endpoint}: plaintext TCP is refused; configure CURVE keys "
                            "(or allow plaintext explicitly, loopback only)")
    if not is_loopback(host):
        raise EndpointError(f"{endpoint}: plaintext TCP is only allowed on a loopback address, not {host!r}")


class _AllowList:
    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            log.warning("CURVE client key %s refused (not in the allow-list)", key[:8])
        return ok


def start_authenticator(ctx: zmq.Context, curve: CurveServer) -> ThreadAuthenticator:
    """A ZAP handler on `ctx` that accepts only `curve.allowed_clients` (one per context; stop() it at close)."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_AllowList(curve.allowed_clients))
    return auth
