"""Weighted prompts tokenized as ComfyUI tokenizes them (docs/prompts.md).

Segments: written out by hand from ComfyUI's rules for every prompt below (never computed by our parser).
Ids: the independent reference is `transformers` (Qwen2Tokenizer built from the same vocab.json + merges.txt, and
T5TokenizerFast, the classes ComfyUI's Anima tokenizer uses) applied to each expected segment on its own, exactly as
ComfyUI calls them (T5: the segment's ids without their EOS, one EOS at the end). Two vocabularies: the locally
trained tiny one, and a subset of the real Qwen2 vocabulary with the real ids (tests/data/qwen_real_subset), on which
the issue's example must give ComfyUI's 12 ids.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from models.text import synth as text_synth
from models.text.prompt_weights import PromptWeightError, check_prompt, parse_weights, split_embeddings

REAL_SUBSET = Path(__file__).parent / "data" / "qwen_real_subset"
LONG = "girl, " * 300                     # > 512 T5 tokens with either vocabulary
W11, W121 = 1.0 * 1.1, 1.0 * 1.1 * 1.1   # ComfyUI multiplies 1.1 per group level in float64

# (prompt, [(segment text, weight)], pieces tokenized separately when they differ from the segments)
CASES = [
    # plain
    ("masterpiece, best quality, 1girl", [("masterpiece, best quality, 1girl", 1.0)], None),
    ("  spaced   out  ", [("  spaced   out  ", 1.0)], None),
    # weighted: the example; explicit weights replace
    ("1girl, solo, (smile:1.2), cherry blossoms",
     [("1girl, solo, ", 1.0), ("smile", 1.2), (", cherry blossoms", 1.0)], None),
    ("(a cat)", [("a cat", W11)], None),
    ("(a:1e-1) (b: 2 )", [("a", 0.1), (" ", 1.0), ("b", 2.0)], None),
    ("(a:-0.5)", [("a", -0.5)], None),
    ("(a:1_5)", [("a", 15.0)], None),                           # Python's float() reads 1_5 as 15
    ("(ねこ:１.５)", [("ねこ", 1.5)], None),                     # ... and full-width digits
    ("(a:b)", [("a:b", W11)], None),                            # not a number: x1.1, the colon stays
    ("(a:b:0.7)", [("a:b", 0.7)], None),                        # the last colon counts
    ("(:1.2) x", [(":1.2", W11), (" x", 1.0)], None),           # a colon at position 0 is text
    ("( :1.2)", [(" ", 1.2)], None),
    # no merging of equal-weight neighbours
    ("red, red, (red:1.0), red", [("red, red, ", 1.0), ("red", 1.0), (", red", 1.0)], None),
    ("(blue:1.1)(blue)", [("blue", 1.1), ("blue", W11)], None),
    # nested
    ("((a cat))", [("a cat", W121)], None),
    ("((a:2))", [("a", 2.0)], None),
    ("((a):2)", [("a", 2.0 * 1.1)], None),
    ("(x (y:1.5))", [("x ", W11), ("y", 1.5)], None),
    ("x (a (b:0.5) c:2) y", [("x ", 1.0), ("a ", 2.0), ("b", 0.5), (" c", 2.0), (" y", 1.0)], None),
    ("foo ((((lol (cat:666) attack:100)))) baz",
     [("foo ", 1.0), ("lol ", 100.0), ("cat", 666.0), (" attack", 100.0), (" baz", 1.0)], None),
    ("foo ((((lol (cat:666) attack):100))) baz",
     [("foo ", 1.0), ("lol ", 100.0 * 1.1), ("cat", 666.0), (" attack", 100.0 * 1.1), (" baz", 1.0)], None),
    ("((foo:1.0):0.0)", [("foo", 1.0)], None),
    # escaped
    (r"\(not weighted\) (w:.5)", [("(not weighted) ", 1.0), ("w", 0.5)], None),
    (r"(\(x\):1.3)", [("(x)", 1.3)], None),
    (r"artist \(style\), (tag \(meta\):0.8)", [("artist (style), ", 1.0), ("tag (meta)", 0.8)], None),
    (r"back\slash \\(x)", [("back\\slash \\(x)", 1.0)], None),  # only \( and \) are escapes
    # unbalanced
    ("unclosed (paren here", [("unclosed ", 1.0), ("(paren here", 1.0)], None),
    ("a) b (c)", [("a) b (c)", 1.0)], None),                    # after a stray ')' the depth is -1
    ("a) ((b))", [("a) (", 1.0), ("b", W11), (")", 1.0)], None),
    ("((a) b", [("((a) b", 1.0)], None),
    ("(abc (d)", [("abc ", W11), ("(d", W11)], None),
    # empty segments and prompts
    ("()", [], None),
    ("a () b", [("a ", 1.0), (" b", 1.0)], None),
    ("", [], None),
    # unicode and Japanese
    ("少女, (桜:1.3), 日本の風景", [("少女, ", 1.0), ("桜", 1.3), (", 日本の風景", 1.0)], None),
    ("café (naïve:0.9) — ü\n(line two:1.2)\nend", [("café ", 1.0), ("naïve", 0.9), (" — ü\n", 1.0),
                                                  ("line two", 1.2), ("\nend", 1.0)], None),
    # embedding: names (none exist here: left out as ComfyUI leaves out a name it has no file for)
    ("a embedding:foo, bar baz (x:1.2)", [("a embedding:foo, bar baz ", 1.0), ("x", 1.2)],
     [("a ", 1.0), (", bar baz", 1.0), ("x", 1.2)]),              # words re-joined by one space
    ("embedding:name<lora:z:1> rest", [("embedding:name<lora:z:1> rest", 1.0)], [("<lora:z:1> rest", 1.0)]),
    # over 512 T5 tokens
    (LONG + "(smile:1.2)", [(LONG, 1.0), ("smile", 1.2)], None),
]


def _pieces(case):
    return case[2] if case[2] is not None else case[1]


@pytest.mark.parametrize("prompt, want, _", CASES)
def test_segments_are_comfyui_segments(prompt, want, _):
    got = parse_weights(prompt)
    assert [s.text for s in got] == [t for t, _ in want]
    assert [s.weight for s in got] == pytest.approx([w for _, w in want], abs=1e-12)


def test_enough_cases_cover_every_rule():
    assert len(CASES) >= 25
    assert any(p == "" for p, _, _ in CASES) and any(p.startswith(LONG) for p, _, _ in CASES)


def test_embedding_pieces_and_bad_syntax():
    assert split_embeddings("x embedding:a,b c") == ["x ", "c"]              # the name is the first word
    assert split_embeddings("no\tembedding:n") == ["no\t"]
    assert split_embeddings("embedding:n, more") == [", more"]
    assert split_embeddings("sub-embedding:n") == ["sub-embedding:n"]       # not after whitespace: plain text
    for bad, what in (("(a:nan)", "not a finite number"), ("(a:inf) b", "not a finite number"),
                      ("x embedding:", "not followed by a name"), ("x embedding:  \n", "not followed by a name")):
        with pytest.raises(PromptWeightError, match=what):
            check_prompt(bad)
    deep = "(" * 3000 + "x" + ")" * 3000                 # deeper than Python's recursion limit: no recursion
    seg = parse_weights(deep)
    assert [s.text for s in seg] == ["x"] and seg[0].weight == pytest.approx(1.1 ** 3000, rel=1e-9)


# ---- ids against transformers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    text_synth.write_tokenizers("tiny", out)
    return out


def _reference(qwen_hf, t5_hf, pieces, pad_id=151643):
    """What ComfyUI's Anima tokenizer gives: per piece, Qwen2Tokenizer ids; T5TokenizerFast ids minus their EOS."""
    qwen, t5, w = [], [], []
    for text, weight in pieces:
        qwen += qwen_hf(text)["input_ids"]
        ids = t5_hf(text)["input_ids"]
        assert ids[-1] == 1
        t5 += ids[:-1]
        w += [weight] * (len(ids) - 1)
    return (qwen or [pad_id]), t5 + [1], w + [1.0]


