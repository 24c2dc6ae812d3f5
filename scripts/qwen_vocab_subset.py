"""A small Qwen2 BPE vocabulary that tokenizes given texts exactly as the full one does, with the real ids.

    .venv/bin/python scripts/qwen_vocab_subset.py --qwen DIR --texts texts.json --out tests/data/qwen_real_subset

DIR holds the real vocab.json + merges.txt (e.g. ComfyUI's comfy/text_encoders/qwen25_tokenizer). Every merge BPE
can apply while tokenizing a text makes a token that is a substring of one of the text's pre-tokens; keeping all
merges whose result is such a substring (in their original order) and the tokens they involve therefore gives the
same merges, in the same order, as the full vocabulary for these texts. The 256 byte tokens are always kept.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def substrings(pretokens) -> set:
    out = set()
    for p in pretokens:
        for i in range(len(p)):
            for j in range(i + 1, len(p) + 1):
                out.add(p[i:j])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen", required=True, help="folder with the real vocab.json and merges.txt")
    ap.add_argument("--texts", required=True, help="JSON list of the texts the subset must tokenize exactly")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import tokenizers as tk
    from models.text.tokenizers import QwenTokenizer

    full = QwenTokenizer(a.qwen)._tok
    texts = json.load(open(a.texts, encoding="utf-8"))
    norm = tk.normalizers.NFC()
    pre = [p for t in texts for p, _ in full.pre_tokenizer.pre_tokenize_str(norm.normalize_str(t))]
    keep = substrings(pre)
    vocab = json.load(open(os.path.join(a.qwen, "vocab.json"), encoding="utf-8"))
    byte_tokens = tk.pre_tokenizers.ByteLevel.alphabet()
    sub_vocab = {t: i for t, i in vocab.items() if t in keep or t in byte_tokens}
    merges = []
    with open(os.path.join(a.qwen, "merges.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if line and not line.startswith("#version"):
                left, right = line.split(" ")
                if left + right in keep and left in sub_vocab and right in sub_vocab:
                    merges.append(line)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(sub_vocab.items(), key=lambda kv: kv[1])), f, ensure_ascii=False, indent=0)
    with open(os.path.join(a.out, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(m + "\n" for m in merges))
    with open(os.path.join(a.out, "texts.json"), "w", encoding="utf-8") as f:
        json.dump(sorted(set(texts)), f, ensure_ascii=False, indent=0)
    print(f"{len(sub_vocab)} tokens, {len(merges)} merges for {len(set(texts))} texts -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
