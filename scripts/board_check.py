"""The board's install, proven on this machine: the whole tiny job through supervisord from a venv without torch.

    scripts/board_check.sh                   (= make board-check; creates .venv-board, then runs the two steps below)
    .venv/bin/python scripts/board_check.py prepare --assets DIR          # host: bundle, DiT pack, encoder + VAE packs
    .venv-board/bin/python scripts/board_check.py run --assets DIR --venv .venv-board    # the board's side

`prepare` runs in the host venv (torch, onnx): the tiny models folder, its DiT pack, the encoder pack
(`anima-models export-encoder`) and the VAE's ONNX files. `run` runs in the board venv with PYTHONPATH unset and
outside the source tree, so every stage imports the installed package: `orchestrator init`, supervisord, the five
programs on the board venv's interpreter, encoder and VAE on ONNX Runtime. It checks that torch, transformers and
onnx are not importable there and never got loaded by a stage, that the job is done with a PNG, that supervisord
leaves nothing behind (processes, /dev/shm segments), and ends with exactly one line:

    board-check ok torch=absent job_s=<job wall seconds> venv_mb=<du of the board venv in MB>
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESOLUTION = (128, 128)        # 64 image tokens: the check is about the install, not the model's cost
PROMPT = {"prompt": "1girl, solo, (blue eyes:1.2), long hair, cherry blossoms", "negative_prompt": "lowres",
          "seed": 7, "steps": 3, "cfg": 4.0, "width": RESOLUTION[0], "height": RESOLUTION[1], "spectrum": False}
FORBIDDEN = ("torch", "transformers", "onnx")      # host-only packages: never importable on the board
JOB_TIMEOUT_S = 900


def say(text: str) -> None:
    print(text, flush=True)


# ---- host side ------------------------------------------------------------------------------------------------------
def prepare(assets: Path) -> dict:
    """Host venv: models folder, DiT pack, encoder pack, VAE ONNX files (each kept when already complete)."""
    from models.setup.models_dir import resolve_models, write_bundle
    from models.packs.pack import build_pack, load_pack
    from models.text.encoder_pack import EncoderPackError, build_encoder_pack, load_encoder_pack
    assets.mkdir(parents=True, exist_ok=True)
    models = assets / "models"
    write_bundle("tiny", 0, models)
    paths = resolve_models(models)
    pack = assets / f"pack-{RESOLUTION[0]}x{RESOLUTION[1]}"
    try:
        load_pack(pack, check=True)
    except Exception:
        build_pack(paths.dit, pack, RESOLUTION, "fp16", overwrite=True)
    encoder = assets / "encoder-pack"
    try:
        load_encoder_pack(encoder, check=True)
    except EncoderPackError:
        build_encoder_pack(paths.text_encoder, paths.dit, paths.qwen_tokenizer, paths.t5_tokenizer, encoder,
                           overwrite=True)
    vae = prepare_vae(assets, paths.vae)
    out = {"models": str(models), "pack": str(pack), "encoder_pack": str(encoder), "vae": vae}
    (assets / "assets.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def prepare_vae(assets: Path, vae_file: Path) -> dict:
    """The VAE stage's settings for ONNX Runtime and the files they name -> {"settings": {...}} or {"missing": why}."""
    import importlib.util
    if importlib.util.find_spec("models.commands.pack_vae") is None:
        return {"missing": "this tree has no `anima-models pack-vae` (the VAE's ONNX backend, issue 10 item 1)"}
    from models.commands.cli import main as anima_models
    out = assets / "vae-pack"
    if not (out / "manifest.json").is_file():
        rc = anima_models(["pack-vae", str(vae_file), "--out", str(out),
                           "--resolution", f"{RESOLUTION[0]}x{RESOLUTION[1]}"])
        if rc != 0:
            raise SystemExit(f"board-check: anima-models pack-vae failed ({rc})")
    return {"settings": {"backend": "onnx", "vae_pack": str(out)}}


