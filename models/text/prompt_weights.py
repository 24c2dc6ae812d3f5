"""Prompt weight syntax: `(text:1.2)`, `(text)` (x1.1), nesting (weights multiply), `\\(` `\\)` escapes -> weighted chunks.

Rules (the common Stable-Diffusion UI syntax, as ComfyUI reads it):
- `(text)` multiplies the weight of `text` by 1.1; `(text:W)` multiplies it by W (a plain decimal number, e.g. 1.2,
  .5, 2, 1e-1; the last `:W` at the end of the group's own text). Nested groups multiply: `((a):2)` gives a 2.2.
- `\\(` and `\\)` are literal parentheses; any other backslash is literal.
- Unbalanced brackets never fail: a `)` without a matching `(` and a `(` that is never closed are kept as literal
  characters, and the text after an unclosed `(` keeps the weight of the level it is in.
- `(text:abc)` (not a number) is a x1.1 group whose text is `text:abc`.
Adjacent chunks with the same weight are merged; empty chunks are dropped. The clean text (all chunks joined) is what
the Qwen3 encoder sees (its weights are all 1.0, as in the reference); the T5 ids are made chunk by chunk and each
T5 token takes its chunk's weight (the EOS token gets 1.0).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Tuple

PAREN_WEIGHT = 1.1
_WEIGHT_RE = re.compile(r":\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*$", re.S)
_OPEN, _CLOSE = "open", "close"


@dataclass(frozen=True)
class Chunk:
    text: str
    weight: float


def _lex(prompt: str) -> list:
    """Items: ("text", ch) for literal characters (escapes resolved), ("open"|"close", None) for brackets."""
    items, i = [], 0
    while i < len(prompt):
        ch = prompt[i]
        if ch == "\\" and i + 1 < len(prompt) and prompt[i + 1] in "()":
            items.append(("text", prompt[i + 1]))
            i += 2
            continue
        items.append((_OPEN, None) if ch == "(" else (_CLOSE, None) if ch == ")" else ("text", ch))
        i += 1
    # Match brackets; unmatched ones become literal characters.
    stack, matched = [], set()
    for n, (kind, _) in enumerate(items):
        if kind == _OPEN:
            stack.append(n)
        elif kind == _CLOSE and stack:
            matched.update((stack.pop(), n))
    return [it if it[0] == "text" or n in matched else ("text", "(" if it[0] == _OPEN else ")")
            for n, it in enumerate(items)]


def _build(items: list) -> list:
    """Nested lists: a group is a list whose elements are strings or groups."""
    root: list = []
    stack = [root]
    for kind, ch in items:
        if kind == _OPEN:
            g: list = []
            stack[-1].append(g)
            stack.append(g)
        elif kind == _CLOSE:
            stack.pop()
        elif stack[-1] and isinstance(stack[-1][-1], str):
            stack[-1][-1] += ch
        else:
            stack[-1].append(ch)
    return root


def _flatten(group: list, weight: float, out: list) -> None:
    for el in group:
        if isinstance(el, str):
            out.append(Chunk(el, weight))
            continue
        factor = PAREN_WEIGHT
        if el and isinstance(el[-1], str):
            m = _WEIGHT_RE.search(el[-1])
            if m:
                factor = float(m.group(1))
                el = el[:-1] + [el[-1][: m.start()]]
        _flatten(el, weight * factor, out)


def parse_weights(prompt: str) -> List[Chunk]:
    """Prompt -> weighted chunks in order (adjacent equal weights merged, empty chunks dropped)."""
    raw: List[Chunk] = []
    _flatten(_build(_lex(prompt)), 1.0, raw)
    out: List[Chunk] = []
    for c in raw:
        if not c.text:
            continue
        if out and out[-1].weight == c.weight:
            out[-1] = Chunk(out[-1].text + c.text, c.weight)
        else:
            out.append(c)
    return out


def clean_text(chunks: List[Chunk]) -> str:
    """The prompt without weight syntax (what the Qwen3 encoder reads)."""
    return "".join(c.text for c in chunks)


def t5_ids_and_weights(chunks: List[Chunk], t5) -> Tuple[List[int], List[float]]:
    """T5 ids (chunk by chunk, EOS appended) and one weight per id. Empty prompt -> ([eos], [1.0])."""
    ids: List[int] = []
    weights: List[float] = []
    for c in chunks:
        part = t5.encode(c.text)
        ids += part
        weights += [float(c.weight)] * len(part)
    return ids + [t5.eos_id], weights + [1.0]
