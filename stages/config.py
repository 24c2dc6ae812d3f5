"""The pipeline config file (TOML) every process reads with `--config FILE`: schema, defaults, validation.

    run_dir = "run"                 # relative paths resolve from the config file's folder; default: that folder
    pack_dir = "bundle/pack"        # optional: the default model pack (a job that names no size gets its size)
    packs = ["bundle/pack-512"]     # optional: more packs, one per image size
    models_dir = "bundle/models"    # optional
    backend = "onnx"                # executor backend
    threads = 2
    log_level = "info"              # debug | info | warning | error

    [endpoints]                     # default ipc://RUN/sock/NAME.sock; tcp://host:port for remote stages
    events = "ipc:///…/events.sock" # the orchestrator's event sink (PROGRESS, DYING, READY)
    vae = "tcp://10.0.0.2:5560"

    [timeouts]
    request_s = 5.0                 # Lazy Pirate reply timeout
    retries = 3                     # resends before giving up
    heartbeat_s = 1.0
    liveness = 3

    [security]                      # CURVE for tcp endpoints
    allow_plaintext_loopback = false
    allow_wildcard_bind = false     # a tcp stage binds exactly its endpoint's address; true allows tcp://*:PORT
    server_key = "keys/server.key_secret"   # key pair of stages this file binds on tcp
    client_key = "keys/client.key_secret"   # key pair used to reach tcp stages
    allowed_clients = ["keys/client.key"]   # public keys a tcp stage accepts
    [security.servers]                      # public key of each remote stage
    vae = "keys/vae.key"

    [stage.executor]                # per-stage settings: every key typed and bounded in stages/settings.py
    policy = "auto"                 # or "on-demand", "prefetch2+dual_core", "resident+prefetch" (models/policy.py)
    resident_mb = 2048              # budget for resident contexts

Every problem (an unknown key, a wrong type, a value out of range or not among the choices) is a ConfigError naming
the file and the key; the stages and the orchestrator exit 2 on it before loading anything.
"""

from __future__ import annotations

import dataclasses
import os
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from pathlib import Path
from typing import Any

from protocol.messages import HEARTBEAT_INTERVAL_S, LIVENESS
from protocol.sockets import (REQUEST_RETRIES, REQUEST_TIMEOUT_S, CurveClient, CurveServer, EndpointError,
                              check_bind, check_security, ipc_path, parse_endpoint, read_keypair)
from stages.settings import STAGE_SETTINGS, ConfigError, check_stage_table  # noqa: F401 - the settings live there

STAGES = ("encoder", "scheduler", "executor", "vae")
ENDPOINT_NAMES = STAGES + ("events",)
LOG_LEVELS = ("debug", "info", "warning", "error")
JOBS_DIR = "jobs"                                  # RUN/jobs: the job folders (orchestrator.runfolder, the VAE)
_TOP_KEYS = {"run_dir", "pack_dir", "packs", "models_dir", "backend", "threads", "log_level", "endpoints", "timeouts",
             "security", "stage"}
_SECURITY_KEYS = {"allow_plaintext_loopback", "allow_wildcard_bind", "server_key", "client_key", "allowed_clients",
                  "servers"}


@dataclasses.dataclass(frozen=True)
class Timeouts:
    request_s: float = REQUEST_TIMEOUT_S
    retries: int = REQUEST_RETRIES
    heartbeat_s: float = HEARTBEAT_INTERVAL_S
    liveness: int = LIVENESS


