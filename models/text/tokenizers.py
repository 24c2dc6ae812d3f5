"""Qwen2 BPE and T5 v1.1 tokenizers loaded from user-supplied files (tokenizer.json, vocab.json+merges.txt,
spiece.model), and `PromptTokenizer.tokenize(prompt) -> TokenizedPrompt`: the ids and weights both encoders read,
segment by segment as ComfyUI makes them. No torch here: any compute backend of the text encoder calls this."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import List

from models.text.prompt_weights import parse_weights, segment_pieces

log = logging.getLogger(__name__)

QWEN_PAD_TOKEN = "<|endoftext|>"
QWEN_PAD_ID = 151643            # the id the real Qwen2 tokenizer gives "<|endoftext|>"
T5_PAD_ID, T5_EOS_ID, T5_UNK_ID = 0, 1, 2

# Qwen2's pre-tokenizer split (letters, single digits, punctuation runs, newlines, spaces), then byte-level mapping.
QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class TokenizerFilesError(ValueError):
    """Tokenizer files missing or unreadable; the message names the path and what was looked for."""


def _tokenizers():
    import tokenizers  # imported lazily: the DiT host path never needs it
    return tokenizers


def _read_json(path: str) -> object:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerFilesError(f"{path}: cannot read as JSON ({e})") from None


def _qwen_added_tokens(directory: str, vocab: dict) -> list:
    """Special tokens with explicit ids: from tokenizer_config.json's added_tokens_decoder, else <|endoftext|>=151643."""
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    added = []
    if os.path.isfile(cfg_path):
        cfg = _read_json(cfg_path)
        dec = cfg.get("added_tokens_decoder", {}) if isinstance(cfg, dict) else {}
        for sid, ent in dec.items():
            try:
                added.append({"id": int(sid), "content": str(ent["content"]), "special": bool(ent.get("special", True)),
                              "single_word": False, "lstrip": False, "rstrip": False, "normalized": False})
            except (KeyError, TypeError, ValueError):
                raise TokenizerFilesError(f"{cfg_path}: malformed added_tokens_decoder entry {sid!r}") from None
    if not any(a["content"] == QWEN_PAD_TOKEN for a in added) and QWEN_PAD_TOKEN not in vocab:
        if QWEN_PAD_ID in set(vocab.values()):
            raise TokenizerFilesError(f"{directory}: vocab.json uses id {QWEN_PAD_ID} for another token and "
                                      f"defines no {QWEN_PAD_TOKEN!r}")
        added.append({"id": QWEN_PAD_ID, "content": QWEN_PAD_TOKEN, "special": True, "single_word": False,
                      "lstrip": False, "rstrip": False, "normalized": False})
    return added


