"""The run folder: where sockets, logs, jobs and configs live (0700), and rendering supervisord.conf for it."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from models.base.durable import atomic_write
from models.setup.models_dir import LORAS_DIR
from models.base.install import REPO_DIR, SOURCE_TREE, default_run_dir, project_file
from protocol.security import ipc_path
from stages.config import JOBS_DIR, STAGES

# A source checkout's top-level supervisord.conf (also the ready-made config for its default run folder), or, in an
# installed copy (`pip install '.[board]'`), the wheel's (models/base/install.py)
TEMPLATE = project_file("supervisord.conf")
EXAMPLE_PROMPT = project_file("examples/prompt.json")      # init copies it into the run folder
RUN_ENV = "ANIMA_RUN"
STAGE_PROGRAMS = STAGES                            # a supervisord program each
# supervisord.conf autostarts the others; these the job flow starts for their part of a job and stops before denoising
ON_DEMAND_STAGES = ("encoder", "vae")
ALWAYS_ON_STAGES = tuple(s for s in STAGES if s not in ON_DEMAND_STAGES)     # scheduler, executor
PROGRAMS = STAGE_PROGRAMS + ("orchestrator", "http")
MAX_IPC_PATH = 100                                 # unix socket paths must stay below ~107 bytes


@dataclass(frozen=True)
class RunFolder:
    root: Path

    @classmethod
    def resolve(cls, run: str | os.PathLike | None = None) -> "RunFolder":
        """--run, else $ANIMA_RUN, else a source checkout's run/, else run/ in the current folder."""
        return cls(Path(run or os.environ.get(RUN_ENV) or default_run_dir()).expanduser().resolve())

    @property
    def jobs(self) -> Path:
        return self.root / JOBS_DIR

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def supervisor_sock(self) -> Path:
        return self.root / "supervisor.sock"

    @property
    def daemon_sock(self) -> Path:
        return Path(ipc_path(self.root, "orchestrator"))

    @property
    def daemon_endpoint(self) -> str:
        return f"ipc://{self.daemon_sock}"

    @property
    def http_json(self) -> Path:
        """Where the HTTP front says where it listens ({"url", "host", "port", "pid"}), once it does."""
        return self.root / "http.json"

    @property
    def pipeline_toml(self) -> Path:
        return self.root / "pipeline.toml"

    @property
    def supervisord_conf(self) -> Path:
        """The rendered copy in the run folder when there is one, else the top-level file (default run folder)."""
        own = self.root / "supervisord.conf"
        return own if own.exists() or not SOURCE_TREE or self.root != (REPO_DIR / "run").resolve() else TEMPLATE

    def check(self) -> None:
        """The run folder must be private (0700) and short enough for its ipc:// socket paths."""
        if len(str(self.supervisor_sock)) > MAX_IPC_PATH:
            raise ValueError(f"run folder {self.root} is too long for unix sockets "
                             f"({len(str(self.supervisor_sock))} > {MAX_IPC_PATH} characters); choose a shorter path")
        if self.root.exists():
            mode = self.root.stat().st_mode & 0o777
            if mode & 0o077:
                raise ValueError(f"run folder {self.root} has mode {mode:04o}; it must be 0700 "
                                 f"(chmod 700 {self.root})")


def _escape(path) -> str:
    return str(path).replace("%", "%%")        # supervisord treats % as an expansion


def render_supervisord_conf(template: str, run_dir: Path, *, repo_dir: Path | None = None,
                            python: str | None = None) -> str:
    """The top-level config with the run folder, the repo and the interpreter substituted by absolute paths. The
    programs' working directory (`directory=`) is a checkout's top folder, or, for an installed copy, the run
    folder (never site-packages)."""
    repo_dir = repo_dir or (REPO_DIR if SOURCE_TREE else run_dir)
    text = template.replace("%(here)s/run", _escape(run_dir))
    text = text.replace("%(here)s/.venv/bin/python", _escape(python or sys.executable))
    return text.replace("%(here)s", _escape(repo_dir))


def missing_modules(conf_text: str) -> list[str]:
    """The `python -m MODULE` of each program in a rendered supervisord.conf that this installation does not have: a
    run folder rendered by a version whose modules were laid out otherwise, whose program would fail at every start."""
    missing = []
    for name in re.findall(r"^command=.*?\s-m\s+([\w.]+)", conf_text, re.M):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


