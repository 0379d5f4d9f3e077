"""return_text_in_logprobs (SGLang): each (logprob, token_id, text) triple carries its token's text."""
from __future__ import annotations

import asyncio

import pytest


def _texts_match(tok, triples) -> None:
    assert triples, "no logprob triples"
    for entry in triples:
        _, tid, text = entry
        assert text == tok.decode([tid]), (tid, text)


def test_text_in_output_prompt_and_top_logprobs(tiny_engine):
    tok = tiny_engine.tokenizer
    kw = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2, token_ids_logprob=[5, 6])
    sp = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    out = tiny_engine.generate("Hello, my name is", sp, return_text_in_logprobs=True, **kw)
    meta = out["meta_info"]
    _texts_match(tok, meta["output_token_logprobs"])
    _texts_match(tok, meta["input_token_logprobs"])
    for row in meta["output_top_logprobs"] + meta["input_top_logprobs"][1:] + meta["output_token_ids_logprobs"]:
        _texts_match(tok, row)
    # the decoded pieces of the output triples spell the output ids
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    # without the flag the text slot is None, as SGLang
    plain = tiny_engine.generate("Hello, my name is", sp, **kw)["meta_info"]
    assert all(t is None for _, _, t in plain["output_token_logprobs"])
    # same ids; the logprobs may differ in the last bits on a GPU (another batch shape, cached prefix)
    assert [e[1] for e in plain["output_token_logprobs"]] == [e[1] for e in meta["output_token_logprobs"]]
    assert [e[0] for e in plain["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in meta["output_token_logprobs"]], abs=1e-4)


def test_text_in_streamed_and_async_logprobs(tiny_engine):
    tok = tiny_engine.tokenizer
    sp = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    chunks = list(tiny_engine.generate("abc", sp, stream=True, return_logprob=True, return_text_in_logprobs=True))
    streamed = [e for c in chunks[:-1] for e in c["meta_info"]["output_token_logprobs"]]
    _texts_match(tok, streamed + chunks[-1]["meta_info"]["output_token_logprobs"])
    out = asyncio.run(tiny_engine.async_generate("abc", sp, return_logprob=True, return_text_in_logprobs=True))
    _texts_match(tok, out["meta_info"]["output_token_logprobs"])
    assert len(out["meta_info"]["output_token_logprobs"]) == 5
