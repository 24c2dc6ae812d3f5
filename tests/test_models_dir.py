"""Models folder resolution (ComfyUI layout, overrides, clear messages) and the synthetic tiny bundle."""
from __future__ import annotations

import os

import pytest

from models.setup.models_dir import ModelPaths, ModelsDirError, PART_NAMES, bundle_complete, resolve_models, write_bundle


def _touch(p, data=b"x"):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def make_folder(root):
    """A ComfyUI-like folder with one file per part (contents are not read by resolution)."""
    _touch(root / "diffusion_models" / "anima-preview.safetensors")
    _touch(root / "text_encoders" / "qwen_3_06b_base.safetensors")
    _touch(root / "vae" / "qwen_image_vae.safetensors")
    _touch(root / "tokenizers" / "qwen" / "vocab.json")
    _touch(root / "tokenizers" / "qwen" / "merges.txt")
    _touch(root / "tokenizers" / "t5" / "spiece.model")
    return root


def test_resolves_every_part(tmp_path):
    root = make_folder(tmp_path / "models")
    paths = resolve_models(root)
    assert paths.dit == (root / "diffusion_models" / "anima-preview.safetensors").resolve()
    assert paths.text_encoder.name == "qwen_3_06b_base.safetensors"
    assert paths.vae.name == "qwen_image_vae.safetensors"
    assert paths.qwen_tokenizer == (root / "tokenizers" / "qwen").resolve()
    assert paths.t5_tokenizer == (root / "tokenizers" / "t5").resolve()


def test_missing_parts_are_all_named_with_their_flags(tmp_path):
    root = tmp_path / "models"
    _touch(root / "diffusion_models" / "anima.safetensors")
    (root / "text_encoders").mkdir()
    with pytest.raises(ModelsDirError) as e:
        resolve_models(root)
    msg = str(e.value)
    assert "text_encoders/ has no *.safetensors" in msg and "--text-encoder" in msg
    assert "vae/ is missing" in msg and "--vae" in msg
    assert "tokenizers/qwen/ is missing" in msg and "--qwen-tokenizer" in msg
    assert "tokenizers/t5/" in msg and "--t5-tokenizer" in msg
    assert "diffusion_models" not in msg


def test_ambiguous_lists_candidates_and_flag(tmp_path):
    root = make_folder(tmp_path / "models")
    _touch(root / "vae" / "sub" / "qwen_image_vae_fp8.safetensors")
    with pytest.raises(ModelsDirError) as e:
        resolve_models(root)
    msg = str(e.value)
    assert "vae/ holds 2 candidates" in msg and "qwen_image_vae.safetensors" in msg
    assert os.path.join("sub", "qwen_image_vae_fp8.safetensors") in msg and "--vae FILE" in msg


def test_several_candidates_one_named_like_the_part_is_taken(tmp_path):
    root = make_folder(tmp_path / "models")
    _touch(root / "diffusion_models" / "flux1-dev.safetensors")
    _touch(root / "diffusion_models" / "wan2.1.safetensors")
    assert resolve_models(root).dit.name == "anima-preview.safetensors"
    _touch(root / "diffusion_models" / "anima-base-v1.0.safetensors")
    with pytest.raises(ModelsDirError, match="holds 4 candidates.*--dit FILE"):
        resolve_models(root)


def test_overrides_win_and_are_checked(tmp_path):
    root = make_folder(tmp_path / "models")
    _touch(root / "diffusion_models" / "anima-base-v1.0.safetensors")   # now ambiguous in the folder
    mine = _touch(tmp_path / "elsewhere" / "my-anima.safetensors")
    paths = resolve_models(root, {"dit": mine, "vae": None})
    assert paths.dit == mine.resolve() and paths.vae.name == "qwen_image_vae.safetensors"
    with pytest.raises(ModelsDirError, match="--vae .*nope.safetensors: no such file"):
        resolve_models(root, {"dit": mine, "vae": tmp_path / "nope.safetensors"})
    empty = tmp_path / "tok"
    empty.mkdir()
    with pytest.raises(ModelsDirError, match="--t5-tokenizer .*tok: the folder has no tokenizer.json or spiece.model"):
        resolve_models(root, {"dit": mine, "t5_tokenizer": empty})
    with pytest.raises(ValueError, match="unknown model part"):
        resolve_models(root, {"unet": mine})