# ---- board side -----------------------------------------------------------------------------------------------------
def forbidden_importable() -> list:
    import importlib.util
    return [m for m in FORBIDDEN if importlib.util.find_spec(m) is not None]


def du_mb(path: Path) -> int:
    out = subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def toml_value(v) -> str:
    return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


def on_board_venv(name: str, pid: int, py: Path, venv: Path) -> list:
    """Problems unless the process runs the board venv's interpreter (its base binary; the command line is the
    stage's title by now) and loads its packages from that venv's lib folder."""
    try:
        exe = os.path.realpath(f"/proc/{pid}/exe")
        time.sleep(0.5)                              # let it import its modules
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []                                     # gone already (the encoder stops before denoising)
    out = [] if exe == os.path.realpath(py) else [f"{name} runs {exe}, not {os.path.realpath(py)}"]
    if str(venv.resolve() / "lib") not in maps:
        out.append(f"{name} (pid {pid}) maps nothing from {venv.resolve() / 'lib'}")
    return out


def ran_on_board_venv(name: str, rf, py: Path) -> list:
    """Problems unless the stage's log has a READY line naming the board venv's interpreter (stages.base logs
    `ready on ENDPOINT (pid N, python PATH)`); for a stage that came and went between two looks at supervisord."""
    text = (rf.logs / f"{name}.log").read_text(errors="replace") if (rf.logs / f"{name}.log").exists() else ""
    found = re.findall(r" ready on \S+ \(pid \d+, python (.+)\)$", text, flags=re.M)
    if not found:
        return [f"the {name} process was never seen (no READY line in its log)"]
    return [f"{name} ran {exe}, not {py}" for exe in found if os.path.abspath(exe) != os.path.abspath(py)]