def _check_all(ours, qwen_hf, t5_hf):
    for case in CASES:
        tp = ours.tokenize(case[0])
        want_q, want_t5, want_w = _reference(qwen_hf, t5_hf, _pieces(case))
        assert tp.qwen_ids == want_q, case[0]
        assert tp.qwen_masked == (case[0] in ("", "()")), case[0]
        assert tp.t5_ids == want_t5, case[0]
        assert tp.t5_weights == pytest.approx(want_w, abs=1e-12), case[0]
        assert [p for p, _ in tp.segments] == [p for p, _ in _pieces(case)]


def test_ids_equal_transformers_per_segment_tiny_vocab(tok_dir):
    from transformers import Qwen2Tokenizer, T5TokenizerFast
    from models.text.tokenizers import PromptTokenizer

    ours = PromptTokenizer.from_files(str(tok_dir / "qwen"), str(tok_dir / "t5"))
    qwen_hf = Qwen2Tokenizer(vocab=str(tok_dir / "qwen" / "vocab.json"), merges=str(tok_dir / "qwen" / "merges.txt"))
    t5_hf = T5TokenizerFast.from_pretrained(str(tok_dir / "t5"))
    _check_all(ours, lambda t: qwen_hf(t, add_special_tokens=False), t5_hf)
    long = ours.tokenize(CASES[-1][0])
    assert len(long.t5_ids) > 512


