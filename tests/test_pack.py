"""Packs: manifest contents, file checks naming the bad file, atomic build, refusing another checkpoint's pack."""
import json
import shutil

import numpy as np
import pytest

from models.packs import branch_graphs
from models.dit.checkpoint import DiTCheckpoint
from models.dit.host_ops import host_keys
from models.packs.pack import MANIFEST, PackError, build_pack, file_sha256, load_pack
from models.dit.partition import KINDS, branch_order, resolve
from models.base.safetensors_io import SafeTensorsFile


@pytest.fixture(scope="module")
def pack16(tiny_dit, tmp_path_factory):
    return build_pack(tiny_dit, tmp_path_factory.mktemp("packs") / "p16", (128, 64), "fp16")


def test_manifest_describes_the_pack(pack16, tiny_dit):
    ck = DiTCheckpoint.open(tiny_dit)
    m = json.loads((pack16 / MANIFEST).read_text())
    assert m["schema"] == 1 and m["dtype"] == "fp16" and m["io_dtype"] == "f16" and m["opset"] == 19
    assert m["source"]["sha256"] == ck.sha256() == file_sha256(tiny_dit)
    assert m["config"] == ck.config.to_dict()
    assert m["resolution"] == {"width": 128, "height": 64}
    g = m["geometry"]
    assert (g["latent_h"], g["latent_w"], g["h_tokens"], g["w_tokens"], g["tokens"], g["text_tokens"]) == \
        (8, 16, 4, 8, 32, 512)
    assert set(m["tools"]) >= {"python", "numpy", "onnx", "onnxruntime", "anima-npu"}
    order = list(branch_order(ck.config))
    assert [(b["block"], b["kind"]) for b in m["branches"]] == [(i, s.kind) for i, s in order]
    for b in m["branches"]:
        assert b["onnx"] == f"onnx/b{b['block']:02d}_{b['kind']}.onnx"
        assert file_sha256(pack16 / b["onnx"]) == b["sha256"]
        io = resolve(b["kind"], ck.config, load_pack(pack16, check=False).geometry, "fp16")
        assert b["inputs"] == io["inputs"] and b["outputs"] == io["outputs"]
    assert m["branches"][1]["inputs"][1] == {"name": "context", "shape": [512, ck.config.context_dim], "dtype": "f16"}
    # host weights: exactly the host keys, FP32, equal to the checkpoint's values
    st = SafeTensorsFile(pack16 / m["host"]["file"])
    assert st.keys() == host_keys(ck.config)
    assert {st.dtype(k) for k in st.keys()} == {"F32"}
    for k in ("x_embedder.proj.1.weight", "blocks.27.adaln_modulation_mlp.2.weight"):
        np.testing.assert_array_equal(st.get(k), ck.get(k))
    assert not any(k.startswith("blocks.0.self_attn") for k in st.keys())
    p = load_pack(pack16)
    assert p.dtype == "fp16" and p.branch_path(3, "cross").name == "b03_cross.onnx" and len(p.branches) == 84


