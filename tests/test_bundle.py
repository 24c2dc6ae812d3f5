"""`anima-models bundle` -> `orchestrator init --bundle` on the tiny models folder: bundle.json against the files
it describes, a second run keeping every part, each way a copied bundle can be wrong refused naming the part, and
the pipeline.toml init writes read back as the stages read it."""
from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from models.setup.bundle import BUNDLE_JSON, BundleError, read_bundle
from models.commands.cli import main as models_main
from models.records.manifest import MANIFEST, file_sha256
from orchestrator.terminal import cli

SIZE = "128x128"


@pytest.fixture(scope="module")
def cpu_bundle(tiny_bundle) -> tuple:
    """(bundle folder, the first run's stderr) of `bundle --target none` at 128x128 on the session's tiny models: the
    run's one build of it (tests.pipeline_harness.cpu_bundle, which the board_stages fixture's pipelines run on
    too); read-only (copy_bundle)."""
    from tests.pipeline_harness import cpu_bundle
    return cpu_bundle(tiny_bundle, tiny_bundle.parent, (128, 128))


def copy_bundle(src: Path, dst: Path) -> Path:
    """A copy made of hard links (no 130 MB copied): a test changes a file by replacing it, never in place."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def replace_file(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def test_bundle_json_describes_its_files(cpu_bundle):
    out, err = cpu_bundle
    data = json.loads((out / BUNDLE_JSON).read_text())
    assert data["kind"] == "anima-bundle" and data["schema"] == 1
    assert data["target"] == "none" and data["toolkit"] is None
    assert list(data["sizes"]) == [SIZE]
    parts = {**{f"{k}": v for k, v in data["sizes"][SIZE].items()}, "encoder": data["encoder"]}
    assert {k: v["path"] for k, v in parts.items()} == {"dit": "dit-128x128", "vae": "vae-128x128",
                                                        "encoder": "encoder"}     # relative to the bundle
    assert {k: v["kind"] for k, v in parts.items()} == {"dit": "anima-dit-pack", "vae": "anima-vae-pack",
                                                        "encoder": "anima-encoder-pack"}
    for part in parts.values():
        d = out / part["path"]
        assert part["manifest_sha256"] == file_sha256(d / MANIFEST)
        assert part["bytes"] == sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) > 0
    # a CPU bundle keeps its ONNX graphs (ONNX Runtime runs them) and has no compiled files
    assert len(list((out / "dit-128x128" / "onnx").glob("*.onnx"))) == 84
    assert not list(out.rglob("*.rknn"))
    assert "3/3 parts" in err and "encoder built" in err


def test_second_run_keeps_every_part(cpu_bundle, tiny_bundle, tmp_path, capsys):
    out = copy_bundle(cpu_bundle[0], tmp_path / "b")
    before = {p: (out / p / MANIFEST).stat().st_mtime_ns for p in ("dit-128x128", "vae-128x128", "encoder")}
    assert models_main(["bundle", "--models", str(tiny_bundle), "--resolution", SIZE, "--target", "none",
                        "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("kept (complete)") == 3 and "built" not in err
    assert before == {p: (out / p / MANIFEST).stat().st_mtime_ns for p in before}
    # a part whose file was damaged is rebuilt; the others are kept
    replace_file(out / "vae-128x128" / "onnx" / "tile.onnx", b"broken")
    assert models_main(["bundle", "--models", str(tiny_bundle), "--resolution", SIZE, "--target", "none",
                        "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("kept (complete)") == 2 and "vae-128x128 built" in err
    read_bundle(out, hashes=True)


def test_bundle_refuses_bad_requests(tiny_bundle, tmp_path, capsys):
    args = ["bundle", "--models", str(tiny_bundle), "--target", "none", "--out", str(tmp_path / "b")]
    assert models_main(args + ["--resolution", "100x100"]) == 2
    assert "multiple of 8" in capsys.readouterr().err
    assert models_main(["bundle", "--models", str(tmp_path / "nope"), "--resolution", SIZE, "--target", "none",
                        "--out", str(tmp_path / "b")]) == 2
    assert "no such folder" in capsys.readouterr().err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert models_main(["bundle", "--models", str(tiny_bundle), "--resolution", SIZE, "--target", "none",
                        "--out", str(mine)]) == 2
    assert "not a bundle (holds notes.txt)" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep" and not (tmp_path / "b").exists()


def test_read_bundle_names_what_is_wrong(cpu_bundle, tmp_path):
    ok = read_bundle(cpu_bundle[0], hashes=True)
    assert list(ok.sizes) == [(128, 128)] and ok.backend == "onnx" and ok.encoder == cpu_bundle[0] / "encoder"
    b = copy_bundle(cpu_bundle[0], tmp_path / "gone")
    shutil.rmtree(b / "vae-128x128")
    with pytest.raises(BundleError, match=r"sizes\.128x128\.vae: .*vae-128x128 is missing; copy the whole bundle"):
        read_bundle(b)
    b = copy_bundle(cpu_bundle[0], tmp_path / "file")
    host = b / "dit-128x128" / "host.safetensors"
    data = bytearray(host.read_bytes())
    data[-1] ^= 1
    replace_file(host, bytes(data))                       # same size, another hash: only a hash check sees it
    read_bundle(b, hashes=False)
    with pytest.raises(BundleError, match=r"sizes\.128x128\.dit: .*host.safetensors \(sha256 differs"):
        read_bundle(b, hashes=True)
    b = copy_bundle(cpu_bundle[0], tmp_path / "swapped")
    m = json.loads((b / "encoder" / MANIFEST).read_text())
    m["created"] = "another build"
    replace_file(b / "encoder" / MANIFEST, json.dumps(m).encode())
    with pytest.raises(BundleError, match="encoder: .*not the manifest bundle.json records"):
        read_bundle(b)
    b = copy_bundle(cpu_bundle[0], tmp_path / "onnx")
    (b / "dit-128x128" / "onnx" / "b03_ffn.onnx").unlink()
    with pytest.raises(BundleError, match=r"1 file.s. missing or cut short, e.g. onnx/b03_ffn.onnx \(missing\)"):
        read_bundle(b)
    b = copy_bundle(cpu_bundle[0], tmp_path / "json")
    (b / BUNDLE_JSON).unlink()
    with pytest.raises(BundleError, match="no bundle.json .an interrupted build or copy"):
        read_bundle(b)
    with pytest.raises(BundleError, match="this is a model pack, not a bundle: use --pack"):
        read_bundle(cpu_bundle[0] / "dit-128x128")
    b = copy_bundle(cpu_bundle[0], tmp_path / "escape")
    d = json.loads((b / BUNDLE_JSON).read_text())
    d["encoder"]["path"] = "../encoder"
    replace_file(b / BUNDLE_JSON, json.dumps(d).encode())
    with pytest.raises(BundleError, match="'../encoder' is not a folder inside the bundle"):
        read_bundle(b)


def test_init_bundle_writes_a_config_that_works_as_written(cpu_bundle, tmp_path, capsys):
    from stages.config import load_config
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--bundle", str(cpu_bundle[0])]) == 0
    assert "next: orchestrator --run" in capsys.readouterr().out
    cfg = load_config(run / "pipeline.toml")
    b = cpu_bundle[0].resolve()
    assert cfg.backend == "onnx" and cfg.pack_dir == b / "dit-128x128" and cfg.packs == (b / "dit-128x128",)
    assert cfg.stage_settings("encoder")["backend"] == "onnx"
    assert Path(cfg.stage_settings("encoder")["pack"]) == b / "encoder"
    vae = cfg.stage_settings("vae")
    assert vae["backend"] == "onnx" and [Path(p) for p in vae["vae_pack"]] == [b / "vae-128x128"]
    text = (run / "pipeline.toml").read_text()
    assert text.index("backend = \"onnx\"") < text.index("[stage.")          # the executor's: top level
    assert json.loads((run / "prompt.json").read_text())["prompt"]           # an example to submit
    # init --pack with --bundle: refused (the bundle names the packs)
    assert cli.main(["--run", str(tmp_path / "r2"), "init", "--bundle", str(b), "--pack", str(b / "dit-128x128")]) == 2
    assert "without --pack" in capsys.readouterr().err


def test_init_bundle_refuses_a_broken_bundle_before_writing(cpu_bundle, tmp_path, capsys):
    b = copy_bundle(cpu_bundle[0], tmp_path / "b")
    shutil.rmtree(b / "vae-128x128")
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--bundle", str(b)]) == 2
    err = capsys.readouterr().err
    assert "sizes.128x128.vae" in err and "is missing" in err and "Traceback" not in err
    assert not run.exists()
    assert cli.main(["--run", str(run), "init", "--bundle", str(tmp_path / "nope")]) == 2
    assert "no such bundle folder" in capsys.readouterr().err


def test_init_pack_refuses_a_misspelt_path_a_checkpoint_and_missing_models(tmp_path, tiny_dit, capsys):
    from tests.doubles_harness import fake_pack
    a = fake_pack(tmp_path / "a", 64, 64)
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--pack", str(tmp_path / "aa")]) == 2
    assert f"--pack {tmp_path / 'aa'}: no such folder" in capsys.readouterr().err
    assert cli.main(["--run", str(run), "init", "--pack", str(tiny_dit)]) == 2
    assert "a file, not a model pack folder (a checkpoint: make a pack from it with `anima-models pack`)" in \
        capsys.readouterr().err
    assert cli.main(["--run", str(run), "init", "--pack", str(a), "--models", str(tmp_path / "models")]) == 2
    assert "--models" in capsys.readouterr().err
    junk = tmp_path / "junk"
    junk.mkdir()
    assert cli.main(["--run", str(run), "init", "--pack", str(junk)]) == 2
    assert "model pack" in capsys.readouterr().err
    assert not run.exists()
    assert cli.main(["--run", str(run), "init", "--pack", str(a)]) == 0


def test_host_commands_without_the_host_extra_name_it(tmp_path, tiny_dit):
    """A board install has no torch, transformers or onnx: `pack` (which builds ONNX graphs) says which extra to
    install instead of a traceback."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['onnx'] = None\n"          # `import onnx` now fails as when it is absent
            "from models.commands.cli import main\n"
            f"sys.exit(main(['pack', {str(tiny_dit)!r}, '--out', {str(tmp_path / 'p')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 2, r.stderr
    assert "this command needs the host extra" in r.stderr and "pip install 'anima-npu[host]'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def one_block_dit(tmp_path_factory) -> Path:
    """The tiny DiT's first block (seed 0), for the NPU bundles: every model of it goes through the real compiler,
    and what a bundle does with a compiled DiT pack is the same for 3 branch models as for the whole tiny DiT's 84."""
    from models.dit.synth import write_dit
    dit = tmp_path_factory.mktemp("one_block") / "one-block.safetensors"
    write_dit("tiny", 0, dit, blocks=1)
    return dit


