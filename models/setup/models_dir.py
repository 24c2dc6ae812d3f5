"""ComfyUI-style models folder: find the DiT, text encoder, VAE and tokenizers in it; write the synthetic tiny bundle.

Layout (what ComfyUI users already have, plus two tokenizer folders):
    MODELS/diffusion_models/*.safetensors     DiT + LLM adapter (anima-*.safetensors)
    MODELS/text_encoders/*.safetensors        Qwen3-0.6B-Base (qwen_3_06b_base.safetensors)
    MODELS/vae/*.safetensors                  Qwen-Image VAE (qwen_image_vae.safetensors)
    MODELS/tokenizers/qwen/                   vocab.json + merges.txt, or tokenizer.json
    MODELS/tokenizers/t5/                     spiece.model, or tokenizer.json
    MODELS/loras/**/*.safetensors             LoRAs, chosen per job by their name under loras/ (as ComfyUI's)
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from models.base.lazy import import_target
from models.base.durable import atomic_write

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    name: str          # ModelPaths field
    where: str         # folder under the models folder
    is_dir: bool       # a folder of files (tokenizers) rather than one .safetensors file
    flag: str          # the command-line override that picks it
    hint: str          # substring preferred when a folder holds several candidates
    what: str          # words for messages


# The layout as data: resolution, messages and the bundle writer all read this table.
PARTS = (
    Part("dit", "diffusion_models", False, "--dit", "anima", "Anima DiT checkpoint"),
    Part("text_encoder", "text_encoders", False, "--text-encoder", "qwen_3_06b", "Qwen3 text encoder"),
    Part("vae", "vae", False, "--vae", "qwen_image_vae", "Qwen-Image VAE"),
    Part("qwen_tokenizer", "tokenizers/qwen", True, "--qwen-tokenizer", "", "Qwen2 tokenizer folder"),
    Part("t5_tokenizer", "tokenizers/t5", True, "--t5-tokenizer", "", "T5 tokenizer folder"),
)
PART_NAMES = tuple(p.name for p in PARTS)
TOKENIZER_FILES = {"qwen_tokenizer": (("tokenizer.json",), ("vocab.json", "merges.txt")),
                   "t5_tokenizer": (("tokenizer.json",), ("spiece.model",))}

BUNDLE_VERSION = 1
STAMP = "anima-bundle.json"
BUNDLE_FILES = {"dit": "diffusion_models/anima-{preset}.safetensors",
                "text_encoder": "text_encoders/qwen_3_06b_base-{preset}.safetensors",
                "vae": "vae/qwen_image_vae-{preset}.safetensors",
                "qwen_tokenizer": "tokenizers/qwen", "t5_tokenizer": "tokenizers/t5"}


class ModelsDirError(ValueError):
    """Something missing or ambiguous in a models folder; the message lists every problem and the flag that fixes it."""


@dataclass(frozen=True)
class ModelPaths:
    dit: Optional[Path] = None
    text_encoder: Optional[Path] = None
    vae: Optional[Path] = None
    qwen_tokenizer: Optional[Path] = None
    t5_tokenizer: Optional[Path] = None

    def to_dict(self) -> dict:
        return {n: None if getattr(self, n) is None else str(getattr(self, n)) for n in PART_NAMES}


def _tokenizer_ok(part: Part, path: Path) -> bool:
    return any(all((path / f).is_file() for f in group) for group in TOKENIZER_FILES[part.name])


def _tokenizer_needs(part: Part) -> str:
    return " or ".join("+".join(g) for g in TOKENIZER_FILES[part.name])


def _check_override(part: Part, value) -> tuple:
    path = Path(os.path.expanduser(os.fspath(value))).resolve()
    if part.is_dir:
        if not path.is_dir():
            return None, f"{part.flag} {value}: no such folder"
        if not _tokenizer_ok(part, path):
            return None, f"{part.flag} {value}: the folder has no {_tokenizer_needs(part)}"
    elif not path.is_file():
        return None, f"{part.flag} {value}: no such file"
    return path, None


def _find(part: Part, root: Path) -> tuple:
    folder = root / part.where
    if part.is_dir:
        if not folder.is_dir():
            return None, f"{part.where}/ is missing ({part.what}; or give {part.flag} DIR)"
        if not _tokenizer_ok(part, folder):
            return None, f"{part.where}/ has no {_tokenizer_needs(part)} (or give {part.flag} DIR)"
        return folder.resolve(), None
    if not folder.is_dir():
        return None, f"{part.where}/ is missing ({part.what}; or give {part.flag} FILE)"
    found = sorted(p for p in folder.rglob("*.safetensors") if p.is_file())
    if not found:
        return None, f"{part.where}/ has no *.safetensors file ({part.what}; or give {part.flag} FILE)"
    if len(found) > 1:
        preferred = [p for p in found if part.hint and part.hint in p.name.lower()]
        if len(preferred) == 1:
            log.info("%s/: %d files, taking %s (its name has %r)", part.where, len(found), preferred[0].name, part.hint)
            return preferred[0].resolve(), None
        names = ", ".join(str(p.relative_to(folder)) for p in found)
        return None, f"{part.where}/ holds {len(found)} candidates ({names}); pick one with {part.flag} FILE"
    return found[0].resolve(), None


def resolve_models(models_dir=None, overrides: Optional[dict] = None, need=PART_NAMES) -> ModelPaths:
    """Paths of the parts in `need` (all by default); explicit `overrides` {part: path} win over the folder.

    Raises ModelsDirError naming every missing or ambiguous part and the flag that picks it.
    """
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(overrides) - set(PART_NAMES)) + sorted(set(need) - set(PART_NAMES))
    if unknown:
        raise ValueError(f"unknown model part(s) {unknown}; known: {list(PART_NAMES)}")
    root = None
    if models_dir is not None:
        root = Path(os.path.expanduser(os.fspath(models_dir))).resolve()
        if not root.is_dir():
            raise ModelsDirError(f"models folder {models_dir}: no such folder")
    found, problems = {}, []
    for part in PARTS:
        if part.name not in need and part.name not in overrides:
            continue
        if part.name in overrides:
            path, err = _check_override(part, overrides[part.name])
        elif root is None:
            path, err = None, f"no {part.what}: give --models DIR or {part.flag} {'DIR' if part.is_dir else 'FILE'}"
        else:
            path, err = _find(part, root)
        if err:
            problems.append(err)
        found[part.name] = path
    if problems:
        where = f"models folder {root}" if root is not None else "models"
        raise ModelsDirError(f"{where}: " + "; ".join(problems))
    return ModelPaths(**found)


def add_model_arguments(parser, parts=PART_NAMES) -> None:
    """Add `--models DIR` and one override flag per part in `parts` to an argparse parser (for commands and stages)."""
    parser.add_argument("--models", default=None, metavar="DIR",
                        help="ComfyUI-style models folder (diffusion_models/, text_encoders/, vae/, tokenizers/)")
    for part in PARTS:
        if part.name in parts:
            parser.add_argument(part.flag, dest=part.name, default=None, metavar="DIR" if part.is_dir else "FILE",
                                help=f"{part.what} (overrides the one in --models)")


def paths_from_args(args, need=PART_NAMES) -> ModelPaths:
    """resolve_models() from what add_model_arguments() parsed."""
    overrides = {n: getattr(args, n, None) for n in PART_NAMES}
    return resolve_models(getattr(args, "models", None), overrides, need)


# ---- LoRAs: chosen per job by name, under MODELS/loras/ -------------------------------------------------------------
LORAS_DIR = "loras"
LORA_SUFFIX = ".safetensors"
MAX_LORA_NAME = 255


def _lora_root(models_dir) -> Path:
    return Path(os.path.expanduser(os.fspath(models_dir))) / LORAS_DIR


def _name_ok(name) -> bool:
    return isinstance(name, str) and bool(name) and len(name) <= MAX_LORA_NAME and "\x00" not in name and \
        "\\" not in name


def _lora_file(top: Path, path: Path) -> tuple:
    """(the regular file `path` leads to inside `top` (loras/, resolved), links followed; or None, why not). Never
    raises: a name too long for the file system, a link loop or an unreadable folder is a reason like any other."""
    try:
        full = path.resolve(strict=True)
    except FileNotFoundError:
        return None, "missing"
    except RuntimeError:                              # Path.resolve's own "Symlink loop" (Python < 3.13)
        return None, "a symbolic link loop"
    except OSError as e:
        return None, {errno.ENAMETOOLONG: "too long a file name", errno.ELOOP: "a symbolic link loop",
                      errno.ENOTDIR: "missing"}.get(e.errno, "unreadable")
    if top not in full.parents:
        return None, f"a link that leads outside {LORAS_DIR}/"
    try:
        return (full, "") if full.is_file() else (None, "not a file")
    except OSError:
        return None, "unreadable"


def list_loras(models_dir) -> list:
    """The LoRAs of a models folder as ComfyUI lists them: paths under loras/ with '/', sorted ([] without one).
    Only names a job may use (lora_path takes them): no link that leads out of loras/ or loops, no name too long;
    linked folders are not walked (LoraListing keys on the folders themselves)."""
    if models_dir is None:
        return []
    root = _lora_root(models_dir)
    try:
        top = root.resolve(strict=True)
    except (OSError, RuntimeError):
        return []
    out = []
    for folder, _, files in os.walk(root):
        for f in files:
            rel = (Path(folder) / f).relative_to(root).as_posix()
            if f.endswith(LORA_SUFFIX) and _name_ok(rel) and _lora_file(top, root / rel)[0] is not None:
                out.append(rel)
    return sorted(out)


def lora_relative(models_dir, text: str) -> str:
    """`text` with the models folder's loras/ path (as configured and resolved) written as `loras/`: what a client
    is told names LoRAs as it names them, not the server's folders."""
    if models_dir is None:
        return text
    root = _lora_root(models_dir)
    for r in {str(root.resolve()), str(root)}:
        text = text.replace(r + os.sep, LORAS_DIR + "/").replace(r, LORAS_DIR + "/")
    return text


