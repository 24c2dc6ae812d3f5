"""The files a stage loads, found (or not) without starting it: the stage itself resolves them here before loading
(a missing one is its config exit), and the orchestrator asks the same question before spawning it, so a job whose
stage cannot start fails at once naming the file instead of after a process start, its imports and supervisord's
startsecs (seconds on a busy board, every job).

    paths = encoder_files(config)        # ModelPaths (torch backend) or the pack folder (onnx); ConfigError if not
    why = missing_files(config, "encoder")   # "" when the stage's files are there (stats and a folder listing)

Not cached: the look is a few stats, so a file put in place (or removed) is seen by the next job.
"""
from __future__ import annotations

import os
from pathlib import Path

from models.setup.models_dir import ModelsDirError, resolve_models
from stages.config import ConfigError, PipelineConfig

ENCODER_PARTS = ("dit", "text_encoder", "qwen_tokenizer", "t5_tokenizer")   # what the torch backend loads


def encoder_pack_path(config: PipelineConfig) -> Path:
    """The onnx backend's pack folder (relative: from the config file's folder)."""
    return (config.path.parent / os.path.expanduser(config.stage_settings("encoder")["pack"])).resolve()


def encoder_files(config: PipelineConfig):
    """[stage.encoder]'s model files: the torch backend's parts (models_dir and the per-part overrides) or the onnx
    backend's pack folder. ConfigError naming the missing part (and its path) otherwise."""
    settings = config.stage_settings("encoder")
    if settings["backend"] == "onnx":
        from models.text.encoder_pack import EncoderPackError, load_encoder_pack
        pack = encoder_pack_path(config)
        try:
            load_encoder_pack(pack, check=False)     # its manifest and files there (sizes; hashed when loading)
        except EncoderPackError as e:
            raise ConfigError(f"{config.path}: stage.encoder.pack: {e}") from None
        return pack
    overrides = {k: settings[k] for k in ENCODER_PARTS if k in settings}
    try:
        return resolve_models(config.models_dir, overrides, need=ENCODER_PARTS)
    except ModelsDirError as e:
        raise ConfigError(f"{config.path}: encoder: {e}") from None


CHECKS = {"encoder": encoder_files}       # stages whose files are looked for before a start


def missing_files(config: PipelineConfig, stage: str) -> str:
    """Why `stage` would exit at once for its files ("" when they are there, or the stage is not checked here)."""
    check = CHECKS.get(stage)
    if check is None:
        return ""
    try:
        check(config)
    except ConfigError as e:
        return str(e)
    return ""
