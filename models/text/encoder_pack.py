"""Encoder packs: the text encoder (Qwen3 + LLM adapter) exported once on the host for ONNX Runtime on the board.

    PACK/manifest.json                   schema, kind, sources (sha256 of the text encoder and the DiT), configs,
                                         every file with its sha256, the tokenizer check, tool versions; per graph
                                         its weights {key: [initializer, data offset, shape, transposed]} (LoRA)
    PACK/qwen3.onnx + qwen3.onnx.data    input_ids [S] i64 -> hidden [S, hidden] f32        (FP32)
    PACK/adapter.onnx + adapter.onnx.data  t5_ids [T] i64, source [S, source_dim] f32 -> rows [T, width] f32
    PACK/tokenizers/qwen/tokenizer.json  the Qwen2 BPE tokenizer (built from vocab.json + merges.txt when needed)
    PACK/tokenizers/t5/tokenizer.json    the T5 tokenizer (converted from spiece.model when needed: the board has
                                         no sentencepiece)

Building (`anima-models export-encoder`) needs onnx (and transformers to convert a spiece.model); loading needs only
json, hashlib and msgspec (models/records/manifest.py): the board reads packs without torch, transformers or onnx.
"""
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from models.base.durable import atomic_write, building_folder
from models.records.manifest import (MANIFEST, FileEntry, ManifestRecord, check_files, existing_sources, file_sha256,
                             manifest_header, read_manifest, source_entry, write_manifest)
from models.base.schema import Int

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
PACK_KIND = "anima-encoder-pack"
QWEN3_ONNX, ADAPTER_ONNX = "qwen3.onnx", "adapter.onnx"
QWEN_TOKENIZER, T5_TOKENIZER = "tokenizers/qwen/tokenizer.json", "tokenizers/t5/tokenizer.json"
# Prompts the exported tokenizers must turn into the same ids as the source files (plus generated corpus lines).
CHECK_PROMPTS = ("1girl, solo, (blue eyes:1.2), long hair", "", " ", "Kanaru 日本 猫 é — 1234\n\nnext line",
                 "it's don't we'll", "  spaced   out  ", "score_9, newest, (masterpiece:1.3), \\(escaped\\)",
                 "ünïcödé ÀÉÎ ñ ß ø 中文字符 한국어 😀", "a\tb\r\nc",
                 "UPPER lower MiXeD 3.14 -2e5 #tag @user",
                 "x" * 300, "girl, " * 40)


class EncoderPackError(ValueError):
    """A missing, incomplete or altered encoder pack; the message names the folder and the file."""


Width = Int(1, 1 << 20)


class Qwen3Entry(ManifestRecord, frozen=True):
    vocab: Width
    hidden: Width


class AdapterEntry(ManifestRecord, frozen=True):
    vocab: Width
    width: Width
    source_dim: Width


class EncoderManifest(ManifestRecord, frozen=True):
    """An encoder pack's manifest (the fields load_encoder_pack reads)."""
    schema: int
    qwen3: Qwen3Entry
    adapter: AdapterEntry
    files: list[FileEntry]


@dataclass(frozen=True)
class EncoderPack:
    dir: Path
    manifest: dict

    def _file(self, rel: str) -> Path:
        return self.dir / rel

    @property
    def qwen3_onnx(self) -> Path:
        return self._file(QWEN3_ONNX)

    @property
    def adapter_onnx(self) -> Path:
        return self._file(ADAPTER_ONNX)

    @property
    def qwen_tokenizer(self) -> Path:
        return self._file(QWEN_TOKENIZER).parent

    @property
    def t5_tokenizer(self) -> Path:
        return self._file(T5_TOKENIZER).parent

    @property
    def qwen_vocab(self) -> int:
        return int(self.manifest["qwen3"]["vocab"])

    @property
    def source_dim(self) -> int:
        return int(self.manifest["qwen3"]["hidden"])

    @property
    def adapter_vocab(self) -> int:
        return int(self.manifest["adapter"]["vocab"])

    @property
    def context_dim(self) -> int:
        return int(self.manifest["adapter"]["width"])


# -- building (host) --------------------------------------------------------------------------------------------------
def _write_qwen_tokenizer(src_dir: str, dst: Path) -> None:
    from models.text.tokenizers import qwen_tokenizer_json_from_bpe_files
    src = Path(src_dir) / "tokenizer.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        shutil.copyfile(src, dst)
    else:
        atomic_write(dst, qwen_tokenizer_json_from_bpe_files(src_dir))