def lora_path(models_dir, name: str) -> Path:
    """The file a LoRA name means: `style.safetensors` or `sub/style.safetensors` under MODELS/loras/ (ComfyUI's
    names), or a bare `style` (A1111's: the file's stem, in any subfolder when only one has it). A name that is not a
    relative path inside loras/ (absolute, '..', a link that leads out or loops) is refused: a job may name LoRAs,
    not files. ModelsDirError naming the LoRAs there are when nothing matches; its texts name paths under loras/."""
    if not _name_ok(name):
        raise ModelsDirError(f"LoRA name {str(name)[:80]!r}: a relative path under {LORAS_DIR}/ like "
                             f"style{LORA_SUFFIX}, at most {MAX_LORA_NAME} characters")
    if models_dir is None:
        raise ModelsDirError(f"LoRA {name!r}: no models folder is configured: set models_dir in pipeline.toml to a "
                             f"folder whose {LORAS_DIR}/ holds the LoRAs")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise ModelsDirError(f"LoRA {name!r}: names a file outside {LORAS_DIR}/ (LoRAs are named by their path "
                             f"under {LORAS_DIR}/)")
    root = _lora_root(models_dir)
    try:
        top = root.resolve(strict=True)
    except (OSError, RuntimeError):
        raise ModelsDirError(f"LoRA {name!r}: the models folder has no {LORAS_DIR}/ folder") from None
    candidates = [rel] if name.endswith(LORA_SUFFIX) else [Path(name + LORA_SUFFIX)]
    for c in candidates:
        full, why = _lora_file(top, root / c)
        if full is not None:
            return full
        if why not in ("missing", "not a file"):
            raise ModelsDirError(f"LoRA {name!r}: {LORAS_DIR}/{c.as_posix()} is {why}")
    if "/" not in name and not name.endswith(LORA_SUFFIX):             # A1111: the stem, wherever it is
        hits = [p for p in list_loras(models_dir) if Path(p).stem == name]
        if len(hits) == 1:
            return lora_path(models_dir, hits[0])
        if len(hits) > 1:
            raise ModelsDirError(f"LoRA {name!r} is ambiguous: {', '.join(hits)}; name one with its folder")
    have = list_loras(models_dir)
    shown = ", ".join(have[:10]) + (f" ... ({len(have)} in all)" if len(have) > 10 else "")
    raise ModelsDirError(f"LoRA {name!r}: no such file in {LORAS_DIR}/" + (f"; there are: {shown}" if have else
                                                                          " (the folder is empty)"))


