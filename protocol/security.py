"""Endpoints and transport security: endpoint checks, CURVE key pairs, the ZAP allow-list, the plaintext-TCP rule."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

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


def write_keypair(directory: str | os.PathLike, name: str) -> tuple[str, str]:
    """Create `NAME.key` (public) and `NAME.key_secret` in `directory`, both 0600. Returns their paths."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public_path, secret_path = zmq.auth.create_certificates(os.fspath(directory), name)
    for p in (public_path, secret_path):
        os.chmod(p, 0o600)
    return public_path, secret_path


def read_keypair(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys from a certificate file; secret is None for a public-only file."""
    try:
        return zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as e:
        raise EndpointError(f"cannot read CURVE key file {path}: {e}") from None


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


def ipc_endpoint(run_dir: str | os.PathLike, name: str) -> str:
    """`ipc://RUN/sock/NAME.sock` (the folder is made 0700); EndpointError when the path is too long."""
    sock_dir = os.path.join(os.path.abspath(os.fspath(run_dir)), "sock")
    endpoint = f"ipc://{sock_dir}/{name}.sock"
    parse_endpoint(endpoint)
    os.makedirs(sock_dir, mode=0o700, exist_ok=True)
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