@pytest.fixture(scope="module")
def npu_bundle(tmp_path_factory, tiny_bundle, one_block_dit, rknn_venv) -> Path:
    """`bundle --target rk3588` at 128x128 with the one-block DiT: every DiT and VAE model compiled by the real
    rknn-toolkit2, one worker per pack (each worker is a toolkit import, seconds of CPU; the sharded bundle below
    compiles with two)."""
    out = tmp_path_factory.mktemp("npu_bundle") / "bundle"
    assert models_main(["bundle", "--models", str(tiny_bundle), "--dit", str(one_block_dit), "--resolution", SIZE,
                        "--target", "rk3588", "--out", str(out), "--toolkit-venv", str(rknn_venv), "--jobs", "1",
                        "--per-worker", "0"]) == 0
    return out


def test_npu_bundle_is_compiled_and_holds_no_onnx_graphs(npu_bundle, one_block_dit, rknn_venv, tiny_bundle, capsys):
    from models.runtime.backends.rknn import compiled_path
    from models.packs.pack import load_pack, onnx_omitted
    from models.rknn.compile import toolkit_version
    data = json.loads((npu_bundle / BUNDLE_JSON).read_text())
    toolkit = toolkit_version(rknn_venv)
    assert data["target"] == "rk3588" and data["toolkit"] == toolkit == "2.5.0"
    for part, models in (("dit-128x128", 3), ("vae-128x128", 2)):
        m = json.loads((npu_bundle / part / MANIFEST).read_text())
        assert onnx_omitted(m) and len(m["branches"]) == models
        assert {(b["rknn"]["target"], b["rknn"]["toolkit"]) for b in m["branches"]} == {("rk3588", toolkit)}
        assert len(list((npu_bundle / part).rglob("*.rknn"))) == models
        assert not list((npu_bundle / part).rglob("*.onnx"))          # the board never reads them
    pack = load_pack(npu_bundle / "dit-128x128", check=True)          # the loader accepts the compiled pack as it is
    assert compiled_path(pack.dir / pack.branches[0]["onnx"]).is_file()
    assert read_bundle(npu_bundle, hashes=True).backend == "rknn"
    capsys.readouterr()
    # a second run compiles nothing: every part is kept
    assert models_main(["bundle", "--models", str(tiny_bundle), "--dit", str(one_block_dit), "--resolution", SIZE,
                        "--target", "rk3588", "--out", str(npu_bundle), "--toolkit-venv", str(rknn_venv)]) == 0
    assert capsys.readouterr().err.count("kept (complete)") == 3