def loaded_forbidden(pid: int) -> list:
    """Host-only libraries mapped into a live process (a stage that imported torch would map libtorch)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return sorted({m for m in ("libtorch", "/torch/", "/transformers/", "/onnx/") if m in maps})


def run(assets: Path, venv: Path) -> int:
    from orchestrator.engine.runfolder import RunFolder
    from orchestrator.engine.supervisor import Supervisor
    from protocol.arena import list_segments, run_prefix

    here = Path(__file__).resolve()
    if any(Path(p).resolve() == here.parents[1] for p in sys.path if p):
        raise SystemExit("board-check: the source tree is on sys.path; run from elsewhere with PYTHONPATH unset")
    import orchestrator
    if not Path(orchestrator.__file__).resolve().is_relative_to(venv.resolve()):
        raise SystemExit(f"board-check: orchestrator comes from {orchestrator.__file__}, not the board venv {venv}")
    bad = forbidden_importable()
    if bad:
        raise SystemExit(f"board-check: {', '.join(bad)} importable in {venv}: the board install must not have them")
    a = json.loads((assets / "assets.json").read_text())
    if "settings" not in a["vae"]:
        raise SystemExit(f"board-check: no VAE on ONNX Runtime: {a['vae']['missing']}")

    root = Path(tempfile.mkdtemp(prefix="anima-board-", dir="/tmp"))
    py = venv.resolve() / "bin" / "python"
    rc = subprocess.run([str(venv / "bin" / "orchestrator"), "--run", str(root), "init", "--python", str(py),
                         "--pack", a["pack"], "--models", a["models"]], capture_output=True, text=True)
    if rc.returncode != 0:
        raise SystemExit(f"board-check: orchestrator init failed: {rc.stderr.strip()}")
    rf = RunFolder.resolve(root)
    extra = {"encoder": {"backend": "onnx", "pack": a["encoder_pack"]}, "vae": a["vae"]["settings"]}
    text = rf.pipeline_toml.read_text().replace("\n[stage.orchestrator]\n", "\nthreads = 2\n[stage.orchestrator]\n", 1)
    text = text.replace("\n[stage.http]\n", "\n[stage.http]\nport = 0\n", 1)   # a free port: runs never clash
    for stage, settings in extra.items():
        text += f"\n[stage.{stage}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in settings.items())
    rf.pipeline_toml.write_text(text)
    prompt = root / "prompt.json"
    prompt.write_text(json.dumps({**PROMPT, "output": str(root / "out.png")}))

    sup_proc = subprocess.Popen([str(venv / "bin" / "supervisord"), "-n", "-c", str(rf.supervisord_conf)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    sup = Supervisor(rf.supervisor_sock)
    job_s, problems, seen = None, [], {}
    try:
        deadline = time.monotonic() + 120
        while not rf.daemon_sock.exists():
            if sup_proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"board-check: the pipeline did not come up\n{logs(rf)}")
            time.sleep(0.2)
        t0 = time.monotonic()
        job = subprocess.Popen([str(venv / "bin" / "orchestrator"), "--run", str(root), "submit", str(prompt),
                                "--wait", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while job.poll() is None:                   # watch every stage process while the job runs
            for name, info in sup.all_info().items():
                if info.pid and info.pid not in seen:
                    seen[info.pid] = name
                    problems += on_board_venv(name, info.pid, py, venv)
                for lib in loaded_forbidden(info.pid) if info.pid else ():
                    problems.append(f"{name} (pid {info.pid}) has {lib} mapped")
            if time.monotonic() - t0 > JOB_TIMEOUT_S:
                job.kill()
                raise SystemExit(f"board-check: the job took over {JOB_TIMEOUT_S} s\n{logs(rf)}")
            time.sleep(0.2)
        out, err = job.communicate()
        job_s = time.monotonic() - t0
        if job.returncode != 0:
            raise SystemExit(f"board-check: the job failed: {err.strip()[-2000:]}\n{logs(rf)}")
        result = json.loads(out.strip().splitlines()[-1])
        report = json.loads(Path(result["report"]).read_text())
        png = Path(result["image"])
        if not png.is_file() or png.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            problems.append(f"no PNG at {png}")
        for stage in ("encoder", "vae"):
            if stage not in seen.values():           # lived between two looks (the encoder is up ~1 s): its log
                problems += ran_on_board_venv(stage, rf, py)   # says which interpreter served
        enc_log = (rf.logs / "encoder.log").read_text(errors="replace")
        if "text encoder (onnx" not in enc_log:
            problems.append("the encoder log does not say it ran on ONNX Runtime")
    finally:
        try:
            sup.shutdown_in_order(60)
            sup_proc.wait(60)
        except Exception:
            os.killpg(sup_proc.pid, 9)
            sup_proc.wait(10)
        left = list_segments(run_prefix(root))
        log_text = logs(rf)
        if os.environ.get("BOARD_CHECK_KEEP") != "1":     # the logs were printed on failure; 1 keeps the folder
            shutil.rmtree(root, ignore_errors=True)
    if left:
        problems.append(f"/dev/shm segments left: {left}")
    if problems:
        say("board-check FAILED:\n  " + "\n  ".join(problems) + f"\n{log_text}")
        return 1
    say(f"job {result['job']}: {report.get('computed_steps', '?')} steps, PNG {png.name} "
        f"(encoder and VAE on ONNX Runtime; stage pids {sorted(seen)} all on {py})")
    say(f"board-check ok torch=absent job_s={job_s:.1f} venv_mb={du_mb(venv)}")
    return 0


def logs(rf, tail: int = 2500) -> str:
    parts = []
    for p in sorted(rf.logs.glob("*.log")):
        parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}")
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare", help="host venv: write the assets")
    p.add_argument("--assets", required=True, type=Path)
    r = sub.add_parser("run", help="board venv: the job through supervisord")
    r.add_argument("--assets", required=True, type=Path)
    r.add_argument("--venv", required=True, type=Path)
    args = ap.parse_args(argv)
    if args.step == "prepare":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the host side runs from the source tree
        import logging
        logging.basicConfig(level=logging.WARNING)
        out = prepare(args.assets.resolve())
        say(f"assets ready in {args.assets}: {', '.join(k for k in out)}")
        return 0
    return run(args.assets.resolve(), args.venv.absolute())


if __name__ == "__main__":
    sys.exit(main())