@pytest.mark.parametrize("victim", ["onnx/b05_cross.onnx", "host.safetensors"])
def test_check_names_a_modified_file(pack16, tmp_path, victim):
    bad = tmp_path / "bad"
    shutil.copytree(pack16, bad)
    data = bytearray((bad / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / victim).write_bytes(bytes(data))
    with pytest.raises(PackError, match=victim.replace(".", r"\.") + r" \(sha256 differs"):
        load_pack(bad)
    load_pack(bad, check=False)          # the manifest itself is still fine


def test_check_names_a_missing_file_and_bad_manifest(pack16, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(pack16, bad)
    (bad / "onnx/b27_ffn.onnx").unlink()
    with pytest.raises(PackError, match=r"onnx/b27_ffn\.onnx \(missing\)"):
        load_pack(bad)
    m = json.loads((bad / MANIFEST).read_text())
    del m["branches"][4]
    (bad / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(PackError, match="branch table"):
        load_pack(bad)
    del m["host"]
    (bad / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(PackError, match="'host' is missing"):
        load_pack(bad)
    (bad / MANIFEST).write_text("{not json")
    with pytest.raises(PackError, match="unreadable manifest"):
        load_pack(bad)


@pytest.mark.parametrize("where,name,words", [
    ("host", "../outside.safetensors", "leaves the pack folder"),
    ("host", "/etc/passwd", "leaves the pack folder"),
    ("onnx", "onnx/../../outside.onnx", "leaves the pack folder"),
    ("onnx", "", "not a relative path"),
    ("onnx", "onnx\\..\\x.onnx", "not a relative path"),
    ("rknn", "../../outside.rknn", "leaves the pack folder"),
    ("rknn", "rknn/escape.rknn", "outside the pack folder"),        # a link inside the pack that points out
])
def test_manifest_file_names_stay_inside_the_pack(pack16, tmp_path, where, name, words):
    """A pack may come from elsewhere: no manifest file name may reach a file outside its folder, for load_pack (which
    would hash it) nor for the rknn backend (which would run it; before, it took rknn.file as it stood)."""
    from models.runtime.backends.base import BackendError
    from models.runtime.backends.rknn import RknnLiteBackend, compiled_path
    bad = tmp_path / "pack"
    shutil.copytree(pack16, bad)
    (tmp_path / "outside.rknn").write_bytes(b"not yours")
    (bad / "rknn").mkdir()
    (bad / "rknn" / "escape.rknn").symlink_to(tmp_path / "outside.rknn")
    m = json.loads((bad / MANIFEST).read_text())
    if where == "host":
        m["host"]["file"] = name
    elif where == "onnx":
        m["branches"][0]["onnx"] = name
    else:
        m["branches"][0]["rknn"] = {"file": name, "sha256": "0" * 64}
    (bad / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(PackError, match=words):
        load_pack(bad, check=False)
    if where == "rknn":
        with pytest.raises(BackendError, match=words):
            compiled_path(bad / "onnx" / "b00_self.onnx")
        with pytest.raises(BackendError, match=words):
            RknnLiteBackend(lite="standin").load(bad / "onnx" / "b00_self.onnx")


def test_interrupted_build_leaves_nothing_that_looks_complete(tiny_dit, tmp_path, monkeypatch):
    real = branch_graphs.build_branch
    calls = []

    def failing(kind, *a, **kw):
        calls.append(kind)
        if len(calls) == 10:
            raise RuntimeError("disk full (simulated)")
        return real(kind, *a, **kw)

    monkeypatch.setattr(branch_graphs, "build_branch", failing)
    out = tmp_path / "pack"
    with pytest.raises(RuntimeError, match="simulated"):
        build_pack(tiny_dit, out, (64, 64), "fp32")
    assert len(calls) == 10
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []          # the temporary sibling is gone too
    with pytest.raises(PackError, match="no such pack"):
        load_pack(out)
    # a folder killed mid-build (no manifest) is not a pack
    (out / "onnx").mkdir(parents=True)
    (out / "host.safetensors").write_bytes(b"x")
    with pytest.raises(PackError, match="not a complete pack"):
        load_pack(out)


def test_refuses_a_pack_of_another_checkpoint(tmp_path):
    """Two one-block checkpoints (seeds 0 and 1): which checkpoint and size a pack holds does not depend on how many
    blocks it has, and the five builds below cost 3 graphs each instead of 84."""
    from models.dit.synth import write_dit
    mine, other = tmp_path / "mine.safetensors", tmp_path / "other.safetensors"
    write_dit("tiny", 0, mine, blocks=1)
    write_dit("tiny", 1, other, blocks=1)
    out = tmp_path / "pack"
    build_pack(mine, out, (64, 64), "fp32")
    first = json.loads((out / MANIFEST).read_text())["source"]["sha256"]
    with pytest.raises(PackError, match="another checkpoint.*overwrite"):
        build_pack(other, out, (64, 64), "fp32")
    assert load_pack(out).source["sha256"] == first          # untouched
    with pytest.raises(PackError, match="holds a pack for 64x64, this one is 64x128.*overwrite"):
        build_pack(mine, out, (64, 128), "fp16")         # same checkpoint, another size: refused
    g = load_pack(out).geometry
    assert (g.width, g.height) == (64, 64) and load_pack(out).dtype == "fp32"     # untouched
    build_pack(mine, out, (64, 64), "fp16")              # same checkpoint and size: rebuilt in place
    assert load_pack(out).dtype == "fp16"
    build_pack(mine, out, (64, 128), "fp16", overwrite=True)     # another size, said so: replaced
    assert load_pack(out).dtype == "fp16" and load_pack(out).geometry.height == 128
    build_pack(other, out, (64, 64), "fp32", overwrite=True)
    assert load_pack(out).source["sha256"] == file_sha256(other) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.safetensors", "other.safetensors",
                                                          "pack"]   # no leftovers
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    with pytest.raises(PackError, match="not a pack"):
        build_pack(mine, junk, (64, 64), "fp32", overwrite=True)
    assert (junk / "notes.txt").read_text() == "mine"


def test_bad_arguments(tiny_dit, tmp_path):
    with pytest.raises(ValueError, match="resolution width"):
        build_pack(tiny_dit, tmp_path / "p", (100, 64))
    with pytest.raises(ValueError, match="dtype"):
        build_pack(tiny_dit, tmp_path / "p", (64, 64), "bf16")
    with pytest.raises(ValueError, match="not an Anima DiT|cannot open|no such"):
        build_pack(tmp_path / "missing.safetensors", tmp_path / "p", (64, 64))
    assert not (tmp_path / "p").exists()
    assert KINDS == ("self", "cross", "ffn")


def test_cli_pack(tiny_dit, tmp_path, capsys):
    from models.commands import cli
    out = tmp_path / "p"
    assert cli.main(["pack", str(tiny_dit), "--out", str(out), "--resolution", "64x32", "--dtype", "fp32"]) == 0
    assert "64x32 (latent 4x8, 8 image tokens" in capsys.readouterr().out
    assert load_pack(out).dtype == "fp32"
    assert cli.main(["pack", str(tiny_dit), "--out", str(tmp_path / "q"), "--resolution", "64by32"]) == 2
    assert "expected WIDTHxHEIGHT" in capsys.readouterr().err
    (tmp_path / "te.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b'{"a":1}' + b" ")
    assert cli.main(["pack", str(tmp_path / "te.safetensors"), "--out", str(tmp_path / "q")]) == 2
    assert "te.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_identity_follows_what_the_pack_computes(pack16, tmp_path):
    """A copy elsewhere has the same id (a remote executor's copy passes the scheduler's check); a pack whose branch
    files differ (recorded sha256) has another."""
    copy = tmp_path / "copy"
    shutil.copytree(pack16, copy)
    a, b = load_pack(pack16), load_pack(copy)
    assert a.identity == b.identity and len(a.identity) == 16
    man = json.loads((copy / MANIFEST).read_text())
    man["branches"][5]["sha256"] = "0" * 64
    (copy / MANIFEST).write_text(json.dumps(man))
    assert load_pack(copy, check=False).identity != a.identity


def test_manifest_accessors_pick_what_the_manifest_says(pack16, tmp_path):
    """models.records.manifest's typed accessors (the one reader the board model, the backends and doctor use) against the
    manifest read independently, and each refusal a ManifestError naming the file."""
    from models.records.manifest import (ManifestError, manifest_json, pack_shape_fields, peak_model_bytes,
                                 sharded_branches, toolkit_release)
    m = json.loads((pack16 / MANIFEST).read_text())
    assert manifest_json(pack16) == m
    assert pack_shape_fields(pack16) == (m["config"], m["geometry"], {})
    host = (pack16 / m["host"]["file"]).stat().st_size
    assert peak_model_bytes(pack16) == host + max(b["bytes"] for b in m["branches"])
    assert toolkit_release(pack16) is None and sharded_branches(pack16) == []
    bad = tmp_path / "bad"
    shutil.copytree(pack16, bad)
    for text, words in (("[1, 2]", "not a manifest"), ("{", "unreadable manifest"), ('{"rknn": {"toolkit": "2.5.0"}}',
                                                                                    "'config' is missing")):
        (bad / MANIFEST).write_text(text)
        with pytest.raises(ManifestError, match=words) as e:
            pack_shape_fields(bad)
        assert str(bad / MANIFEST) in str(e.value)
    assert toolkit_release(bad) == "2.5.0"
    with pytest.raises(ManifestError, match="no host file"):
        peak_model_bytes(bad)



@pytest.mark.parametrize("lie,words", [
    (lambda m: m["config"].__setitem__("width", m["config"]["width"] * 2), "inputs/outputs are not the ones"),
    (lambda m: m["config"].__setitem__("blocks", 1), "branch table does not list"),
    (lambda m: m.__setitem__("shards", {"n": 1e400}), "manifest field 'shards'"),
    (lambda m: m["geometry"].__setitem__("text_tokens", 1e400), "bad config/resolution"),
    (lambda m: m["branches"][0].pop("onnx"), "'branches\\[0\\].onnx' is missing"),
    (lambda m: m["branches"][0].__setitem__("rknn", {"sha256": "0" * 64}), "rknn: file name"),
])
def test_a_manifest_that_lies_or_lacks_is_a_pack_error(pack16, tmp_path, lie, words):
    """Reported: a config that lies about the widths loaded (every job then killed the scheduler); n = 1e400 escaped
    as OverflowError. Every such manifest is one PackError naming the manifest, with or without the file check."""
    bad = tmp_path / "bad"
    shutil.copytree(pack16, bad)
    m = json.loads((bad / MANIFEST).read_text())
    lie(m)
    (bad / MANIFEST).write_text(json.dumps(m).replace("Infinity", "1e400"))
    for check in (False, True):
        with pytest.raises(PackError, match=words) as e:
            load_pack(bad, check=check)
        assert str(bad / MANIFEST) in str(e.value)


def test_host_weights_that_disagree_with_the_config_are_refused(pack16, tmp_path):
    """The host weights' header against the config (a host file of another model's widths under a true manifest)."""
    from models.base.safetensors_io import TensorEntry, write_safetensors
    bad = tmp_path / "bad"
    shutil.copytree(pack16, bad)
    m = json.loads((bad / MANIFEST).read_text())
    host = bad / m["host"]["file"]
    f = SafeTensorsFile(host)
    entries = [TensorEntry(k, "F32", tuple(f.shape(k)), f.get(k)) for k in f.keys()]
    k0 = entries[0].name
    entries[0] = TensorEntry(k0, "F32", (1, 1), np.zeros((1, 1), np.float32))
    write_safetensors(host, entries)
    with pytest.raises(PackError, match=f"holds {k0} as \\[1, 1\\]"):
        load_pack(bad, check=False)