def _write_t5_tokenizer(src: str, dst: Path) -> str:
    """tokenizer.json of the T5 tokenizer at `src` (a file or a folder): copied, or converted from spiece.model by
    transformers (as the Hugging Face T5 repositories ship it). -> "copied" | "converted from spiece.model"."""
    from models.text.tokenizers import T5Tokenizer
    source = T5Tokenizer(src).source                   # the file the torch path reads (tokenizer.json preferred)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if source.endswith(".json"):
        shutil.copyfile(source, dst)
        return "copied"
    from transformers import T5TokenizerFast
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(source, os.path.join(tmp, "spiece.model"))
        T5TokenizerFast.from_pretrained(tmp, extra_ids=100).save_pretrained(os.path.join(tmp, "out"))
        shutil.copyfile(os.path.join(tmp, "out", "tokenizer.json"), dst)
    return "converted from spiece.model"


def check_tokenizers(src_qwen: str, src_t5: str, pack_dir: Path, prompts) -> dict:
    """The pack's tokenizers give the source files' ids for every prompt (Qwen and T5); EncoderPackError if not."""
    from models.text.tokenizers import load_tokenizers
    a = load_tokenizers(src_qwen, src_t5)
    b = load_tokenizers(str((pack_dir / QWEN_TOKENIZER).parent), str(pack_dir / T5_TOKENIZER))
    n = 0
    for text in prompts:
        for name, x, y in (("Qwen", a[0], b[0]), ("T5", a[1], b[1])):
            if x.encode(text) != y.encode(text):
                raise EncoderPackError(f"the exported {name} tokenizer gives other ids than {x.source} for "
                                       f"{text[:60]!r}: {y.encode(text)[:12]} vs {x.encode(text)[:12]}")
            n += 1
    if a[0].pad_id != b[0].pad_id:
        raise EncoderPackError(f"the exported Qwen tokenizer's pad id {b[0].pad_id} differs from {a[0].pad_id}")
    return {"prompts": len(prompts), "comparisons": n, "equal": True, "source_t5": a[1].source,
            "source_qwen": a[0].source}