def test_need_subset_and_no_folder(tmp_path):
    vae = _touch(tmp_path / "v.safetensors")
    paths = resolve_models(None, {"vae": vae}, need=("vae",))
    assert paths.vae == vae.resolve() and paths.dit is None
    with pytest.raises(ModelsDirError, match="give --models DIR or --dit FILE"):
        resolve_models(None, need=("dit",))
    with pytest.raises(ModelsDirError, match="no such folder"):
        resolve_models(tmp_path / "absent")


def test_bundle_writes_a_complete_loadable_folder(tiny_bundle, tmp_path):
    import shutil
    from models.dit.config import PRESETS
    from models.dit.checkpoint import DiTCheckpoint
    from models.setup.models_dir import bundle_paths
    from models.base.safetensors_io import SafeTensorsFile

    paths = bundle_paths("tiny", tiny_bundle)
    assert bundle_complete("tiny", 0, tiny_bundle) and not bundle_complete("tiny", 1, tiny_bundle)
    assert resolve_models(tiny_bundle) == ModelPaths(**{n: getattr(paths, n).resolve() for n in PART_NAMES})
    ck = DiTCheckpoint.open(paths.dit)
    assert ck.config == PRESETS["tiny"]["dit"]
    te = SafeTensorsFile(paths.text_encoder)
    assert all(k.startswith("model.") for k in te.keys()) and "model.embed_tokens.weight" in te
    vae = SafeTensorsFile(paths.vae)
    assert "decoder.conv1.weight" in vae and "conv2.weight" in vae
    # idempotent: a second call leaves the files alone
    before = {n: getattr(paths, n).stat().st_mtime_ns for n in ("dit", "text_encoder", "vae")}
    assert write_bundle("tiny", 0, tiny_bundle) == paths
    assert {n: getattr(paths, n).stat().st_mtime_ns for n in before} == before
    # a truncated part or a missing tokenizer file makes a copy of the bundle incomplete
    copy = tmp_path / "copy"
    shutil.copytree(tiny_bundle, copy)
    assert bundle_complete("tiny", 0, copy)
    with open(bundle_paths("tiny", copy).vae, "r+b") as f:
        f.truncate(100)
    assert not bundle_complete("tiny", 0, copy)
    shutil.rmtree(copy)
    shutil.copytree(tiny_bundle, copy)
    (copy / "tokenizers" / "t5" / "spiece.model").unlink()
    (copy / "tokenizers" / "t5" / "tokenizer.json").unlink()
    assert not bundle_complete("tiny", 0, copy)


def test_bundle_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        write_bundle("huge", 0, tmp_path)
    with pytest.raises(ValueError, match="seed"):
        write_bundle("tiny", -1, tmp_path)


def test_argparse_helpers(tmp_path):
    import argparse
    from models.setup.models_dir import add_model_arguments, paths_from_args
    root = make_folder(tmp_path / "models")
    other = _touch(tmp_path / "v2.safetensors")
    p = argparse.ArgumentParser()
    add_model_arguments(p, parts=("vae", "dit"))
    args = p.parse_args(["--models", str(root), "--vae", str(other)])
    paths = paths_from_args(args, need=("vae", "dit"))
    assert paths.vae == other.resolve() and paths.dit.name == "anima-preview.safetensors" and paths.t5_tokenizer is None
    with pytest.raises(SystemExit):
        p.parse_args(["--t5-tokenizer", "x"])                  # only the parts asked for get flags