def test_init_npu_bundle_checks_the_runtime(npu_bundle, tmp_path, capsys, monkeypatch):
    from stages.config import load_config
    monkeypatch.delenv("ANIMA_RKNN_STANDIN", raising=False)
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--bundle", str(npu_bundle), "--quick"]) == 2    # no rknnlite here
    err = capsys.readouterr().err
    assert "cannot import rknnlite.api" in err and "the bundle needs rknn-toolkit-lite2 2.5.0" in err
    assert not run.exists()
    monkeypatch.setenv("ANIMA_RKNN_STANDIN", "1")                  # the labelled stand-in imitates 2.5.0
    from models.runtime.backends.standin import rknnlite as rknnlite_standin
    monkeypatch.setattr(rknnlite_standin, "LITE_VERSION", "2.3.2")
    assert cli.main(["--run", str(run), "init", "--bundle", str(npu_bundle), "--quick"]) == 2
    assert "compiled with rknn-toolkit2 2.5.0, but rknn-toolkit-lite2 2.3.2 is installed: install the same " \
           "release, pip install 'rknn-toolkit-lite2==2.5.0'" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setenv("ANIMA_RKNN_STANDIN", "1")
    assert cli.main(["--run", str(run), "init", "--bundle", str(npu_bundle)]) == 0
    cfg = load_config(run / "pipeline.toml")
    assert cfg.backend == "rknn" and cfg.stage_settings("vae")["backend"] == "rknn"
    assert cfg.stage_settings("encoder")["backend"] == "onnx"


