"""Test support: the job daemon of a run folder served in this process, the CLI's requests answered by
`Daemon.handle` with no socket between (orchestrator.engine.daemon_client.DaemonClient.in_process: the same client and reply
reader as over the socket). The queue, the job store, the checks at submit and prune's batches are the daemon's own
code; only the stages are absent, so no job runs. Tests drive `orchestrator submit|status|cancel|resume|prune`
with it without starting a pipeline:

    with InprocClient.open(rf) as client:
        cli.main(["--run", str(rf.root), "prune", "--keep", "1"], connect=client.connect)
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from orchestrator.terminal.cli import cli_error
from orchestrator.engine.daemon import Daemon
from orchestrator.engine.daemon_client import DaemonClient
from orchestrator.http.png_formats import PNG_FORMATS
from orchestrator.engine.runfolder import RunFolder


class InprocClient:
    """Requests to a `Daemon` in this process (its sockets never opened: `Daemon.open` is not called)."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.client = DaemonClient.in_process(daemon, errors=cli_error)     # failures as the CLI's own

    @classmethod
    def open(cls, rf: RunFolder, config_path: Path | None = None) -> InprocClient:
        """The daemon of run folder `rf` on its pipeline.toml (or `config_path`), its queue as the folder has it."""
        from stages.config import load_config
        daemon = Daemon(load_config(config_path or rf.pipeline_toml), rf, png_formats=PNG_FORMATS)
        daemon.store.recover()                 # as Daemon.open does: torn writes cleaned, a running job kept
        return cls(daemon)

    def connect(self, rf: RunFolder) -> InprocClient:
        """cli.main's `connect`: every command of that run gets this client (and its one daemon)."""
        if Path(rf.root).resolve() != Path(self.daemon.rf.root).resolve():
            raise ValueError(f"this in-process daemon serves {self.daemon.rf.root}, not {rf.root}")
        return self

    def call(self, msg, expect_cls):
        return self.client.call(msg, expect_cls)

    def close(self):
        """Each command closes its client; the daemon stays for the next one (shut() ends it)."""

    def shut(self):
        """The daemon ends (its LoRA workers, its zmq context); once, however often it is called."""
        if not self.daemon.ctx.closed:
            self.daemon.close()
            self.daemon.ctx.term()

    def __enter__(self) -> InprocClient:
        return self

    def __exit__(self, *exc):
        self.shut()


@contextlib.contextmanager
def daemon_with_loras(root: Path, pipeline_assets: tuple, write_loras):
    """A daemon (not opened: its handlers called directly) on a run folder under `root` over a copy of the tiny
    models folder whose loras/ `write_loras(loras_dir)` fills, and pipeline_assets' pack. -> (daemon, root)."""
    from stages.config import load_config
    from orchestrator.engine.runfolder import init_run
    from tests.pipeline_harness import pipeline_toml
    models = root / "models"
    shutil.copytree(pipeline_assets[0], models)
    (models / "loras").mkdir()
    write_loras(models / "loras")
    rf = init_run(root / "run")
    rf.pipeline_toml.write_text(pipeline_toml(pipeline_assets[1], models))
    d = Daemon(load_config(rf.pipeline_toml), rf)
    try:
        yield d, root
    finally:
        d.close()
        d.ctx.term()
