"""Engine arguments SGLang accepts at its edges: None meaning the default, request ids of a batch."""
from __future__ import annotations

import asyncio

import pytest

from nbgen.core.sampling import SamplingParams

GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


def test_none_sampling_params_mean_the_default() -> None:
    sp = SamplingParams(temperature=None, top_p=None, top_k=None, min_p=None, frequency_penalty=None,
                        presence_penalty=None, repetition_penalty=None, min_new_tokens=None, n=None,
                        ignore_eos=None, skip_special_tokens=None, spaces_between_special_tokens=None,
                        no_stop_trim=None)
    assert sp == SamplingParams()
    assert SamplingParams(stop_token_ids=[None, 5, None]).stop_token_ids == [5]
    assert SamplingParams(stop_token_ids=[None]).stop_token_ids is None


def test_none_sampling_params_through_generate(tiny_engine) -> None:
    ref = tiny_engine.generate("Hello there", GREEDY)
    out = tiny_engine.generate("Hello there", {**GREEDY, "top_p": None, "top_k": None, "min_p": None,
                                               "repetition_penalty": None, "n": None,
                                               "skip_special_tokens": None, "no_stop_trim": None})
    assert out["output_ids"] == ref["output_ids"]
    sampled = tiny_engine.generate("Hello there", {"temperature": None, "max_new_tokens": 4, "ignore_eos": True,
                                                   "sampling_seed": 3})
    assert sampled["output_ids"] == tiny_engine.generate(
        "Hello there", {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 3})["output_ids"]


def test_logprob_arguments_none_mean_the_default(tiny_engine) -> None:
    out = tiny_engine.generate("Hello there", GREEDY, return_logprob=True, top_logprobs_num=None,
                               logprob_start_len=None)
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4
    assert meta["input_token_logprobs"] == []
    assert "output_top_logprobs" not in meta or all(not row for row in meta["output_top_logprobs"])
    plain = tiny_engine.generate("Hello there", GREEDY, return_logprob=None)
    assert "output_token_logprobs" not in plain["meta_info"]


def test_str_rid_of_a_batch_gets_an_index_suffix(tiny_engine) -> None:
    outs = tiny_engine.generate(["a b", "c d", "e"], GREEDY, rid="job")
    assert [o["meta_info"]["id"] for o in outs] == ["job_0", "job_1", "job_2"]
    outs = tiny_engine.generate(["a b", "c d"], {**GREEDY, "n": 2}, rid="par")
    assert [o["meta_info"]["id"] for o in outs] == ["par_0-0", "par_0-1", "par_1-0", "par_1-1"]
    assert tiny_engine.generate("a b", GREEDY, rid="one")["meta_info"]["id"] == "one"


def test_duplicate_rids_within_a_call(tiny_engine) -> None:
    with pytest.raises(ValueError, match="rid 'x' appears more than once in the call"):
        tiny_engine.generate(["a", "b", "c"], GREEDY, rid=["x", "y", "x"])
    assert tiny_engine.stats()["running"] == 0
    assert [o["meta_info"]["id"] for o in tiny_engine.generate(["a", "b"], GREEDY, rid=["x", "y"])] == ["x", "y"]


def test_rid_of_another_type_is_a_value_error(tiny_engine) -> None:
    """SGLang's GenerateReqInput refuses a rid that is neither a str nor a list with ValueError."""
    for prompt, rid in (("a", 5), (["a", "b"], ["x", 7]), ("a", b"x")):
        with pytest.raises(ValueError, match="rid must be a str or a list of str"):
            tiny_engine.generate(prompt, GREEDY, rid=rid)
    assert tiny_engine.stats()["running"] == 0
    assert tiny_engine.generate("a", GREEDY, rid="ok")["meta_info"]["id"] == "ok"


def test_prompt_logprob_lists_are_present_and_empty_by_default(tiny_engine) -> None:
    meta = tiny_engine.generate("Hello there", GREEDY, return_logprob=True, top_logprobs_num=2,
                                token_ids_logprob=[1, 2])["meta_info"]
    assert meta["input_token_logprobs"] == []
    assert meta["input_top_logprobs"] == []
    assert meta["input_token_ids_logprobs"] == []
    assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) == 4
    plain = tiny_engine.generate("Hello there", GREEDY, return_logprob=True)["meta_info"]
    assert plain["input_token_logprobs"] == [] and "input_top_logprobs" not in plain


def test_logprob_start_len_past_the_prompt(tiny_engine) -> None:
    n = len(tiny_engine.tokenizer.encode("Hello there"))
    with pytest.raises(ValueError, match=r"logprob_start_len=%d is past the end of prompt\[1\]" % (n + 1)):
        tiny_engine.generate(["Hello there, friend", "Hello there"], GREEDY, return_logprob=True,
                             logprob_start_len=n + 1)
    at_end = tiny_engine.generate("Hello there", GREEDY, return_logprob=True, logprob_start_len=n)
    assert at_end["meta_info"]["input_token_logprobs"] == []
    assert tiny_engine.generate("Hello there", GREEDY)["meta_info"]["completion_tokens"] == 4


