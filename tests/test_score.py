"""Engine.score (SGLang): label-token probabilities after query+item, against HF logits."""
from __future__ import annotations

import asyncio
import math

import pytest


def _hf_next_logprobs(model_dir: str, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].log_softmax(-1)


def test_score_text_matches_hf_and_softmax_normalises(tiny_engine, tiny_llama_dir):
    labels = [5, 17, 42]
    query, items = "Is this good? ", ["yes it is", "no"]
    probs = tiny_engine.score(query, items, labels)
    soft = tiny_engine.score(query, items, labels, apply_softmax=True)
    assert len(probs) == 2 and all(len(p) == 3 for p in probs)
    for item, p, s in zip(items, probs, soft):
        ref = _hf_next_logprobs(tiny_llama_dir, tiny_engine.tokenizer.encode(query + item))
        assert p == pytest.approx([math.exp(ref[t].item()) for t in labels], rel=1e-3, abs=1e-6)
        assert sum(s) == pytest.approx(1.0, abs=1e-6)
        assert s == pytest.approx([v / sum(p) for v in p], rel=1e-3)
    # item_first puts the item before the query
    first = tiny_engine.score(query, items[:1], labels, item_first=True)[0]
    ref = _hf_next_logprobs(tiny_llama_dir, tiny_engine.tokenizer.encode(items[0] + query))
    assert first == pytest.approx([math.exp(ref[t].item()) for t in labels], rel=1e-3, abs=1e-6)


def test_score_token_ids_and_async(tiny_engine, tiny_llama_dir):
    q, items, labels = [3, 4, 5], [[6, 7], [8]], [1, 2]
    got = tiny_engine.score(q, items, labels)
    ref = _hf_next_logprobs(tiny_llama_dir, q + items[1])
    assert got[1] == pytest.approx([math.exp(ref[t].item()) for t in labels], rel=1e-3, abs=1e-6)
    again = asyncio.run(tiny_engine.async_score(q, items, labels))
    for a, b in zip(again, got):
        assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize("kw, needle", [
    (dict(query="q", items=["a"], label_token_ids=None), "label_token_ids"),
    (dict(query="q", items=["a"], label_token_ids=[10**9]), "label_token_ids"),
    (dict(query="q", items=[[1, 2]], label_token_ids=[1]), "query"),
    (dict(query=[1], items=["a"], label_token_ids=[1]), "query"),
])
def test_score_bad_input_names_the_problem(tiny_engine, kw, needle):
    with pytest.raises(ValueError, match=needle):
        tiny_engine.score(**kw)


def test_score_result_has_sglang_fields_and_is_the_list(tiny_engine):
    """SGLang's score answers ScoreResult(scores, prompt_tokens); older code indexes the list itself."""
    import pickle

    query, items, labels = "Is this good? ", ["yes it is", "no"], [5, 17]
    res = tiny_engine.score(query, items, labels)
    want = sum(len(tiny_engine.tokenizer.encode(query + i)) for i in items)
    assert res.prompt_tokens == want
    assert res.scores == list(res) and len(res.scores) == 2 and res[1] == res.scores[1]
    again = asyncio.run(tiny_engine.async_score(query, items, labels))
    assert again.prompt_tokens == want
    for a, b in zip(again.scores, res.scores):
        assert a == pytest.approx(b, rel=1e-5)
    copy = pickle.loads(pickle.dumps(res))
    assert copy == res and copy.prompt_tokens == want


@pytest.mark.parametrize("query, items", [("q", []), ([1, 2], []), ("q", "")])
def test_score_empty_items_give_no_scores(tiny_engine, query, items):
    """SGLang answers empty items with no scores rather than an error."""
    res = tiny_engine.score(query, items, [1, 2])
    assert res == [] and res.scores == [] and res.prompt_tokens == 0
    assert asyncio.run(tiny_engine.async_score(query, items, [1, 2])).scores == []
    assert list(tiny_engine.score_iter(query, items, [1, 2])) == []
    with pytest.raises(ValueError, match="items"):
        tiny_engine.score(query, None, [1, 2])


def test_score_ignores_a_generation_config_repetition_penalty(tiny_llama_dir, tmp_path):
    """A model's generation_config repetition_penalty must not reach the label probabilities: SGLang's
    penalties count output tokens, so its score is the model's own next-token distribution."""
    import json
    import shutil

    import nbgen

    model_dir = str(tmp_path / "rep")
    shutil.copytree(tiny_llama_dir, model_dir)
    with open(f"{model_dir}/generation_config.json", "w") as f:
        json.dump({"repetition_penalty": 1.5}, f)
    eng = nbgen.Engine(model_dir, dtype="float32", device="cpu", random_seed=0)
    try:
        query = "a b c a b c"
        ids = eng.tokenizer.encode(query)
        labels = sorted(set(ids))[:3]          # tokens of the prompt: the ones a penalty would change
        ref = _hf_next_logprobs(tiny_llama_dir, ids)
        assert eng.score(query, [""], labels)[0] == pytest.approx(
            [math.exp(ref[t].item()) for t in labels], rel=1e-4, abs=1e-7)
        # generate keeps the model's default
        out = eng.generate(query, {"max_new_tokens": 1, "temperature": 0.0}, return_logprob=True,
                           token_ids_logprob=labels)
        got = [lp for lp, _, _ in out["meta_info"]["output_token_ids_logprobs"][0]]
        assert got != pytest.approx([ref[t].item() for t in labels], rel=1e-4)
    finally:
        eng.shutdown()
