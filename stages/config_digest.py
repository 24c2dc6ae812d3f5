"""What configuration a running stage took at its start, so that an edit of pipeline.toml it has not seen is found
before a job depends on it (the orchestrator, restarted on the new file, would otherwise queue a job that fails
halfway on a scheduler or executor still running the old settings).

    RUN/stages/NAME.config.json   {"pid": PID, "digest": SHA256, "settings": {dotted key: value}}

A stage's effective configuration is the file's top-level settings (packs, models folder, backend, threads,
endpoints, timeouts, security) and its own `[stage.NAME]` table (the job daemon's also `[stage.vae]`: ALSO_READS),
with every default filled in and paths resolved:
a comment, another stage's table or the log level changes nothing it computes with.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import msgspec

from models.base.durable import atomic_write

log = logging.getLogger(__name__)

RECORD_DIR = "stages"
IGNORED = ("path", "stage", "log_level")      # not settings a stage computes with (its own table is added below)
MAX_RECORD_BYTES = 1 << 20
# which settings a record holds (effective_settings' rule): a stage started by code with another rule recorded other
# keys, and comparing them would call every stage stale after an upgrade; such a record tells nothing either way
RULE = 2


# the programs a stage serves or calls: another program's endpoint or server key is nothing it computes with (a remote
# VAE added to the file must not ask for a scheduler restart)
CALLS = {"scheduler": ("executor",), "executor": (), "encoder": (), "vae": ()}
SERVES_ALSO = ("events",)
# another program's table a program computes with: the job daemon refuses a size the VAE's packs cannot decode
ALSO_READS = {"orchestrator": ("vae",)}


def _concerns(stage: str, key: str, settings: dict) -> bool:
    if stage not in CALLS:
        return True
    peers = (stage, *CALLS[stage], *SERVES_ALSO)
    parts = key.split(".")
    if parts[0] == "endpoints" and len(parts) > 1:
        return parts[1] in peers
    if parts[:2] == ["security", "servers"]:
        return len(parts) > 2 and parts[2] in peers
    if key == "security.client_key":        # used only to call a peer that has a server key
        return any(f"security.servers.{p}" in settings for p in CALLS[stage])
    return True


def effective_settings(config, stage: str) -> dict:
    """{dotted key: value} of what `stage` runs with under `config` (a stages.config.PipelineConfig): the other
    programs' endpoints and keys left out (CALLS)."""
    top = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in IGNORED}
    for table in (stage, *ALSO_READS.get(stage, ())):
        top[f"stage.{table}"] = config.stage.get(table)
    plain = json.loads(json.dumps(msgspec.to_builtins(top, enc_hook=str), sort_keys=True, default=str))
    out: dict = {}

    def flat(value, key: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                flat(v, f"{key}.{k}" if key else k)
        else:
            out[key] = value
    flat(plain, "")
    return {k: v for k, v in out.items() if _concerns(stage, k, out)}


def digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def record_path(config, stage: str) -> Path:
    return Path(config.run_dir) / RECORD_DIR / f"{stage}.config.json"


def record_start(config, stage: str) -> None:
    """Say, for this process, which configuration `stage` took (called once the stage is set up)."""
    settings = effective_settings(config, stage)
    path = record_path(config, stage)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(path, json.dumps({"pid": os.getpid(), "rule": RULE, "digest": digest(settings),
                                       "settings": settings}))
    except OSError as e:              # the check it feeds is then skipped for this stage; the stage itself runs
        log.warning("%s: could not record its configuration in %s: %s", stage, path, e)


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_settings(config, stage: str) -> list:
    """The dotted keys in which the running `stage` (the process that recorded its start) runs with other values
    than `config` says; [] when they agree, or nothing is known (no record, its process gone: a stage started
    again reads the file as it is now)."""
    path = record_path(config, stage)
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return []
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(rec, dict) or rec.get("rule") != RULE or not _alive(rec.get("pid")):
        return []
    now = effective_settings(config, stage)
    if rec.get("digest") == digest(now):
        return []
    then = rec.get("settings") if isinstance(rec.get("settings"), dict) else {}
    return sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k)) or ["(unknown)"]


def stale_stages_message(config, stages) -> str:
    """'' when every stage in `stages` runs with what `config` says; else which to restart and why."""
    stale = {s: keys for s in stages if (keys := stale_settings(config, s))}
    if not stale:
        return ""
    what = "; ".join(f"{s} ({', '.join(k[:80] for k in keys[:5])}{' ...' if len(keys) > 5 else ''})"
                     for s, keys in stale.items())
    return (f"{config.path} changed since these programs started, and they still run the old settings: {what}; "
            f"restart them first: orchestrator reload (it restarts {' and '.join(stale)})")
