"""Bounded JSON strings rewritten for cheap bitmask fills (runtime/grammar_rewrite.py): the same
masks as xgrammar's own grammar of the schema, token by token along random walks, and the bounds
still enforced. A small synthetic vocabulary (single characters and merged pieces that cross a
string's end) keeps it fast; the engine-level check is in tests/test_grammar.py."""
from __future__ import annotations

import json
import random
import string

import pytest
import torch

from nbgen.runtime.grammar_rewrite import fast_json_grammar, nested_only, unroll_bounded_strings

xgr = pytest.importorskip("xgrammar")

CHARS = list(string.ascii_lowercase + 'XYZ019 -_.:,"{}[]\\/') + ["é"]
PIECES = ['",', '"}', '"]', '", "', '":', 'ab', 'abc"', 'c",', 'a "', '"a', '}}', '"}]', '0.', '12', 'true',
          'false', 'null', '"name": "', '"tags": ["', 'ab"}', 'x"]', '""', ', "', '{"']
CONTROL = ["\t", "a\x01"]   # raw control characters: xgrammar's bounded strings admit them, JSON does not
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "tags", "n"],
     "properties": {"name": {"type": "string", "maxLength": 5},
                    "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "minLength": 1, "maxLength": 3}},
                    "n": {"type": "integer"}}},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 2}}}},
]


@pytest.fixture(scope="module")
def info() -> "xgr.TokenizerInfo":
    vocab = CHARS + PIECES + CONTROL + ["</s>"]
    return xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])


def _matchers(info: "xgr.TokenizerInfo", schema: dict) -> tuple:
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    text = json.dumps(schema)
    fast = fast_json_grammar(text)
    assert fast is not None
    return (xgr.GrammarMatcher(comp.compile_json_schema(text, any_whitespace=False)),
            xgr.GrammarMatcher(comp.compile_grammar(fast)))


@pytest.mark.parametrize("schema", SCHEMAS)
def test_same_masks_along_random_walks(info: "xgr.TokenizerInfo", schema: dict) -> None:
    n = info.vocab_size
    control = [len(CHARS) + len(PIECES) + k for k in range(len(CONTROL))]
    rng = random.Random(0)
    for _ in range(30):
        ref, fast = _matchers(info, schema)
        a, b = xgr.allocate_token_bitmask(1, n), xgr.allocate_token_bitmask(1, n)
        for _step in range(60):
            ref.fill_next_token_bitmask(a)
            fast.fill_next_token_bitmask(b)
            for t in control:          # the one difference: never a raw control character
                assert not (b[0, t // 32] >> (t % 32)) & 1
                a[0, t // 32] &= ~(1 << (t % 32))
            assert torch.equal(a, b)
            allowed = [t for t in range(n) if (a[0, t // 32] >> (t % 32)) & 1]
            assert allowed
            t = rng.choice(allowed)
            assert ref.accept_token(t) and fast.accept_token(t)
            if ref.is_terminated():
                assert fast.is_terminated()
                break
            assert ref.find_jump_forward_string() == fast.find_jump_forward_string()


def test_bounds_enforced(info: "xgr.TokenizerInfo") -> None:
    def accepts(s: str) -> bool:
        _, fast = _matchers(info, SCHEMAS[0])
        return fast.accept_string(s)

    assert accepts('{"name": "abcde", "tags": ["a", "abc"], "n": 1}')
    assert not accepts('{"name": "abcdef"')                    # maxLength 5
    assert not accepts('{"name": "", "tags": [""')             # minLength 1
    assert not accepts('{"name": "", "tags": ["abcd"')         # maxLength 3
    assert not accepts('{"name": "a\tb"')                      # not JSON: json.loads refuses it


def test_what_is_rewritten() -> None:
    assert nested_only(json.dumps(SCHEMAS[0])) and nested_only(json.dumps(SCHEMAS[1]))
    # a top-level string ends the output, where the separator lookahead would not hold
    assert not nested_only(json.dumps({"type": "string", "maxLength": 4}))
    assert fast_json_grammar(json.dumps({"type": "string", "maxLength": 4})) is None
    # nothing bounded: nothing to rewrite
    assert fast_json_grammar(json.dumps({"type": "object", "properties": {"a": {"type": "string"}}})) is None
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(SCHEMAS[0]), any_whitespace=False))
    out = unroll_bounded_strings(ebnf)
    assert out is not None and "{0, 5}" not in out and "{1, 3}" not in out
