"""Prompt weight syntax -> weighted segments, cut exactly where ComfyUI's CLIPTextEncode cuts them.

The rules (facts about ComfyUI's prompt parser, with examples in docs/prompts.md):
1. Escapes: `\\(` and `\\)` are literal parentheses that take no part in grouping; every other backslash is literal.
2. Top-level split: the text is read left to right with a depth counter. An unescaped `(` at depth 0 ends the
   current piece (if it is not empty) and starts a new one; a `)` that brings the depth back to 0 closes the
   piece, which then begins with `(` and ends with `)`. Any other `(` / `)` is an ordinary character of the piece
   and still moves the depth. A `)` at depth 0 makes the depth -1: the rest of the text is then read with the
   counter off by one (so `a) (b)` is one plain piece). Whatever is left at the end is one more piece.
3. A piece of at least two characters that begins with `(` and ends with `)` is a group: its inner text gets
   1.1 x the surrounding weight, unless the inner text has a `:` at a position > 0 whose following text (after
   the LAST `:`) parses as a Python float: then that number REPLACES the weight (not multiplied) and the inner
   text ends before that `:`. The inner text is parsed again with these rules at the group's weight.
   `((a:2))` -> a 2.0; `((a):2)` -> a 2.2; `(x (y:1.5))` -> "x " 1.1, y 1.5; `(:2)` -> ":2" 1.1.
4. Every other piece is one segment at the surrounding weight. Empty groups `()` give nothing; segments are never
   merged with their neighbours, even at equal weight (each is tokenized on its own).
5. Inside each segment, every `embedding:` that follows a whitespace character (or starts the segment) begins a new
   piece. ComfyUI looks such a name up in its embeddings folder; this project has no textual-inversion
   embeddings, so it does what ComfyUI does for a name it cannot find: drop the name (the first whitespace-separated
   word, cut before any `<` or `[`, with a comma-stripping retry) and tokenize what follows it on its own.

Non-finite weights (`nan`, `inf`, which Python's float accepts) and `embedding:` without a name are errors here
(ComfyUI turns the first into a NaN picture and fails on the second). So is a segment weight beyond
±MAX_PROMPT_WEIGHT (ComfyUI takes any float; docs/prompts.md says why 100): `check_prompt` refuses it, while
`parse_weights` still gives ComfyUI's segments for any prompt.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterator, List, Optional

PAREN_WEIGHT = 1.1
# |weight| of a segment, explicit or from nesting (1.1 per level: 48 levels give 97.0, 49 give 106.7). The adapter's
# rows are RMS-normalised (each element at most sqrt(1024) = 32 x the norm's gain) and then multiplied by the weight:
# 100 keeps them finite in FP32 for any gain below 1e35, and within an FP16 branch input (65504) for gains up to 20,
# where `(a:1e39)` or 1000 nested parentheses overflowed float32 and made the context NaN/Inf.
MAX_PROMPT_WEIGHT = 100.0
EMBEDDING_PREFIX = "embedding:"
_EMBEDDING_START = re.compile(r"(?<=\s)" + re.escape(EMBEDDING_PREFIX))
_NAME_CUT = re.compile(r"[<\[]")

# Atoms: a character of the prompt, or one of the two unescaped brackets (escaped brackets are plain characters).
_OPEN, _CLOSE = object(), object()


class PromptWeightError(ValueError):
    """A prompt the weight syntax cannot give a usable conditioning for; the message names the part."""


@dataclass(frozen=True)
class Segment:
    """One weighted segment: tokenized on its own, every token of it at `weight`."""
    text: str
    weight: float


def _atoms(prompt: str) -> list:
    out, i, n = [], 0, len(prompt)
    while i < n:
        ch = prompt[i]
        if ch == "\\" and i + 1 < n and prompt[i + 1] in "()":
            out.append(prompt[i + 1])                  # escaped: a literal character, never a bracket
            i += 2
            continue
        out.append(_OPEN if ch == "(" else _CLOSE if ch == ")" else ch)
        i += 1
    return out


def _text(atoms: list) -> str:
    return "".join("(" if a is _OPEN else ")" if a is _CLOSE else a for a in atoms)


def _top_level_pieces(atoms: list) -> Iterator[list]:
    """Rule 2: pieces at depth 0, each either plain text or one bracketed group (brackets included)."""
    depth, piece = 0, []
    for a in atoms:
        if a is _OPEN:
            if depth == 0 and piece:
                yield piece
                piece = []
            piece.append(a)
            depth += 1
        elif a is _CLOSE:
            depth -= 1
            piece.append(a)
            if depth == 0:
                yield piece
                piece = []
        else:
            piece.append(a)
    if piece:
        yield piece


def _explicit_weight(inner: list):
    """Rule 3: (weight, text before the last ':') when the text after it is a float and the ':' is not first."""
    colon = max((i for i, a in enumerate(inner) if a == ":"), default=-1)
    if colon <= 0:
        return None
    tail = _text(inner[colon + 1:])
    try:
        w = float(tail)
    except ValueError:
        return None
    if not math.isfinite(w):
        raise PromptWeightError(f"weight {tail.strip()!r} in ({_text(inner)}) is not a finite number")
    return w, inner[:colon]


def parse_weights(prompt: str) -> List[Segment]:
    """Prompt -> weighted segments in prompt order (ComfyUI's cut; nothing merged)."""
    if not isinstance(prompt, str):
        raise PromptWeightError(f"prompt must be a string, got {type(prompt).__name__}")
    out: List[Segment] = []
    # A stack of (pieces still to read, weight of their level): deep nesting needs no recursion.
    stack = [(_top_level_pieces(_atoms(prompt)), 1.0)]
    while stack:
        pieces, weight = stack[-1]
        piece = next(pieces, None)
        if piece is None:
            stack.pop()
        elif len(piece) >= 2 and piece[0] is _OPEN and piece[-1] is _CLOSE:
            inner, w = piece[1:-1], weight * PAREN_WEIGHT
            explicit = _explicit_weight(inner)
            if explicit is not None:
                w, inner = explicit
            stack.append((_top_level_pieces(inner), w))
        else:
            out.append(Segment(_text(piece), weight))
    return out


def split_embeddings(text: str, dropped: Optional[list] = None) -> List[str]:
    """Rule 5: the pieces of one segment that are tokenized separately; the names after `embedding:` are left out
    (and appended to `dropped` when given)."""
    parts = _EMBEDDING_START.split(text)
    out = []
    for n, piece in enumerate(parts):
        if n > 0:
            piece = EMBEDDING_PREFIX + piece
        if piece.startswith(EMBEDDING_PREFIX):
            name, piece = _drop_embedding_name(piece[len(EMBEDDING_PREFIX):].strip("\n"))
            if dropped is not None:
                dropped.append(name)
        if piece:
            out.append(piece)
    return out


def _drop_embedding_name(rest: str) -> tuple:
    """(name, what ComfyUI tokenizes after `embedding:NAME` when NAME is not an embedding file it has)."""
    words = rest.split()
    if not words:
        raise PromptWeightError("'embedding:' is not followed by a name")
    name, leftover = words[0], " ".join(words[1:])
    cut = _NAME_CUT.search(name)
    if cut is not None:
        leftover = name[cut.start():] + (" " + leftover if leftover else "")
        name = name[:cut.start()]
    stripped = name.strip(",")
    if len(stripped) < len(name):
        leftover = f"{name[len(stripped):]} {leftover}"
    return name, leftover


def segment_pieces(segments: List[Segment], dropped: Optional[list] = None) -> List[tuple]:
    """(text, weight) of every piece that is tokenized on its own, in prompt order."""
    return [(piece, seg.weight) for seg in segments for piece in split_embeddings(seg.text, dropped)]


def check_prompt(prompt: str) -> None:
    """Raise PromptWeightError for a prompt the syntax cannot give a usable conditioning for (no tokenizer needed):
    a non-finite weight, `embedding:` without a name, a segment weight beyond ±MAX_PROMPT_WEIGHT."""
    segments = parse_weights(prompt)
    for seg in segments:
        if abs(seg.weight) > MAX_PROMPT_WEIGHT:
            text = seg.text if len(seg.text) <= 40 else seg.text[:37] + "..."
            raise PromptWeightError(f"weight {seg.weight:.6g} of {text!r} is outside -{MAX_PROMPT_WEIGHT:g}.."
                                    f"{MAX_PROMPT_WEIGHT:g} (an explicit (text:w), or 1.1 per level of nested "
                                    "parentheses: at most 48 levels)")
    segment_pieces(segments)