def test_bundle_values_never_become_toml_of_their_own(cpu_bundle, tmp_path, capsys):
    """Reported: bundle.json's `toolkit` and the bundle folder's name were written verbatim into pipeline.toml, so a
    crafted value added top-level keys and tables (`security`, `endpoints`, `models_dir`) that doctor accepted. Now a
    toolkit is a release number (null for target none), and what pipeline.toml says of the bundle is quoted."""
    import tomllib
    inject = "2.5.0)\n[security]\nallow_plaintext_loopback = true\n# ("
    for target, toolkit, words in (("none", inject, "target none compiles nothing"),
                                   ("none", "2.5.0", "target none compiles nothing"),
                                   ("rk3588", inject, "is not a release number")):
        b = copy_bundle(cpu_bundle[0], tmp_path / f"t-{target}-{len(toolkit)}")
        d = json.loads((b / BUNDLE_JSON).read_text())
        d["target"], d["toolkit"] = target, toolkit
        replace_file(b / BUNDLE_JSON, json.dumps(d).encode())
        with pytest.raises(BundleError, match=words):
            read_bundle(b)
        assert cli.main(["--run", str(tmp_path / "r-refused"), "init", "--bundle", str(b)]) == 2
        assert words in capsys.readouterr().err and not (tmp_path / "r-refused").exists()
    b = copy_bundle(cpu_bundle[0], tmp_path / "b\n[security]\nallow_plaintext_loopback = true\nmodels_dir = \"/x\"\n#")
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--bundle", str(b)]) == 0
    data = tomllib.loads((run / "pipeline.toml").read_text())
    assert "security" not in data and data["backend"] == "onnx"
    assert data["models_dir"] == str((run / "models").resolve())          # the run folder's own, for LoRAs
    from stages.config import load_config
    assert load_config(run / "pipeline.toml").pack_dir == (b / "dit-128x128").resolve()