def qwen_tokenizer_json_from_bpe_files(directory: str) -> str:
    """A tokenizer.json document (string) equivalent to Qwen2's fast tokenizer, built from vocab.json + merges.txt."""
    vocab_path, merges_path = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    for p in (vocab_path, merges_path):
        if not os.path.isfile(p):
            raise TokenizerFilesError(f"Qwen tokenizer: {p} not found (need tokenizer.json, or vocab.json + merges.txt)")
    vocab = _read_json(vocab_path)
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerFilesError(f"{vocab_path}: expected a JSON object token -> id")
    merges = []
    with open(merges_path, "r", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line or line.startswith("#version"):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise TokenizerFilesError(f"{merges_path}:{n}: expected two tokens separated by one space")
            merges.append(parts)
    added = _qwen_added_tokens(directory, vocab)
    # Special tokens also go into the model's vocabulary at their ids: the tokenizers library would otherwise number
    # added tokens from the end of the vocabulary instead of using the ids the files give.
    vocab = dict(vocab)
    for a in added:
        vocab.setdefault(a["content"], a["id"])
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    return json.dumps(doc, ensure_ascii=False)


class QwenTokenizer:
    """Qwen2 byte-level BPE: raw prompt -> ids, no chat template, no BOS/EOS."""

    def __init__(self, directory: str):
        tk = _tokenizers()
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise TokenizerFilesError(f"Qwen tokenizer: {self.directory} is not a directory "
                                      "(expected one holding tokenizer.json, or vocab.json + merges.txt)")
        tj = os.path.join(self.directory, "tokenizer.json")
        try:
            if os.path.isfile(tj):
                self._tok = tk.Tokenizer.from_file(tj)
                self.source = tj
            else:
                self._tok = tk.Tokenizer.from_str(qwen_tokenizer_json_from_bpe_files(self.directory))
                self.source = os.path.join(self.directory, "vocab.json")
        except TokenizerFilesError:
            raise
        except Exception as e:  # the tokenizers library raises plain Exceptions on malformed files
            raise TokenizerFilesError(f"Qwen tokenizer in {self.directory}: cannot load ({e})") from None
        self._tok.no_truncation()
        self._tok.no_padding()
        pad = self._tok.token_to_id(QWEN_PAD_TOKEN)
        if pad is None:
            raise TokenizerFilesError(f"Qwen tokenizer {self.source}: no {QWEN_PAD_TOKEN!r} token (the pad token)")
        self.pad_id = int(pad)
        if self.pad_id != QWEN_PAD_ID:
            log.warning("Qwen tokenizer %s maps %s to %d (the real one uses %d)", self.source, QWEN_PAD_TOKEN,
                        self.pad_id, QWEN_PAD_ID)

    def encode(self, text: str) -> List[int]:
        """Token ids of the raw text; [] for the empty string."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class T5Tokenizer:
    """T5 v1.1 tokenizer (sentencepiece unigram): text -> ids without EOS; `encode_with_eos` appends id 1."""

    def __init__(self, path_or_dir: str):
        path = os.fspath(path_or_dir)
        self._sp = None
        self._tok = None
        if os.path.isdir(path):
            for name in ("tokenizer.json", "spiece.model"):
                if os.path.isfile(os.path.join(path, name)):
                    path = os.path.join(path, name)
                    break
            else:
                raise TokenizerFilesError(f"T5 tokenizer: {path} holds neither tokenizer.json nor spiece.model")
        elif not os.path.isfile(path):
            raise TokenizerFilesError(f"T5 tokenizer: {path} not found (give a tokenizer.json, a spiece.model or "
                                      "a directory holding one)")
        self.source = path
        try:
            if path.endswith(".json"):
                self._tok = _tokenizers().Tokenizer.from_file(path)
                self._tok.no_truncation()
                self._tok.no_padding()
                ids = {t: self._tok.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")}
                self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            else:
                import sentencepiece as spm
                self._sp = spm.SentencePieceProcessor(model_file=path)
                ids = {t: self._sp.piece_to_id(t) for t in ("<pad>", "</s>", "<unk>")}
                ids = {t: (i if self._sp.id_to_piece(i) == t else None) for t, i in ids.items()}
                self.vocab_size = self._sp.get_piece_size()
        except Exception as e:  # sentencepiece/tokenizers raise plain RuntimeError/Exception on bad files
            raise TokenizerFilesError(f"T5 tokenizer {path}: cannot load ({e})") from None
        want = {"<pad>": T5_PAD_ID, "</s>": T5_EOS_ID, "<unk>": T5_UNK_ID}
        for tok, wid in want.items():
            if ids[tok] != wid:
                raise TokenizerFilesError(f"T5 tokenizer {path}: {tok!r} has id {ids[tok]}, T5 v1.1 uses {wid}")
        self.eos_id = T5_EOS_ID

    def encode(self, text: str) -> List[int]:
        """Ids of `text` without EOS; [] for empty text."""
        if not text:
            return []
        if self._tok is not None:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        return list(self._sp.encode(text))

    def encode_with_eos(self, text: str) -> List[int]:
        return self.encode(text) + [self.eos_id]


def load_tokenizers(qwen_dir: str, t5_path_or_dir: str) -> tuple:
    """(QwenTokenizer, T5Tokenizer) from user files."""
    return QwenTokenizer(qwen_dir), T5Tokenizer(t5_path_or_dir)


@dataclass
class TokenizedPrompt:
    qwen_ids: List[int]         # each segment's ids, concatenated; [pad] for a prompt without tokens
    qwen_masked: bool           # True when qwen_ids is the single masked pad token (empty prompt)
    t5_ids: List[int]           # each segment's ids, concatenated, EOS (1) appended
    t5_weights: List[float]     # one per T5 id: its segment's weight; 1.0 for EOS
    segments: List[tuple]       # (text, weight) of every separately tokenized piece, in order


class PromptTokenizer:
    """Both tokenizers of the Anima text encoder; `tokenize(prompt)` gives what Qwen3 and the LLM adapter read.

    Qwen3 reads every segment's own tokenization, concatenated, all at weight 1.0; the LLM adapter reads the T5 ids of
    the same segments (each segment's ids without its EOS, one EOS at the end), each id at its segment's weight.
    """

    def __init__(self, qwen: QwenTokenizer, t5: T5Tokenizer):
        self.qwen, self.t5 = qwen, t5

    @classmethod
    def from_files(cls, qwen_dir: str, t5_path_or_dir: str) -> "PromptTokenizer":
        return cls(*load_tokenizers(qwen_dir, t5_path_or_dir))

    def tokenize(self, prompt: str) -> TokenizedPrompt:
        dropped: List[str] = []
        pieces = segment_pieces(parse_weights(prompt), dropped)
        for name in dropped:
            log.warning("embedding:%s: textual-inversion embeddings are not supported; the name is left out of the "
                        "prompt (what ComfyUI does when it has no such embedding file)", name)
        qwen_ids: List[int] = []
        t5_ids: List[int] = []
        t5_weights: List[float] = []
        for text, weight in pieces:
            qwen_ids += self.qwen.encode(text)
            part = self.t5.encode(text)
            t5_ids += part
            t5_weights += [float(weight)] * len(part)
        masked = not qwen_ids
        if masked:
            qwen_ids = [self.qwen.pad_id]
        elif self.qwen.pad_id in qwen_ids:
            log.warning("the prompt holds the Qwen pad token %s; ComfyUI masks it and every token after it in the "
                        "text encoder's attention, this project does not: the pictures will differ",
                        QWEN_PAD_TOKEN)
        return TokenizedPrompt(qwen_ids, masked, t5_ids + [self.t5.eos_id], t5_weights + [1.0], pieces)