def build_encoder_pack(text_encoder, dit, qwen_tokenizer, t5_tokenizer, out_dir, overwrite: bool = False,
                       check_prompts=None) -> Path:
    """Export Qwen3 + the adapter to ONNX (FP32) and the tokenizers to tokenizer.json in `out_dir`.

    Built in a temporary sibling folder renamed into place when complete; a pack of other source files is replaced
    only with `overwrite`."""
    from models.base.safetensors_io import SafeTensorsFile
    from models.text import adapter as adapter_mod
    from models.text import qwen3 as qwen3_mod
    from models.text.onnx_graphs import OPSET, build_adapter, build_qwen3

    t0 = time.perf_counter()
    out = Path(out_dir).absolute()
    te_path, dit_path = os.fspath(text_encoder), os.fspath(dit)
    st = SafeTensorsFile(te_path)
    shape = qwen3_mod.detect_shape(te_path, st)
    cfg, _, get_adapter = adapter_mod.adapter_tensors(dit_path)
    if cfg.source_dim != shape.hidden:
        raise ValueError(f"text encoder {te_path} has hidden size {shape.hidden} but the LLM adapter in {dit_path} "
                         f"expects {cfg.source_dim}: mismatched files")
    sources = {"text_encoder": source_entry(te_path), "dit": source_entry(dit_path),
               "qwen_tokenizer": source_entry(qwen_tokenizer), "t5_tokenizer": source_entry(t5_tokenizer)}
    prev = existing_sources(out, EncoderPackError, "sources.text_encoder", "sources.dit")
    want = (sources["text_encoder"]["sha256"], sources["dit"]["sha256"])
    if prev is not None and tuple(prev) != want and not overwrite:
        raise EncoderPackError(f"{out}: holds an encoder pack of other files; pass overwrite (--overwrite) to "
                               "replace it")
    if check_prompts is None:
        from models.text.synth import training_corpus
        check_prompts = list(CHECK_PROMPTS) + training_corpus(200, seed=7)
    with building_folder(out) as tmp:
        # 1) tokenizers as tokenizer.json, checked against the source files
        _write_qwen_tokenizer(os.fspath(qwen_tokenizer), tmp / QWEN_TOKENIZER)
        t5_how = _write_t5_tokenizer(os.fspath(t5_tokenizer), tmp / T5_TOKENIZER)
        tok_check = check_tokenizers(os.fspath(qwen_tokenizer), os.fspath(t5_tokenizer), tmp, check_prompts)
        tok_check["t5"] = t5_how
        # 2) the graphs, weights streamed tensor by tensor into the external data files
        qwen_weights = build_qwen3(st.get, shape, tmp / QWEN3_ONNX, qwen3_mod.ROPE_THETA, qwen3_mod.RMS_EPS)
        log.info("export-encoder: %s written (%d layers)", QWEN3_ONNX, shape.layers)
        adapter_weights = build_adapter(get_adapter, cfg, tmp / ADAPTER_ONNX, adapter_mod.ROPE_THETA,
                                        adapter_mod.RMS_EPS)
        # 3) the manifest, last
        files = [QWEN3_ONNX, QWEN3_ONNX + ".data", ADAPTER_ONNX, ADAPTER_ONNX + ".data", QWEN_TOKENIZER, T5_TOKENIZER]
        manifest = {
            **manifest_header(PACK_KIND, SCHEMA_VERSION),
            "sources": sources,
            "qwen3": {**shape.__dict__, "rope_theta": qwen3_mod.ROPE_THETA, "rms_eps": qwen3_mod.RMS_EPS},
            "adapter": {**cfg.to_dict(), "rope_theta": adapter_mod.ROPE_THETA, "rms_eps": adapter_mod.RMS_EPS},
            "dtype": "fp32", "opset": OPSET, "graphs": _graph_entries(shape, cfg, qwen_weights, adapter_weights),
            "tokenizers": {"qwen": QWEN_TOKENIZER, "t5": T5_TOKENIZER, "check": tok_check},
            "files": [{"file": f, "sha256": file_sha256(tmp / f), "bytes": (tmp / f).stat().st_size} for f in files],
        }
        write_manifest(tmp, manifest)
    log.info("encoder pack %s: Qwen3 %d layers + adapter %d blocks, %.1f MB, built in %.1f s", out, shape.layers,
             cfg.blocks, sum(f["bytes"] for f in manifest["files"]) / 1e6, time.perf_counter() - t0)
    return out


def _graph_entries(shape, cfg, qwen_weights: dict, adapter_weights: dict) -> dict:
    """The manifest's `graphs`: each ONNX file, its inputs and outputs, and the weights it holds (LoRAs merge them)."""
    return {"qwen3": {"onnx": QWEN3_ONNX, "inputs": [["input_ids", "i64", ["S"]]],
                      "outputs": [["hidden", "f32", ["S", shape.hidden]]], "weights": qwen_weights},
            "adapter": {"onnx": ADAPTER_ONNX,
                        "inputs": [["t5_ids", "i64", ["T"]], ["source", "f32", ["S", cfg.source_dim]]],
                        "outputs": [["rows", "f32", ["T", cfg.width]]], "weights": adapter_weights}}


# -- loading (board) --------------------------------------------------------------------------------------------------
def load_encoder_pack(pack_dir, check: bool = True) -> EncoderPack:
    """Read an encoder pack's manifest; with `check`, every file must exist with its recorded sha256."""
    d = Path(pack_dir).absolute()
    m, rec = read_manifest(d, EncoderManifest, EncoderPackError, what="encoder pack", kind=PACK_KIND,
                           schema=SCHEMA_VERSION, hint=" (make one with `anima-models export-encoder`)",
                           rebuild="export it again")
    mpath = d / MANIFEST
    if rec.qwen3.hidden != rec.adapter.source_dim:
        raise EncoderPackError(f"{mpath}: Qwen3 hidden {rec.qwen3.hidden} != adapter source_dim "
                               f"{rec.adapter.source_dim}")
    need = {QWEN3_ONNX, ADAPTER_ONNX, QWEN_TOKENIZER, T5_TOKENIZER}
    missing_entries = need - {f.file for f in rec.files}
    if missing_entries:
        raise EncoderPackError(f"{mpath}: the manifest lists no {sorted(missing_entries)}")
    check_files(d, [(f.file, f.sha256, f.bytes) for f in rec.files], EncoderPackError, hashes=check,
                hint="; export it again")
    return EncoderPack(d, m)