def test_a_file_cut_short_is_caught_without_hashing(cpu_bundle, tmp_path, capsys):
    """Reported: `init --bundle --quick` and plain `doctor` passed a DiT or VAE file cut to 100 bytes (they promise
    sizes). The quick look compares every size the manifest records."""
    for part, rel in (("dit-128x128", "onnx/b05_cross.onnx"), ("vae-128x128", None)):
        b = copy_bundle(cpu_bundle[0], tmp_path / part)
        if rel is None:
            rel = json.loads((b / part / MANIFEST).read_text())["branches"][0]["onnx"]
        f = b / part / rel
        size = f.stat().st_size
        replace_file(f, f.read_bytes()[:100])                         # the copy's links are shared: never in place
        with pytest.raises(BundleError, match=f"missing or cut short, e.g. {rel} \\(100 bytes, the manifest says "
                                              f"{size}\\)"):
            read_bundle(b, hashes=False)
        run = tmp_path / f"run-{part}"
        assert cli.main(["--run", str(run), "init", "--bundle", str(b), "--quick"]) == 2
        assert "cut short" in capsys.readouterr().err and not run.exists()



def test_kind_swaps_deep_json_and_links_out_are_refused(cpu_bundle, tmp_path, capsys):
    """Reported: bundle.json's VAE entry as `dit` or its DiT as `encoder` was accepted or gave a traceback; a 100k-deep
    bundle.json a traceback; a part folder symlinked outside the bundle was accepted. Each is a BundleError (exit 2)."""
    cases = [
        (lambda b, d: d["sizes"][SIZE]["vae"].__setitem__("kind", "anima-dit-pack"), "where bundle.json holds"),
        (lambda b, d: d["sizes"][SIZE]["dit"].__setitem__("kind", "anima-encoder-pack"), "where bundle.json holds"),
        (lambda b, d: d["sizes"][SIZE].__setitem__("dit", dict(d["sizes"][SIZE]["vae"])), "where bundle.json holds"),
        (lambda b, d: replace_file(b / BUNDLE_JSON, b"[" * 100_000 + b"]" * 100_000) or d.clear(), "unreadable"),
    ]
    for i, (change, words) in enumerate(cases):
        b = copy_bundle(cpu_bundle[0], tmp_path / f"c{i}")
        d = json.loads((b / BUNDLE_JSON).read_text())
        change(b, d)
        if d:
            replace_file(b / BUNDLE_JSON, json.dumps(d).encode())
        with pytest.raises(BundleError, match=words):
            read_bundle(b)
        assert cli.main(["--run", str(tmp_path / f"r{i}"), "init", "--bundle", str(b), "--quick"]) == 2
        assert words in capsys.readouterr().err
    b = copy_bundle(cpu_bundle[0], tmp_path / "linked")
    outside = tmp_path / "outside-encoder"
    (b / "encoder").rename(outside)
    (b / "encoder").symlink_to(outside)
    with pytest.raises(BundleError, match="leads out of the bundle"):
        read_bundle(b)


def test_bundle_records_the_models_sampling(cpu_bundle, tiny_bundle, tmp_path, capsys):
    """`--sampling turbo` on a complete bundle: every part kept, the DiT pack's manifest and bundle.json record the
    settings (the pack's pinned manifest hash follows), read back through the one manifest reader; a malformed
    record in bundle.json is refused naming it, a bad option before anything is built."""
    from models.records.manifest import pack_sampling
    from models.packs.sampling import TURBO
    out = copy_bundle(cpu_bundle[0], tmp_path / "b")
    base = ["bundle", "--models", str(tiny_bundle), "--resolution", SIZE, "--target", "none", "--out", str(out)]
    assert models_main(base + ["--sampling", "turbo"]) == 0
    err = capsys.readouterr().err
    assert "kept, its sampling record changed" in err and "built" not in err
    assert pack_sampling(out / "dit-128x128") == TURBO and pack_sampling(cpu_bundle[0] / "dit-128x128") is None
    data = json.loads((out / BUNDLE_JSON).read_text())
    assert data["sampling"] == TURBO
    read_bundle(out, hashes=True)
    data["sampling"]["scheduler"] = "sometimes"
    replace_file(out / BUNDLE_JSON, json.dumps(data).encode())
    with pytest.raises(BundleError, match="scheduler"):
        read_bundle(out)
    assert models_main(base + ["--sampling-json", '{"steps": 8}']) == 2
    assert "--sampling-json" in capsys.readouterr().err