def test_ids_equal_transformers_per_segment_real_qwen_vocab(tok_dir):
    """The real Qwen2 ids (a subset of the real vocabulary, every merge these texts can use, real ids kept)."""
    from transformers import Qwen2Tokenizer, T5TokenizerFast
    from models.text.tokenizers import PromptTokenizer, QwenTokenizer, T5Tokenizer

    texts = set(json.loads((REAL_SUBSET / "texts.json").read_text(encoding="utf-8")))
    missing = {p for case in CASES for p, _ in _pieces(case)} - texts
    assert not missing, f"qwen_real_subset lacks {sorted(missing)[:3]}: rebuild it (scripts/qwen_vocab_subset.py)"
    ours = PromptTokenizer(QwenTokenizer(str(REAL_SUBSET)), T5Tokenizer(str(tok_dir / "t5")))
    qwen_hf = Qwen2Tokenizer(vocab=str(REAL_SUBSET / "vocab.json"), merges=str(REAL_SUBSET / "merges.txt"))
    t5_hf = T5TokenizerFast.from_pretrained(str(tok_dir / "t5"))
    _check_all(ours, lambda t: qwen_hf(t, add_special_tokens=False), t5_hf)
    # The example: ComfyUI's 12 ids; the whole clean text in one go gives 10 other ones.
    tp = ours.tokenize("1girl, solo, (smile:1.2), cherry blossoms")
    assert tp.qwen_ids == [16, 28552, 11, 13529, 11, 220, 3563, 457, 11, 40880, 49723, 6940]
    assert ours.qwen.encode("1girl, solo, smile, cherry blossoms") == [16, 28552, 11, 13529, 11, 15289, 11, 40880,
                                                                       49723, 6940]


def test_pad_token_in_prompt_warns(tok_dir, caplog):
    from models.text.tokenizers import PromptTokenizer
    ours = PromptTokenizer.from_files(str(tok_dir / "qwen"), str(tok_dir / "t5"))
    with caplog.at_level(logging.WARNING, logger="models.text.tokenizers"):
        tp = ours.tokenize("cat <|endoftext|> dog")
        ours.tokenize("a embedding:foo, b")
    assert 151643 in tp.qwen_ids and not tp.qwen_masked
    msgs = [r.getMessage() for r in caplog.records]
    assert any("masks it" in m for m in msgs) and any("embedding:foo," in m for m in msgs)


def test_prompt_json_rejects_bad_weight_syntax():
    from orchestrator.engine.prompt_spec import PromptError, parse_prompt_obj
    with pytest.raises(PromptError, match="field 'prompt'.*not a finite number"):
        parse_prompt_obj({"prompt": "1girl, (smile:nan)"})
    with pytest.raises(PromptError, match="field 'negative_prompt'.*embedding"):
        parse_prompt_obj({"prompt": "x", "negative_prompt": "lowres embedding:"})
    assert parse_prompt_obj({"prompt": "a) ((b:2)) (c"}).prompt == "a) ((b:2)) (c"


def test_weights_beyond_the_bound_are_refused_with_the_field():
    """`(a:1e39)` or 1000 nested parentheses were accepted; the encoder's float32 cast overflowed, the scheduler met a
    NaN/Inf context and exited, four times per job. |weight| <= MAX_PROMPT_WEIGHT (100) is checked at submit."""
    from models.text.prompt_weights import MAX_PROMPT_WEIGHT
    from orchestrator.engine.prompt_spec import PromptError, parse_prompt_obj
    assert MAX_PROMPT_WEIGHT == 100.0
    nest = lambda n: "(" * n + "x" + ")" * n  # noqa: E731
    for ok in ("(a:100)", "(a:-100)", "(b:0)", nest(48), "(" * 60 + "x:1.2" + ")" * 60, "((a:99):100)"):
        check_prompt(ok)                                          # 1.1**48 = 97.0; an explicit weight replaces
    for bad, weight in (("(a:1e39)", "1e+39"), ("(a:100.5)", "100.5"), ("(a:-101)", "-101"), (nest(49), "106.7"),
                        (nest(1000), "2.46993e+41"), ("(x (y:90))", None)):
        if weight is None:
            check_prompt(bad)                                     # 1.1 applies to "x " only: y keeps 90
            continue
        with pytest.raises(PromptWeightError, match=rf"weight {re.escape(weight)}\S* of .* is outside -100\.\.100"):
            check_prompt(bad)
    assert parse_weights(nest(1000))[0].weight == pytest.approx(1.1 ** 1000)      # the parser is ComfyUI's still
    for field in ("prompt", "negative_prompt"):
        with pytest.raises(PromptError, match=f"field '{field}'.*outside -100..100"):
            parse_prompt_obj({"prompt": "x", field: "1girl, (smile:1e39)"})
