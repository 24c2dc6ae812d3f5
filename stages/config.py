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
    policy = "auto"                 # or "on-demand", "prefetch2+dual_core", "resident+prefetch" (models/board/policy.py)
    resident_mb = 2048              # budget for resident contexts

Every problem (an unknown key, a wrong type, a value out of range or not among the choices) is a ConfigError naming
the file and the key; the stages and the orchestrator exit 2 on it before loading anything.
"""

import os
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.base.schema import SchemaError
from protocol.sockets import (CurveClient, CurveServer, EndpointError, check_bind, check_security, ipc_path,
                              parse_endpoint, read_keypair)
from stages.settings import (ENDPOINT_NAMES, STAGE_TABLES, STAGES, ConfigError, PipelineFile,  # noqa: F401
                             Security, Table, Timeouts, check_stage_table)

JOBS_DIR = "jobs"                                  # RUN/jobs: the job folders (orchestrator.engine.runfolder, the VAE)


@dataclass(frozen=True)
class PipelineConfig:
    """A checked config file with its paths resolved (absolute) and every endpoint and `[stage.NAME]` record."""

    path: Path
    run_dir: Path
    pack_dir: Path | None
    models_dir: Path | None
    backend: str
    threads: int
    log_level: str
    endpoints: dict[str, str]
    timeouts: Timeouts
    security: Security                  # key file names absolute
    stage: dict[str, Table]             # every STAGE_TABLES name -> its record (defaults when the file has none)
    packs: tuple[Path, ...] = ()        # every model pack, the default (pack_dir) first; one per image size

    @property
    def jobs_dir(self) -> Path:
        """RUN/jobs: one folder per job (job.json, contexts, states, image.png, report.json)."""
        return self.run_dir / JOBS_DIR

    def endpoint(self, name: str) -> str:
        return self.endpoints[name]

    def settings(self, name: str) -> Table:
        """The `[stage.NAME]` record (OrchestratorSettings for "orchestrator", ...)."""
        return self.stage[name]

    def stage_settings(self, name: str) -> dict[str, Any]:
        """The checked `[stage.NAME]` table as plain data, with its record's defaults for the keys it does not set."""
        return self.stage[name].given()

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


def _keypair(path: str, key: str, need_secret: bool = False) -> tuple[bytes, bytes | None]:
    try:
        public, secret = read_keypair(path)
    except EndpointError as e:
        raise ConfigError(f"{key}: {e}") from None
    if need_secret and secret is None:
        raise ConfigError(f"{key}: {path} holds no secret key (use the .key_secret file)")
    return public, secret


def _path(base: Path, value: str | None) -> Path | None:
    if value is None:
        return None
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else (base / p).resolve()


def parse_config(data: dict[str, Any], path: Path) -> PipelineConfig:
    """Validate a decoded TOML document against PipelineFile (stages/settings.py); ConfigError names the file and
    key."""
    w = f"{path}: "
    base = path.parent.resolve()
    try:
        f = PipelineFile.from_data(data)
    except SchemaError as e:
        raise ConfigError(f"{w}{e}") from None
    run_dir = _path(base, f.run_dir or str(base))
    endpoints = {}
    for name in ENDPOINT_NAMES:
        value = getattr(f.endpoints, name)
        try:
            if value is None:
                value = f"ipc://{ipc_path(run_dir, name)}"
            parse_endpoint(value)
        except EndpointError as e:
            raise ConfigError(f"{w}endpoints.{name}: {e}") from None
        endpoints[name] = value
    sec = f.security
    security = sec.replace(
        server_key=_str(_path(base, sec.server_key)), client_key=_str(_path(base, sec.client_key)),
        allowed_clients=[str(_path(base, p)) for p in sec.allowed_clients],
        servers={k: str(_path(base, v)) for k, v in sec.servers.items()})
    tables = {name: getattr(f.stage, name) for name in STAGE_TABLES}
    stage = {name: check_stage_table(name, table if table is not None else {}, w, f.backend)
             for name, table in tables.items()}
    executor = stage["executor"]
    if executor.board_cost is not None:                     # relative to this file; checked now, not at first use
        cost = str(_path(base, executor.board_cost))
        from models.board.cost import BoardModel, CostModelError
        try:
            BoardModel.for_pack(None, cost_path=cost)
        except CostModelError as e:
            raise ConfigError(f"{w}stage.executor.board_cost: {e}") from None
        stage["executor"] = executor.replace(board_cost=cost)
    pack_dir = _path(base, f.pack_dir)
    packs = tuple(dict.fromkeys(p for p in [pack_dir] + [_path(base, p) for p in f.packs] if p is not None))
    return PipelineConfig(
        path=path, run_dir=run_dir, pack_dir=packs[0] if packs else None,
        models_dir=_path(base, f.models_dir), backend=f.backend, threads=f.cpu_threads,
        log_level=f.log_level.lower(), endpoints=endpoints, timeouts=f.timeouts, security=security, stage=stage,
        packs=packs)


def _str(p: Path | None) -> str | None:
    return None if p is None else str(p)


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

