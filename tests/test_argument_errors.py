"""Arguments of the wrong type raise ``ArgumentTypeError``: a ValueError naming the parameter (nbgen's rule)
that ``except TypeError`` catches too (Python's habit); the engine keeps serving."""
from __future__ import annotations

import pytest

from nbgen.core.errors import ArgumentTypeError


@pytest.mark.parametrize("call, name", [
    (lambda e: e.generate(5), "prompt"),
    (lambda e: e.generate(["a", 3]), r"prompt\[1\]"),
    (lambda e: e.generate(input_ids="abc"), "input_ids"),
    (lambda e: e.generate("a", sampling_params=3), "sampling_params"),
    (lambda e: e.generate("a", {"temperature": "hot"}), "temperature"),
    (lambda e: e.generate("a", {"max_new_tokens": 2.5}), "max_new_tokens"),
    (lambda e: e.generate("a", {"stop_token_ids": "x"}), "stop_token_ids"),
    (lambda e: e.generate("a", {"ignore_eos": "yes"}), "ignore_eos"),
    (lambda e: e.generate("a", {"stop": 3}), "stop"),
    (lambda e: e.generate("a", return_hidden_states=1), "return_hidden_states"),
    (lambda e: e.chat("hello"), "messages"),
])
def test_wrong_types_are_value_errors_naming_the_parameter(tiny_engine, call, name):
    with pytest.raises(ValueError, match=name) as info:
        call(tiny_engine)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ArgumentTypeError)
    out = tiny_engine.generate("ok", {"max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 2