def test_bundle_run_folder_lists_and_checks_its_loader_names(cpu_bundle, tiny_bundle, tmp_path, capsys):
    """Issue 44 item 9: on an `init --bundle` run folder the text encoder and the VAE are packs; the loaders list
    the files those packs were made from (a client that builds its graph from /object_info finds them), and any
    other name is refused as ComfyUI refuses one not in its list."""
    from models.setup.models_dir import resolve_models
    from orchestrator.http.comfy_graph import GraphError, graph_to_job
    from orchestrator.http.comfy_nodes import ModelNames, node_table, object_info
    from orchestrator.engine.packs import pack_model_files
    from stages.config import load_config
    from tests.comfy_graphs import standard_graph
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--bundle", str(cpu_bundle[0])]) == 0
    capsys.readouterr()
    cfg = load_config(run / "pipeline.toml")
    files = pack_model_files(cfg)
    src = resolve_models(tiny_bundle, {}, need=("dit", "text_encoder", "vae"))
    assert files == {"text_encoder": src.text_encoder.name, "vae": src.vae.name}
    # what the daemon answers INFO with (and the front lists): the packs' sources, the run folder's models/ holding
    # only loras/ (before: nothing, and every name was taken)
    from types import SimpleNamespace
    from orchestrator.engine.daemon import Daemon
    assert Daemon.model_files(SimpleNamespace(cfg=cfg, _model_files=None)) == files
    names = ModelNames(unet=(src.dit.name,), clip=(files["text_encoder"],), vae=(files["vae"],), sizes=((128, 128),))
    info = object_info(node_table(names))
    assert info["CLIPLoader"]["input"]["required"]["clip_name"][0] == [src.text_encoder.name]
    assert info["VAELoader"]["input"]["required"]["vae_name"][0] == [src.vae.name]
    good = {"unet": src.dit.name, "clip": src.text_encoder.name, "vae": src.vae.name}
    graph_to_job(standard_graph(width=128, height=128, names=good), names=names, sizes=[(128, 128)])
    for key, cls in (("clip", "CLIPLoader"), ("vae", "VAELoader")):
        with pytest.raises(GraphError) as e:
            graph_to_job(standard_graph(width=128, height=128, names={**good, key: "other.safetensors"}),
                         names=names, sizes=[(128, 128)])
        errors = [err for node in e.value.body()["node_errors"].values() for err in node["errors"]
                  if node["class_type"] == cls]
        assert [err["type"] for err in errors] == ["value_not_in_list"], e.value.body()


