"""A step's jump-forward searches in one C call (runtime/grammar_search.py) give every row's answer
``find_jump_forward_string`` gives from Python, and forced bytes that end inside a character neither
raise nor stop the engine."""
from __future__ import annotations

import json
import os
import random

import pytest

from nbgen.kernels import cpu_ops
from nbgen.runtime.grammar_search import JumpSearch
from tests.test_jump_forward import PERSON

xgr = pytest.importorskip("xgrammar")

# enum members whose second characters share their first UTF-8 byte (é = C3 A9, è = C3 A8): after the opening
# quote the grammar forces "x" and one byte, half a character
SPLIT_CHAR = {"type": "object", "required": ["a"], "properties": {"a": {"enum": ["xéa", "xèb"]}}}


@pytest.fixture(scope="module")
def tok():
    """The embedded model's tokenizer, or the GPU host's (NBGEN_TEST_GRAMMAR_TOKENIZER: no embedded model there)."""
    from transformers import AutoTokenizer

    from nbgen.models.embedded import default_model_path

    return AutoTokenizer.from_pretrained(os.environ.get("NBGEN_TEST_GRAMMAR_TOKENIZER") or default_model_path())


@pytest.fixture(scope="module")
def compiler(tok):
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))


class State:
    """The parts of a GrammarState the search reads: its matcher's FFI handle and the per-row search."""

    def __init__(self, compiled, ids: list[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        for t in ids:
            assert self.matcher.accept_token(t)
        self.handle = getattr(self.matcher, "_handle", None)
        self.search = getattr(self.handle, "find_jump_forward_string", None) or self.matcher.find_jump_forward_string


def _people(tok, compiler, n: int) -> list[State]:
    """n matchers of PERSON at random points of valid documents (some with forced text, some without)."""
    compiled = compiler.compile_json_schema(json.dumps(PERSON))
    rng = random.Random(0)
    states = []
    for i in range(n):
        doc = json.dumps({"name": f"N{i}" * rng.randint(1, 3), "age": rng.randint(0, 120),
                          "tags": rng.sample(["red", "green", "blue"], rng.randint(0, 2))})
        ids = tok.encode(doc, add_special_tokens=False)
        states.append(State(compiled, ids[: rng.randint(0, len(ids) - 1)]))
    return states


def _by_row(states: list[State]) -> list[tuple[int, str]]:
    return [(k, t) for k, t in enumerate(s.search() for s in states) if t]


def test_one_call_gives_every_rows_forced_text(tok, compiler):
    states = _people(tok, compiler, 200)
    want = _by_row(states)
    assert 0 < len(want) < len(states)          # rows with and without forced text
    search = JumpSearch()
    assert search.texts(states) == want
    assert search.texts(states[::-1]) == [(len(states) - 1 - k, t) for k, t in reversed(want)]
    assert search.texts([]) == []
    if cpu_ops.available() and hasattr(states[0].handle, "__chandle__"):
        assert search._ready                    # the C path ran (xgrammar's tvm-ffi matchers, the C helper built)


def test_texts_that_do_not_fit_are_asked_again(tok, compiler):
    """A one-byte share per row: most texts do not fit the buffer and are asked from Python, in order."""
    states = _people(tok, compiler, 64)
    assert JumpSearch(bytes_per_row=1).texts(states) == _by_row(states)


def test_a_failing_row_raises_as_its_search_does(tok, compiler):
    compiled = compiler.compile_json_schema(json.dumps({"type": "integer"}))
    done = State(compiled, tok.encode("7", add_special_tokens=False))
    assert done.matcher.accept_token(tok.eos_token_id) and done.matcher.is_terminated()
    with pytest.raises(RuntimeError):
        done.search()
    with pytest.raises(RuntimeError):
        JumpSearch().texts([State(compiled, []), done])


def test_states_without_an_ffi_matcher_are_asked_one_by_one():
    class Fake:
        handle = None

        def __init__(self, text: str) -> None:
            self.text = text

        def search(self) -> str:
            return self.text

    assert JumpSearch().texts([Fake(""), Fake("ab"), Fake(""), Fake('", "')]) == [(1, "ab"), (3, '", "')]


def test_forced_bytes_inside_a_character_are_cut_to_whole_ones(tok, compiler):
    compiled = compiler.compile_json_schema(json.dumps(SPLIT_CHAR))
    state = State(compiled, tok.encode('{"a": "', add_special_tokens=False))
    with pytest.raises(UnicodeDecodeError):      # xgrammar's own str conversion of "x" and half a character
        state.search()
    search = JumpSearch()
    got = search.texts([State(compiled, []), state])
    if search._ready:                           # the C path: the whole characters of the forced bytes
        assert got == [(0, "{"), (1, "x")]
    else:                                       # asked from Python: xgrammar's conversion raises, no jump
        assert got == [(0, "{")]


def test_engine_jumps_through_enum_members_sharing_a_first_byte():
    """The engine's loop survives the half-character forced text and the outputs validate."""
    from tests.tiny_models import grammar_engine

    with grammar_engine(device="cpu", enable_jump_forward=True) as eng:
        outs = eng.generate(["Pick one:", "Another one:"], {"temperature": 0, "max_new_tokens": 30,
                                                             "json_schema": json.dumps(SPLIT_CHAR)})
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] == "stop", o
            assert json.loads(o["text"])["a"] in ("xéa", "xèb")
        assert eng.generate("x", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] >= 1   # still serving