# ---- the embedded default: a complete synthetic models folder --------------------------------------------------------
def bundle_paths(preset: str, out_dir) -> ModelPaths:
    out = Path(out_dir)
    return ModelPaths(**{n: out / BUNDLE_FILES[n].format(preset=preset) for n in PART_NAMES})


def _stamp_for(preset: str, seed: int, paths: ModelPaths) -> dict:
    files = {}
    for n in ("dit", "text_encoder", "vae"):
        p = getattr(paths, n)
        files[BUNDLE_FILES[n].format(preset=preset)] = p.stat().st_size
    return {"bundle_version": BUNDLE_VERSION, "preset": preset, "seed": int(seed), "files": files}


def bundle_complete(preset: str, seed: int, out_dir) -> bool:
    """True when `out_dir` holds a finished bundle for (preset, seed): stamp matches, every file present, sizes agree."""
    out = Path(out_dir)
    try:
        stamp = json.loads((out / STAMP).read_text())
        paths = bundle_paths(preset, out)
        return (stamp == _stamp_for(preset, seed, paths)
                and all(_tokenizer_ok(p, getattr(paths, p.name)) for p in PARTS if p.is_dir))
    except (OSError, ValueError):
        return False


def _writer(target: str):
    return import_target(target)        # lazy: the bundle parts need torch/transformers


def write_bundle(preset: str, seed: int, out_dir) -> ModelPaths:
    """Write a complete models folder (synthetic DiT, text encoder, VAE, tokenizers) in the layout above.

    Idempotent: returns at once when a complete bundle for (preset, seed) is there. The stamp file is removed first
    and written last, so an interrupted write is redone next time. A lock file serialises concurrent writers.
    """
    from models.dit.config import PRESETS
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = bundle_paths(preset, out)
    with open(out / ".anima-bundle.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if bundle_complete(preset, seed, out):
            log.info("bundle %s (preset %s, seed %d) is complete; nothing to do", out, preset, seed)
            return paths
        (out / STAMP).unlink(missing_ok=True)
        for n in ("dit", "text_encoder", "vae"):
            getattr(paths, n).parent.mkdir(parents=True, exist_ok=True)
        log.info("writing bundle preset=%s seed=%d to %s", preset, seed, out)
        _writer("models.dit.synth:write_dit")(preset, seed, paths.dit, prefix="net.")
        _writer("models.text.synth:write_te")(preset, seed, paths.text_encoder)
        _writer("models.vae.synth:write_vae")(preset, seed, paths.vae, layout="original")
        _writer("models.text.synth:write_tokenizers")(preset, out / "tokenizers")
        atomic_write(out / STAMP, json.dumps(_stamp_for(preset, seed, paths), indent=1))
    return paths