PIPELINE_TEMPLATE = """\
# The pipeline config every process reads (stages/config.py has the full schema). Written by `orchestrator init`.
run_dir = "."
{pack}{packs}{models}
{tables}[stage.orchestrator]
# max_queue = 16            # queued + running jobs
# stage_retries = 3         # restarts of one stage absorbed per job before the job fails
# start_timeout_s = 120     # supervisord start + READY
# denoise_timeout_s = 21600
# hang_timeout_s = 120      # a scheduler/executor silent this long is restarted through supervisord (0: never)

[stage.http]
# host = "127.0.0.1"        # the HTTP front (ComfyUI and A1111 APIs, the web page); loopback unless a token is set
# port = 8188
# token_file = "http.token" # needed to listen on any other address: clients send Authorization: Bearer <token>
# max_uploads_mb = 2048     # RUN/input, temp and output together (0: no limit); orchestrator prune --older-than
"""


def toml_str(value) -> str:
    """A TOML basic string (json's escapes are TOML's for every character a path holds)."""
    import json
    return json.dumps(str(value), ensure_ascii=False)


def bundle_stage_tables(bundle, stages: tuple[str, ...] = ("encoder", "vae")) -> str:
    """The [stage.encoder] and [stage.vae] tables of a checked models.setup.bundle.Bundle (those of `stages`): its encoder
    pack on ONNX Runtime, its VAE packs (one per image size) on its backend."""
    vae = ", ".join(toml_str(v) for _, v in bundle.sizes.values())
    tables = {"encoder": f"[stage.encoder]\nbackend = \"onnx\"\npack = {toml_str(bundle.encoder)}\n\n",
              "vae": f"[stage.vae]\nbackend = {toml_str(bundle.backend)}\n"
                     f"vae_pack = [{vae}]     # one per image size\n\n"}
    return "".join(tables[s] for s in stages)


def pipeline_toml_text(pack_dirs=(), models_dir: Path | None = None, bundle=None) -> str:
    """pipeline.toml naming the packs (the first is the default: `pack_dir`; more go to `packs`) and models; or,
    for a checked models.setup.bundle.Bundle, everything it holds: its executor backend (a top-level key), the DiT pack of
    each size, the encoder pack and the VAE packs, every path absolute."""
    if bundle is not None:
        pack_dirs = [dit for dit, _ in bundle.sizes.values()]
    dirs = [toml_str(Path(p).resolve()) for p in pack_dirs]
    pack = f'pack_dir = {dirs[0]}\n' if dirs else '# pack_dir = "…"\n'
    packs = "packs = [" + ", ".join(dirs[1:]) + "]\n" if len(dirs) > 1 else ""
    models = f'models_dir = {toml_str(Path(models_dir).resolve())}\n' if models_dir else '# models_dir = "…"\n'
    tables = ""
    if bundle is not None and models_dir:
        models = models.rstrip("\n") + f"     # LoRAs: {LORA_FILES} (the bundle's packs need nothing else here)\n"
    if bundle is not None:
        # quoted as TOML strings: a folder's name may hold a newline, and a comment must stay one line
        toolkit = f", rknn-toolkit2 {toml_str(bundle.toolkit)}" if bundle.toolkit else ""
        pack = (f"# from the bundle {toml_str(bundle.dir)} (target {toml_str(bundle.target)}{toolkit})\n"
                f"backend = {toml_str(bundle.backend)}     # the executor's model backend (a top-level key)\n"
                + pack)
        tables = bundle_stage_tables(bundle) + "[stage.executor]\n# policy = \"auto\"         # models/board/policy.py\n\n"
    return PIPELINE_TEMPLATE.format(pack=pack, packs=packs, models=models, tables=tables)


def check_init_inputs(pack_dirs, models_dir) -> None:
    """ValueError naming the flag and the fix for what `init` is given: every --pack a model pack folder (not a
    misspelt path, not the checkpoint file it is made from), one per size; --models a folder."""
    from orchestrator.engine.packs import read_packs
    for d in pack_dirs:
        p = Path(d).expanduser()
        if p.is_file():
            how = " (a checkpoint: make a pack from it with `anima-models pack`)" if p.suffix == ".safetensors" else ""
            raise ValueError(f"--pack {d}: a file, not a model pack folder{how}")
        if not p.exists():
            raise ValueError(f"--pack {d}: no such folder")
    if pack_dirs:
        read_packs(pack_dirs)
    if models_dir is not None and not Path(models_dir).expanduser().is_dir():
        raise ValueError(f"--models {models_dir}: no such folder")


