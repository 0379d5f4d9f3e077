"""Stop conditions as SGLang's Req.check_finished and detokenizer decide them."""
from __future__ import annotations

import pytest

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


def _greedy_ids(eng) -> list[int]:
    return eng.generate("Hello", {**GREEDY, "ignore_eos": True})["output_ids"]


def test_ignore_eos_ignores_stop_token_ids_too(tiny_engine) -> None:
    ids = _greedy_ids(tiny_engine)
    stop = ids[1]
    out = tiny_engine.generate("Hello", {**GREEDY, "ignore_eos": True, "stop_token_ids": [stop]})
    assert out["output_ids"] == ids
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    # without ignore_eos the same id ends the request
    cut = tiny_engine.generate("Hello", {**GREEDY, "stop_token_ids": [stop]})
    assert cut["output_ids"] == ids[:2] and cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.parametrize("name, value", [("stop", ""), ("stop", ["a", ""]), ("stop_regex", [""])])
def test_an_empty_stop_is_a_value_error_naming_it(tiny_engine, name, value) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be a non-empty string"):
        tiny_engine.generate("Hello", {**GREEDY, name: value})
    assert tiny_engine.generate("Hello", GREEDY)["meta_info"]["completion_tokens"] >= 1