def test_bundle_lora_bakes_into_every_dit_pack(tiny_bundle, tiny_dit, cpu_bundle, tmp_path, capsys):
    """`bundle --lora FILE:STRENGTH` bakes the LoRA into the DiT pack of every size as `pack --lora` does, records it
    in bundle.json, and init --bundle and doctor say so; another strength rebuilds the DiT packs, nothing else."""
    from models.lora import LoraUse
    from models.lora.synth import write_lora
    from models.packs.pack import build_pack, load_pack
    from orchestrator.ops.doctor import doctor
    from orchestrator.engine.runfolder import RunFolder
    lora = tmp_path / "style.safetensors"
    write_lora("tiny", 7, lora, "kohya", rank=4)
    out = tmp_path / "b"
    args = ["bundle", "--models", str(tiny_bundle), "--resolution", "64x64," + SIZE, "--target", "none",
            "--out", str(out)]
    assert models_main(args + ["--lora", f"{lora}:0.8"]) == 0
    assert "baked LoRA style.safetensors x 0.8" in capsys.readouterr().out
    data = json.loads((out / BUNDLE_JSON).read_text())
    assert data["lora"] == [{"name": "style.safetensors", "strength": 0.8, "sha256": file_sha256(lora)}]
    def weights(d):
        return [b["sha256"] for b in load_pack(d).manifest["branches"]]
    ref = build_pack(tiny_dit, tmp_path / "ref", (64, 64), "fp16", loras=[LoraUse(str(lora), 0.8)])
    assert weights(out / "dit-64x64") == weights(ref)                        # pack --lora's weights
    assert weights(out / "dit-128x128") != weights(cpu_bundle[0] / "dit-128x128")     # baked: not the plain pack
    for key in ("64x64", SIZE):
        m = load_pack(out / f"dit-{key}").manifest
        assert [(b["name"], b["strength"]) for b in m["lora"]["baked"]] == [("style.safetensors", 0.8)]
    assert read_bundle(out).lora == tuple(data["lora"])
    assert cli.main(["--run", str(tmp_path / "run"), "init", "--bundle", str(out)]) == 0
    assert "backend onnx, baked LoRA style.safetensors x 0.8" in capsys.readouterr().out
    report = io.StringIO()
    doctor(RunFolder.resolve(tmp_path / "run"), out=report)
    lines = [ln for ln in report.getvalue().splitlines() if ln.startswith("ok lora: ")]
    assert len(lines) == 2 and all("baked LoRA style.safetensors x 0.8 (no run-time cost)" in ln for ln in lines)
    # another strength: both DiT packs rebuilt, the VAE packs and the encoder kept
    assert models_main(args + ["--lora", f"{lora}:0.5"]) == 0
    err = capsys.readouterr().err
    assert json.loads((out / BUNDLE_JSON).read_text())["lora"][0]["strength"] == 0.5
    assert load_pack(out / "dit-64x64").manifest["lora"]["baked"][0]["strength"] == 0.5
    assert err.count("kept (complete)") == 3, err
    # a LoRA file that is not there, and bundle.json's lora not a list: refused naming it
    assert models_main(args + ["--lora", f"{tmp_path / 'nope.safetensors'}:0.5"]) == 2
    err = capsys.readouterr().err
    assert "--lora" in err and "no such file" in err, err
    b = copy_bundle(out, tmp_path / "b2")
    data = json.loads((out / BUNDLE_JSON).read_text())
    data["lora"][0]["strength"] = 0.8
    replace_file(b / BUNDLE_JSON, json.dumps(data).encode())
    with pytest.raises(BundleError, match="sizes.64x64.dit: its DiT pack has baked LoRA style.safetensors x 0.5"):
        read_bundle(b)
    data["lora"] = [{"name": "x"}]
    replace_file(b / BUNDLE_JSON, json.dumps(data).encode())
    with pytest.raises(BundleError, match="'lora' is not a list"):
        read_bundle(b)


def _bench_job_s(pack: Path, shards: int, size: str, calls: int, cfg: float) -> float:
    """bench/overhead.py --analytic's job seconds for `pack` modelled as built with `--shards` (the reference)."""
    import sys
    from contextlib import redirect_stdout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import overhead
    out = io.StringIO()
    with redirect_stdout(out):
        assert overhead.main(["--analytic", "--pack", str(pack), "--shards", str(shards), "--policy", "auto",
                              "--board-ram", "8", "--vae", "npu", "--resolution", size, "--calls", str(calls),
                              "--cfg", str(cfg)]) == 0
    return float(out.getvalue().strip().splitlines()[-1].split("job_s=")[1])