def init_run(run: str | os.PathLike | None = None, *, python: str | None = None, template: Path = TEMPLATE,
             pack_dir: Path | None = None, packs=(), models_dir: Path | None = None, force: bool = False,
             bundle=None, changes: list | None = None) -> RunFolder:
    """Create the run folder (0700) with logs/ and jobs/, its supervisord.conf, pipeline.toml (both kept when
    present, unless `force`) and an example prompt.json. `pack_dir` and `packs`: the model packs, the default first,
    or a checked models.setup.bundle.Bundle; a bad pack or models folder, or two packs of one size, are refused
    (ValueError) before anything is written. `changes` gets one line per file: written, kept as it was, or replaced
    (with `force`; the file it replaces is kept beside it, and the line names the settings that differ)."""
    pack_dirs = ([pack_dir] if pack_dir else []) + list(packs or ())
    check_init_inputs(pack_dirs, models_dir)
    rf = RunFolder.resolve(run)
    for d in (rf.root, rf.logs, rf.jobs):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(rf.root, 0o700)
    rf.check()
    said = changes if changes is not None else []
    if bundle is not None:
        models_dir = _bundle_models_dir(rf, models_dir, said)
    files = {rf.root / "supervisord.conf": lambda: render_supervisord_conf(template.read_text(), rf.root,
                                                                           python=python),
             rf.pipeline_toml: lambda: pipeline_toml_text(pack_dirs, models_dir, bundle)}
    for path, text in files.items():
        said.append(_write_config(path, text(), force))
    example = rf.root / "prompt.json"            # the user's own once written: never replaced
    if EXAMPLE_PROMPT.is_file() and not example.exists():
        atomic_write(example, EXAMPLE_PROMPT.read_text())
        said.append(f"wrote {example} (an example to submit)")
    return rf


LORA_FILES = "their .safetensors files go in MODELS_DIR/loras/"


def _bundle_models_dir(rf: RunFolder, models_dir, said: list) -> Path:
    """A bundle run folder's models folder, for LoRAs: the one given, else the run folder's models/; its loras/
    folder is made, so that a LoRA dropped there is a LoRA a job can name without editing pipeline.toml."""
    models = Path(models_dir).expanduser().resolve() if models_dir else rf.root / "models"
    loras = models / LORAS_DIR
    if not loras.is_dir():
        loras.mkdir(parents=True, exist_ok=True, mode=0o700)
        said.append(f"made {loras} (LoRAs for jobs: put .safetensors files here; models_dir in pipeline.toml)")
    return models


KEPT_SUFFIX = ".before-init"


def _write_config(path: Path, text: str, force: bool) -> str:
    """Write one config file of the run folder; -> what happened, in words. An existing file is the user's: kept
    unless `force`, and then kept beside the new one (PATH.before-init), naming the settings that differ."""
    if not path.exists():
        atomic_write(path, text)
        return f"wrote {path}"
    old = path.read_text(errors="replace")
    if old == text:
        return f"kept {path} (already as init writes it)"
    if not force:
        return f"kept {path} as it is (yours; --force writes it again and keeps this one as {path.name}{KEPT_SUFFIX})"
    atomic_write(path.with_name(path.name + KEPT_SUFFIX), old)
    atomic_write(path, text)
    differ = _differing_settings(old, text) if path.suffix == ".toml" else []
    what = f": {', '.join(differ[:8])}{' ...' if len(differ) > 8 else ''} differ" if differ else ""
    return f"replaced {path}; the previous one is {path.name}{KEPT_SUFFIX}{what}"


def _differing_settings(old: str, new: str) -> list[str]:
    """The dotted keys whose values differ between two TOML texts (either side unparsable: nothing to name)."""
    try:
        import tomllib
    except ImportError:                                    # Python 3.10
        import tomli as tomllib
    try:
        a, b = tomllib.loads(old), tomllib.loads(new)
    except (ValueError, TypeError):
        return []

    def flat(d, pre=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{pre}{k}.") if isinstance(v, dict) else {f"{pre}{k}": v})
        return out
    fa, fb = flat(a), flat(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))
