"""Requests with stop strings / stop_regex are drafted: a stop met inside an accepted run cuts the
output (ids, text, logprobs, finish reason) exactly where plain decoding stops."""
from __future__ import annotations

import nbgen

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7]
GREEDY = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}


def _run(path: str, params, **kw):
    with nbgen.Engine(path, dtype="float32", device="cpu", random_seed=0, **kw) as eng:
        return eng.generate(input_ids=[PROMPT] * len(params), sampling_params=params, return_logprob=True)


def _key(o):
    m = o["meta_info"]
    return o["output_ids"], o["text"], m["finish_reason"], [(round(t[0], 4), t[1]) for t in m["output_token_logprobs"]]


def test_stop_strings_drafted_and_cut_like_plain(tiny_llama_dir):
    full = _run(tiny_llama_dir, [GREEDY])[0]["text"]
    cases = [{**GREEDY, "stop": [full[a:a + 3]]} for a in range(4, min(len(full) - 3, 60), 5)]
    cases += [{**GREEDY, "stop": [full[20:23]], "no_stop_trim": True},
              {**GREEDY, "stop_regex": full[12:14].replace("\\", "\\\\")}]
    plain = _run(tiny_llama_dir, cases)
    spec = _run(tiny_llama_dir, cases, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    assert [_key(o) for o in spec] == [_key(o) for o in plain]
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in plain)
    assert sum(o["meta_info"]["spec_accepted_drafts"] for o in spec) > 0       # runs were accepted