@dataclasses.dataclass(frozen=True)
class Security:
    allow_plaintext_loopback: bool = False
    allow_wildcard_bind: bool = False
    server_key: Path | None = None
    client_key: Path | None = None
    allowed_clients: tuple[Path, ...] = ()
    servers: dict[str, Path] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    path: Path
    run_dir: Path
    pack_dir: Path | None
    models_dir: Path | None
    backend: str
    threads: int
    log_level: str
    endpoints: dict[str, str]
    timeouts: Timeouts
    security: Security
    stage: dict[str, dict[str, Any]]
    packs: tuple[Path, ...] = ()        # every model pack, the default (pack_dir) first; one per image size

    @property
    def jobs_dir(self) -> Path:
        """RUN/jobs: one folder per job (job.json, contexts, states, image.png, report.json)."""
        return self.run_dir / JOBS_DIR

    def endpoint(self, name: str) -> str:
        return self.endpoints[name]

    def stage_settings(self, name: str) -> dict[str, Any]:
        """The checked `[stage.NAME]` table, with STAGE_SETTINGS' defaults for the keys it does not set."""
        defaults = {k: s.default for k, s in STAGE_SETTINGS[name].items() if s.default is not None}
        return defaults | self.stage.get(name, {})

    def is_remote(self, name: str) -> bool:
        return parse_endpoint(self.endpoints[name])[0] == "tcp"

    def curve_server(self) -> CurveServer | None:
        """Keys for binding a tcp endpoint (None when no server key is configured)."""
        sec = self.security
        if sec.server_key is None:
            return None
        w = f"{self.path}: security."
        public, secret = _keypair(sec.server_key, f"{w}server_key", need_secret=True)
        allowed = frozenset(_keypair(p, f"{w}allowed_clients[{i}]")[0] for i, p in enumerate(sec.allowed_clients))
        if not allowed:
            raise ConfigError(f"{self.path}: security.allowed_clients is empty: no client could connect")
        return CurveServer(public, secret, allowed)

    def check_listener(self, name: str) -> None:
        """ConfigError, before anything binds, when stage `name` could not listen safely on its endpoint: tcp needs
        CURVE keys (or plaintext allowed, loopback only) and one named address unless a wildcard is allowed."""
        if not self.is_remote(name):
            return
        curve = self.curve_server()
        endpoint, sec = self.endpoints[name], self.security
        try:
            check_security(endpoint, curve, sec.allow_plaintext_loopback)
            check_bind(endpoint, sec.allow_wildcard_bind)
        except EndpointError as e:
            hint = "" if curve is not None else " (set security.server_key and security.allowed_clients)"
            raise ConfigError(f"{self.path}: endpoints.{name}: {e}{hint}") from None

    def curve_client(self, name: str) -> CurveClient | None:
        """Keys for reaching stage `name` over tcp (None when it is local or no keys are configured)."""
        sec = self.security
        if not self.is_remote(name) or (sec.client_key is None and name not in sec.servers):
            return None
        if sec.client_key is None:
            raise ConfigError(f"{self.path}: security.client_key is needed to reach {name} over tcp")
        if name not in sec.servers:
            raise ConfigError(f"{self.path}: security.servers.{name} (the stage's public key) is missing")
        w = f"{self.path}: security."
        public, secret = _keypair(sec.client_key, f"{w}client_key", need_secret=True)
        return CurveClient(public, secret, _keypair(sec.servers[name], f"{w}servers.{name}")[0])


def _keypair(path: Path, key: str, need_secret: bool = False) -> tuple[bytes, bytes | None]:
    try:
        public, secret = read_keypair(path)
    except EndpointError as e:
        raise ConfigError(f"{key}: {e}") from None
    if need_secret and secret is None:
        raise ConfigError(f"{key}: {path} holds no secret key (use the .key_secret file)")
    return public, secret


def _get(table: dict, key: str, kind: type | tuple, where: str, default: Any = None) -> Any:
    if key not in table:
        return default
    value, kinds = table[key], (kind if isinstance(kind, tuple) else (kind,))
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise ConfigError(f"{where}{key}: expected {' or '.join(k.__name__ for k in kinds)}, "
                          f"got {type(value).__name__} ({value!r})")
    return value


def _path(base: Path, value: str | None) -> Path | None:
    if value is None:
        return None
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else (base / p).resolve()


