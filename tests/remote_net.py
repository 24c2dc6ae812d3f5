"""Two hosts for remote-stage tests: a network namespace joined by a veth pair (root + `ip netns`), else two loopback
addresses (127.0.0.1 → 127.0.0.2, which Linux routes without any set-up).

    net = RemoteNet.up("rv")          # net.kind: "netns" | "loopback"; net.server_addr, net.wrap(cmd)
    ...
    net.down()
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import sys
import zlib

log = logging.getLogger(__name__)

NS_PREFIX = "anima-rt-"
FORCE_ENV = "ANIMA_REMOTE_NET"  # "loopback" forces the fallback, "netns" makes a netns failure an error
IP_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 10.0


@dataclasses.dataclass
class RemoteNet:
    """Where the 'remote machine' lives: `server_addr` (it binds there), `wrap(cmd)` runs a command on it."""

    kind: str
    server_addr: str
    client_addr: str
    namespace: str | None = None
    host_if: str | None = None

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *cmd] if self.namespace else list(cmd)

    def free_port(self) -> int:
        """A port that is free on the server address (any port is, in a fresh namespace)."""
        if self.namespace:
            return 47000 + os.getpid() % 1000
        with socket.socket() as s:
            s.bind((self.server_addr, 0))
            return s.getsockname()[1]

    @classmethod
    def up(cls, tag: str) -> "RemoteNet":
        force = os.environ.get(FORCE_ENV, "")
        if force != "loopback":
            try:
                return cls._netns(tag)
            except (OSError, subprocess.SubprocessError, RuntimeError) as e:
                if force == "netns":
                    raise
                log.warning("network namespace unavailable (%s); using loopback addresses", e)
        return cls("loopback", "127.0.0.2", "127.0.0.1")

    @classmethod
    def _netns(cls, tag: str) -> "RemoteNet":
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise RuntimeError("needs root and iproute2's ip")
        _reap_stale()
        pid = os.getpid()
        ns = f"{NS_PREFIX}{tag}-{pid}"
        idx = (pid + zlib.crc32(tag.encode())) % 16000      # one /30 per test process and tag: 10.213.a.b
        a, b = idx // 64, (idx % 64) * 4
        host_ip, ns_ip = f"10.213.{a}.{b + 1}", f"10.213.{a}.{b + 2}"
        host_if, ns_if = _ifname(tag, pid, "h"), _ifname(tag, pid, "n")
        net = cls("netns", ns_ip, host_ip, ns, host_if)
        try:
            _ip("netns", "add", ns)
            _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            _ip("link", "set", ns_if, "netns", ns)
            _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
            _ip("link", "set", host_if, "up")
            _ip("-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
            _ip("-n", ns, "link", "set", ns_if, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            net._probe()
        except BaseException:
            net.down()
            raise
        return net

    def _probe(self) -> None:
        """A TCP connection from here to a listener inside the namespace, or RuntimeError."""
        port = self.free_port() + 1                          # not the stage's port
        code = ("import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                f"s.bind(('{self.server_addr}',{port}));s.listen();print('up',flush=True);c,_=s.accept();c.send(b'ok')")
        p = subprocess.Popen(self.wrap([sys.executable, "-c", code]), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            if p.stdout.readline().strip() != b"up":
                raise RuntimeError(f"probe listener failed: {p.stderr.read().decode()[-500:]}")
            with socket.create_connection((self.server_addr, port), timeout=PROBE_TIMEOUT_S) as c:
                if c.recv(2) != b"ok":
                    raise RuntimeError("probe: no data over the veth pair")
        finally:
            p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()

    def down(self) -> None:
        if self.namespace:
            for args in (("netns", "del", self.namespace), ("link", "del", self.host_if)):
                subprocess.run(["ip", *args], capture_output=True, timeout=IP_TIMEOUT_S)


def _ifname(tag: str, pid: int, side: str) -> str:
    return f"av{tag[:2]}{pid % 10**7}{side}"  # interface names: 15 characters at most


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _reap_stale() -> None:
    """Remove namespaces this module made in test processes that are gone (a killed pytest leaves them)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        pid = name.rsplit("-", 1)[-1]
        if name.startswith(NS_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=IP_TIMEOUT_S)
            tag = name[len(NS_PREFIX):].rsplit("-", 1)[0]
            subprocess.run(["ip", "link", "del", _ifname(tag, int(pid), "h")], capture_output=True,
                           timeout=IP_TIMEOUT_S)


def announce(config, text: str) -> None:
    """One line on pytest's terminal past output capture (e.g. which network set-up ran)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    if capman is None:
        reporter.write_line(text)
        return
    with capman.global_and_fixture_disabled():
        reporter.write_line(text)