def _joined(chunks: list[dict]) -> dict[int, tuple[str, list[int], dict]]:
    """index -> (text joined, the last chunk's output ids (all of them, nbgen's final chunk), its meta_info)."""
    out: dict[int, tuple[str, list[int], dict]] = {}
    for c in chunks:
        text = out.get(c["index"], ("", [], {}))[0]
        out[c["index"]] = (text + c["text"], c["output_ids"], c["meta_info"])
    return out


def test_stream_of_a_batch_with_n(tiny_engine) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 11, "n": 2}
    prompts = ["a b", "c d e"]
    ref = tiny_engine.generate(prompts, params)
    chunks = list(tiny_engine.generate(prompts, params, stream=True))
    got = _joined(chunks)
    assert sorted(got) == [0, 1, 2, 3]
    for i, o in enumerate(ref):
        text, ids, meta = got[i]
        assert (text, ids) == (o["text"], o["output_ids"])
        assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["completion_tokens"] == 6
    single = list(tiny_engine.generate("a b", GREEDY, stream=True))
    assert all("index" not in c for c in single)


def test_closing_a_batch_stream_aborts_every_request(tiny_engine) -> None:
    it = tiny_engine.generate(["a b", "c d"], {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True},
                              stream=True, rid=["s0", "s1"])
    first = next(it)
    assert first["index"] in (0, 1)
    it.close()
    assert tiny_engine.stats()["running"] == 0
    assert tiny_engine.generate("a b", GREEDY, rid="s0")["meta_info"]["id"] == "s0"


def test_async_stream_of_a_batch(tiny_engine) -> None:
    prompts = ["x y", "z"]

    async def run() -> list[dict]:
        gen = await tiny_engine.async_generate(prompts, GREEDY, stream=True)
        return [c async for c in gen]

    got = _joined(asyncio.run(run()))
    ref = tiny_engine.generate(prompts, GREEDY)
    assert {i: (t, ids) for i, (t, ids, _) in got.items()} == {i: (o["text"], o["output_ids"]) for i, o in enumerate(ref)}


def test_logit_bias_past_float32_raises(tiny_engine) -> None:
    with pytest.raises(ValueError, match=r"logit_bias\['185'\] must be at most 3.403e\+38"):
        tiny_engine.generate("Hello", {**GREEDY, "logit_bias": {"185": 1e308}})
    out = tiny_engine.generate("Hello", {**GREEDY, "logit_bias": {"185": 3e38}}, return_logprob=True)
    assert out["output_ids"] == [185] * 4
    assert all(lp == 0.0 for lp, _, _ in out["meta_info"]["output_token_logprobs"])


def test_finish_reason_shapes(tiny_engine) -> None:
    out = tiny_engine.generate("Hello", {**GREEDY, "max_new_tokens": 3})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert tiny_engine.generate("Hello", {"max_new_tokens": 0})["meta_info"]["finish_reason"] == \
        {"type": "length", "length": 0}
    it = tiny_engine.generate("Hello", {**GREEDY, "max_new_tokens": 200}, stream=True, rid="to-abort")
    next(it)
    tiny_engine.abort("to-abort")
    last = list(it)[-1]["meta_info"]["finish_reason"]
    assert last["type"] == "abort" and set(last) == {"type", "message", "status_code", "err_type"}
    assert (last["status_code"], last["err_type"]) == (None, None)


def test_abort_refuses_what_is_not_a_request_id(tiny_engine) -> None:
    for bad in (None, 5, ["ok", 3], {"rid": "x"}):
        with pytest.raises(ValueError, match="rid must be a request id"):
            tiny_engine.abort(bad)
    tiny_engine.abort(["never-sent", "nor-this"])       # unknown ids: ignored
    assert tiny_engine.generate("Hello", GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


def test_flush_cache_answers_sglangs_output(tiny_engine) -> None:
    it = tiny_engine.generate("Hello", {**GREEDY, "max_new_tokens": 200}, stream=True)
    next(it)
    busy = tiny_engine.flush_cache()
    assert (busy.success, bool(busy)) == (False, False) and "requests are running" in busy.message
    it.close()
    done = tiny_engine.flush_cache()
    assert (done.success, bool(done), done.message) == (True, True, "")


def test_text_matching_params_without_a_tokenizer_raise(tiny_llama_dir) -> None:
    import nbgen

    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", skip_tokenizer_init=True)
    try:
        for params, name in (({"stop": "ab"}, "stop"), ({"stop": ["ab", "c"]}, "stop"),
                             ({"stop_regex": "a+"}, "stop_regex"), ({"regex": "[0-9]+"}, "regex"),
                             ({"json_schema": '{"type": "object"}'}, "json_schema")):
            with pytest.raises(ValueError, match=rf"^{name}=.* needs the tokenizer"):
                eng.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, **params})
        out = eng.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "stop_token_ids": [9]})
        assert out["meta_info"]["completion_tokens"] == 4 and "text" not in out
    finally:
        eng.shutdown()