def parse_config(data: dict[str, Any], path: Path) -> PipelineConfig:
    """Validate a decoded TOML document; ConfigError names the file and key."""
    w = f"{path}: "
    base = path.parent.resolve()
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{w}unknown key(s) {sorted(unknown)}; known: {sorted(_TOP_KEYS)}")
    run_dir = _path(base, _get(data, "run_dir", str, w, str(base)))
    backend = _get(data, "backend", str, w, "onnx")
    from models.backends import backend_names       # the executor's backends live there ("rknn-sim" is one)
    if backend not in backend_names():
        raise ConfigError(f"{w}backend: {backend!r:.80} is not one of {', '.join(backend_names())}")
    threads = _get(data, "threads", int, w, os.cpu_count() or 1)
    if not 1 <= threads <= 256:
        raise ConfigError(f"{w}threads: {threads} is out of range [1, 256]")
    log_level = _get(data, "log_level", str, w, "info").lower()
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"{w}log_level: {log_level!r} is not one of {', '.join(LOG_LEVELS)}")

    eps = _get(data, "endpoints", dict, w, {})
    unknown = set(eps) - set(ENDPOINT_NAMES)
    if unknown:
        raise ConfigError(f"{w}endpoints: unknown stage(s) {sorted(unknown)}; known: {', '.join(ENDPOINT_NAMES)}")
    endpoints = {}
    for name in ENDPOINT_NAMES:
        value = _get(eps, name, str, f"{w}endpoints.")
        try:
            if value is None:
                value = f"ipc://{ipc_path(run_dir, name)}"
            parse_endpoint(value)
        except EndpointError as e:
            raise ConfigError(f"{w}endpoints.{name}: {e}") from None
        endpoints[name] = value

    t = _get(data, "timeouts", dict, w, {})
    unknown = set(t) - {f.name for f in dataclasses.fields(Timeouts)}
    if unknown:
        raise ConfigError(f"{w}timeouts: unknown key(s) {sorted(unknown)}")
    timeouts = Timeouts(
        request_s=float(_get(t, "request_s", (int, float), f"{w}timeouts.", REQUEST_TIMEOUT_S)),
        retries=_get(t, "retries", int, f"{w}timeouts.", REQUEST_RETRIES),
        heartbeat_s=float(_get(t, "heartbeat_s", (int, float), f"{w}timeouts.", HEARTBEAT_INTERVAL_S)),
        liveness=_get(t, "liveness", int, f"{w}timeouts.", LIVENESS))
    if not 0.01 <= timeouts.request_s <= 3600:
        raise ConfigError(f"{w}timeouts.request_s: {timeouts.request_s} is out of range [0.01, 3600]")
    if not 0 <= timeouts.retries <= 100:
        raise ConfigError(f"{w}timeouts.retries: {timeouts.retries} is out of range [0, 100]")
    if not 0.05 <= timeouts.heartbeat_s <= 60 or not 1 <= timeouts.liveness <= 100:
        raise ConfigError(f"{w}timeouts: heartbeat_s must be in [0.05, 60] and liveness in [1, 100]")

    s = _get(data, "security", dict, w, {})
    unknown = set(s) - _SECURITY_KEYS
    if unknown:
        raise ConfigError(f"{w}security: unknown key(s) {sorted(unknown)}; known: {sorted(_SECURITY_KEYS)}")
    sw = f"{w}security."
    allowed = _get(s, "allowed_clients", list, sw, [])
    for i, item in enumerate(allowed):
        if not isinstance(item, str):
            raise ConfigError(f"{sw}allowed_clients[{i}]: expected a key file path, got {type(item).__name__}")
    servers = _get(s, "servers", dict, sw, {})
    for name, item in servers.items():
        if name not in STAGES or not isinstance(item, str):
            raise ConfigError(f"{sw}servers.{name}: expected a stage name ({', '.join(STAGES)}) = key file path")
    security = Security(
        allow_plaintext_loopback=_get(s, "allow_plaintext_loopback", bool, sw, False),
        allow_wildcard_bind=_get(s, "allow_wildcard_bind", bool, sw, False),
        server_key=_path(base, _get(s, "server_key", str, sw)),
        client_key=_path(base, _get(s, "client_key", str, sw)),
        allowed_clients=tuple(_path(base, p) for p in allowed),
        servers={k: _path(base, v) for k, v in servers.items()})

    stage = {name: check_stage_table(name, table, w, backend)
             for name, table in _get(data, "stage", dict, w, {}).items()}
    pack_dir = _path(base, _get(data, "pack_dir", str, w))
    more = _get(data, "packs", list, w, [])
    for i, item in enumerate(more):
        if not isinstance(item, str):
            raise ConfigError(f"{w}packs[{i}]: expected a pack folder path, got {type(item).__name__}")
    packs = tuple(dict.fromkeys(p for p in [pack_dir] + [_path(base, p) for p in more] if p is not None))
    return PipelineConfig(
        path=path, run_dir=run_dir, pack_dir=packs[0] if packs else None,
        models_dir=_path(base, _get(data, "models_dir", str, w)), backend=backend, threads=threads,
        log_level=log_level, endpoints=endpoints, timeouts=timeouts, security=security, stage=stage, packs=packs)


def load_config(path: str | os.PathLike) -> PipelineConfig:
    """Read and validate a pipeline config file; ConfigError (naming file and key) on any problem."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    return parse_config(data, path)

