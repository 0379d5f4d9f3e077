"""generate()'s logprob options at SGLang's edges: integer types, a bool, one id for token_ids_logprob."""
from __future__ import annotations

import numpy as np
import pytest

GREEDY = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}


@pytest.mark.parametrize("name", ["top_logprobs_num", "logprob_start_len"])
def test_a_bool_is_a_value_error_and_the_engine_keeps_serving(tiny_engine, name):
    """A bool is an int to Python: as top_logprobs_num it would reach torch.topk(k=True) inside the step."""
    with pytest.raises(ValueError, match=name):
        tiny_engine.generate("a b", GREEDY, return_logprob=True, **{name: True})
    with pytest.raises(ValueError, match=name):
        tiny_engine.generate(["a b", "c"], GREEDY, return_logprob=True, **{name: [1, False]})
    assert tiny_engine.stats()["running"] == 0
    assert tiny_engine.generate("a b", GREEDY)["meta_info"]["completion_tokens"] == 3


def test_numpy_ints_count_as_ints(tiny_engine):
    ref = tiny_engine.generate("a b c", GREEDY, return_logprob=True, top_logprobs_num=2, logprob_start_len=1)
    got = tiny_engine.generate("a b c", GREEDY, return_logprob=True, top_logprobs_num=np.int64(2),
                               logprob_start_len=np.int32(1))
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs"):
        assert got["meta_info"][key] == ref["meta_info"][key]
    assert all(len(row) == 2 for row in got["meta_info"]["output_top_logprobs"])
    batch = tiny_engine.generate(["a b c", "d e"], GREEDY, return_logprob=True,
                                 top_logprobs_num=[np.int64(1), 3])
    assert [len(o["meta_info"]["output_top_logprobs"][0]) for o in batch] == [1, 3]


def test_one_token_id_for_token_ids_logprob(tiny_engine):
    """SGLang's GenerateReqInput turns an int token_ids_logprob into [id] for every prompt."""
    ref = tiny_engine.generate(["a b", "c"], GREEDY, return_logprob=True, token_ids_logprob=[5])
    got = tiny_engine.generate(["a b", "c"], GREEDY, return_logprob=True, token_ids_logprob=5)
    for r, g in zip(ref, got):
        rows = g["meta_info"]["output_token_ids_logprobs"]
        assert rows == r["meta_info"]["output_token_ids_logprobs"]
        assert len(rows) == 3 and all([tid for _, tid, _ in row] == [5] for row in rows)
    single = tiny_engine.generate("a b", GREEDY, return_logprob=True, token_ids_logprob=np.int64(5))
    assert single["meta_info"]["output_token_ids_logprobs"] == ref[0]["meta_info"]["output_token_ids_logprobs"]
    with pytest.raises(ValueError, match="token_ids_logprob"):
        tiny_engine.generate("a b", GREEDY, return_logprob=True, token_ids_logprob=10**6)