def test_a_bundle_with_shards_builds_sharded_packs_and_estimate_prices_them(tiny_bundle, cpu_bundle, tmp_path,
                                                                           capsys):
    """`bundle --shards 2`: every DiT pack sharded (its manifest's shards.n, bundle.json's "shards"), and
    `orchestrator estimate` on a run folder made from it prices that sharded pack: bench/overhead.py --analytic on the
    same pack with --shards 2 gives the same job seconds, and the unsharded bundle's pack is priced differently."""
    import re
    from models.packs.pack import load_pack
    out = copy_bundle(cpu_bundle[0], tmp_path / "bundle")      # the encoder and the VAE are kept: not the subject
    assert models_main(["bundle", "--models", str(tiny_bundle), "--resolution", SIZE, "--target", "none",
                        "--out", str(out), "--shards", "2"]) == 0
    said = capsys.readouterr()
    assert "2 shards per branch" in said.out
    assert said.err.count("kept (complete)") == 2 and "dit-128x128 built" in said.err, said.err
    data = json.loads((out / BUNDLE_JSON).read_text())
    assert data["shards"] == 2 and json.loads((cpu_bundle[0] / BUNDLE_JSON).read_text())["shards"] == 1
    pack = load_pack(out / "dit-128x128", check=True)
    assert pack.manifest["shards"]["n"] == 2 and all(len(b["shards"]["parts"]) == 2 for b in pack.branches)
    assert read_bundle(out).sizes[(128, 128)][0] == pack.dir.resolve()
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps({"prompt": "a", "width": 128, "height": 128, "steps": 8, "cfg": 1,
                                  "sampler": "er_sde", "scheduler": "simple", "spectrum": False}))
    line = re.compile(r"^estimate job_s=(\d+\.\d) .* calls=(\d+) passes=1 \[modelled\]$")
    priced = {}
    for name, b in (("sharded", out), ("unsharded", cpu_bundle[0])):
        run = tmp_path / f"run-{name}"
        assert cli.main(["--run", str(run), "init", "--bundle", str(b)]) == 0
        capsys.readouterr()
        assert cli.main(["--run", str(run), "estimate", str(prompt)]) == 0
        printed = capsys.readouterr().out.strip().splitlines()
        job_s, calls = line.match(printed[-1]).groups()
        priced[name] = (float(job_s), int(calls), printed)
    job_s, calls, printed = priced["sharded"]
    assert job_s == pytest.approx(_bench_job_s(pack.dir, 2, SIZE, calls, 1.0), abs=0.06)
    assert not any("not sharded" in x for x in printed)
    assert priced["unsharded"][0] == pytest.approx(_bench_job_s(cpu_bundle[0] / "dit-128x128", 1, SIZE, calls, 1.0),
                                                   abs=0.06)
    assert job_s != priced["unsharded"][0]
    # a bundle.json that says otherwise than its packs is refused naming the field
    b = copy_bundle(out, tmp_path / "lying")
    d = json.loads((b / BUNDLE_JSON).read_text())
    d["shards"] = 1
    replace_file(b / BUNDLE_JSON, json.dumps(d).encode())
    with pytest.raises(BundleError, match="2 shard\\(s\\) per branch, bundle.json says 1"):
        read_bundle(b)


def test_bundle_shards_is_checked_before_anything_is_built(tiny_bundle, tmp_path, capsys):
    for extra, words in ((["--shards", "4"], "--shards 4: shards 4 must be an integer in [1, 3]"),
                         (["--shards", "2", "--lora-rank", "8"], "--shards 2 with --lora-rank 8")):
        assert models_main(["bundle", "--models", str(tiny_bundle), "--resolution", SIZE, "--target", "none",
                            "--out", str(tmp_path / "b"), *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err
        assert not (tmp_path / "b").exists()


def test_an_npu_bundle_with_shards_compiles_every_shard_and_keeps_no_onnx(tiny_bundle, one_block_dit, rknn_venv,
                                                                           tmp_path, capsys):
    """`bundle --target rk3588 --shards 2` on a one-block DiT (9 DiT models: 3 branches and their 6 shards, by the
    real rknn-toolkit2): every shard compiled as `anima-models compile` compiles a sharded pack, no ONNX graph left
    (the shards' too: the board reads .rknn only), the bundle checked with every hash, a second run keeping it."""
    from models.packs.pack import load_pack
    from models.runtime.backends.rknn import compiled_path
    out = tmp_path / "bundle"
    argv = ["bundle", "--models", str(tiny_bundle), "--dit", str(one_block_dit), "--resolution", SIZE,
            "--target", "rk3588", "--out", str(out), "--toolkit-venv", str(rknn_venv), "--shards", "2"]
    assert models_main(argv + ["--jobs", "2", "--per-worker", "0"]) == 0
    pack = load_pack(out / "dit-128x128", check=True)
    parts = [p for b in pack.branches for p in b["shards"]["parts"]]
    assert len(pack.branches) == 3 and len(parts) == 6 and pack.manifest["shards"]["n"] == 2
    assert all(p["rknn"]["target"] == "rk3588" and compiled_path(pack.dir / p["onnx"]).is_file() for p in parts)
    assert len(list(pack.dir.rglob("*.rknn"))) == 9 and not list(pack.dir.rglob("*.onnx"))
    assert read_bundle(out, hashes=True).data["shards"] == 2
    capsys.readouterr()
    assert models_main(argv) == 0
    assert capsys.readouterr().err.count("kept (complete)") == 3
