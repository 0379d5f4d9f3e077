"""Speculative decoding (NGRAM, STANDALONE): lossless against the plain engine, the accept rule's
statistics, stop handling inside accepted runs, SGLang's meta_info and config errors."""
from __future__ import annotations

import math

import pytest
import torch

import nbgen
from nbgen.core.batch import SeqWork
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.runtime.sampler import Sampler
from nbgen.runtime.spec_verify import longest_agreeing, verify

# prompts that repeat themselves (prompt lookup finds drafts) plus one that does not
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7], [40, 41, 42, 43, 44] * 4,
           [100, 7, 200, 9, 150, 3, 99, 17, 250, 31]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}


def _run(path: str, prompts, params, **kw):
    with nbgen.Engine(path, dtype="float32", device="cpu", random_seed=0, **kw) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        stats = eng.stats()
    return outs, stats


def _ids(outs):
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_dir(request, tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir) -> str:
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}[request.param]


def test_ngram_greedy_identical(family_dir):
    plain, _ = _run(family_dir, PROMPTS, GREEDY)
    spec, stats = _run(family_dir, PROMPTS, GREEDY, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    assert _ids(spec) == _ids(plain)
    meta = spec[0]["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accepted_drafts"] > 0     # drafts were accepted
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    assert meta["spec_accept_length"] == pytest.approx(40 / meta["spec_verify_ct"])
    assert stats["spec_accept_length"] > 1.0 and 0 < stats["spec_accept_rate"] <= 1


def test_ngram_sampling_same_tokens_per_seed(tiny_llama_dir):
    """Seeded sampling with penalties, top-k/p, min_new_tokens and logprobs: the same tokens (and
    logprobs) with and without speculation, n > 1 included."""
    params = [{"temperature": 0.1, "top_p": 0.9, "top_k": 20, "max_new_tokens": 30, "sampling_seed": s,
               "frequency_penalty": 0.1, "repetition_penalty": 1.05, "min_new_tokens": 12} for s in (1, 2, 3)]
    kw = dict(return_logprob=True, top_logprobs_num=2)
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu") as eng:
        plain = eng.generate(input_ids=PROMPTS, sampling_params=params, **kw)
        plain_n = eng.generate(input_ids=PROMPTS[1], sampling_params={"temperature": 1.0, "n": 3,
                                                                      "max_new_tokens": 20, "sampling_seed": 7})
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", speculative_algorithm="NGRAM") as eng:
        spec = eng.generate(input_ids=PROMPTS, sampling_params=params, **kw)
        spec_n = eng.generate(input_ids=PROMPTS[1], sampling_params={"temperature": 1.0, "n": 3,
                                                                     "max_new_tokens": 20, "sampling_seed": 7})
    assert _ids(spec) == _ids(plain)
    assert _ids(spec_n) == _ids(plain_n)
    for a, b in zip(plain, spec):
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in la] == [t for _, t, _ in lb]
        assert [v for v, _, _ in la] == pytest.approx([v for v, _, _ in lb], abs=1e-4)
        assert len(b["meta_info"]["output_top_logprobs"]) == len(lb) == len(b["output_ids"])
    assert sum(o["meta_info"]["spec_accepted_drafts"] for o in spec) > 0


def test_stops_inside_accepted_runs(tiny_llama_dir):
    """max_new_tokens, a stop token id and a stop string met inside an accepted run cut the output
    exactly where plain decoding stops."""
    plain, _ = _run(tiny_llama_dir, PROMPTS[:2], GREEDY)
    ref = plain[0]["output_ids"]
    stop_tok = ref[17]
    first = ref.index(stop_tok)
    stop_str = plain[1]["text"][20:24]
    cases = [{**GREEDY, "max_new_tokens": m} for m in (3, 9, 14, 23)]
    # ignore_eos turns stop_token_ids off too (as SGLang): the stop-id case runs without it
    cases += [{**GREEDY, "ignore_eos": False, "stop_token_ids": [stop_tok]}, {**GREEDY, "stop": [stop_str]}]
    prompts = [PROMPTS[0]] * 5 + [PROMPTS[1]]
    plain, _ = _run(tiny_llama_dir, prompts, cases)
    spec, _ = _run(tiny_llama_dir, prompts, cases, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    assert _ids(spec) == _ids(plain)
    assert [o["text"] for o in spec] == [o["text"] for o in plain]
    assert [o["meta_info"]["finish_reason"] for o in spec] == [o["meta_info"]["finish_reason"] for o in plain]
    assert len(spec[4]["output_ids"]) == first + 1
    assert spec[5]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}


def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def _first_tokens(rule, logits: torch.Tensor, drafts: list[int], n: int) -> list[int]:
    """The first emitted token of a verify seq [last, d1, d2] over n seeds (temperature 1)."""
    V = logits.shape[1]
    sampler = Sampler(V, torch.device("cpu"))
    seqs = []
    for seed in range(n):
        req = Request(f"r{seed}", [1, 2], SamplingParams(temperature=1.0, max_new_tokens=10), seed=seed)
        req.output_ids = [3]
        seqs.append(SeqWork(req, [3] + drafts, 2, [], True))
    res = verify(sampler, logits.repeat(n, 1), seqs, [len(drafts)] * n, rule)
    return [v.accepted[0] if v.accepted else v.token for v in res]


@pytest.mark.parametrize("wrong", [None, "always", "off_by_one"])
def test_accept_rule_chi_square(wrong):
    """The first token after a point-mass draft is distributed as the target's p (chi-square over 4000
    seeds, 5 degrees of freedom, p = 0.001 -> 20.5); deliberately wrong rules are caught."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.2                        # rows for positions after last, d1, d2
    drafts = [int(logits[0].argsort()[2]), 4]               # the first draft: p's third most likely token
    rules = {None: longest_agreeing, "always": lambda d, t: len(d),
             "off_by_one": lambda d, t: longest_agreeing(d, t[1:])}   # compares d_j with the wrong row
    toks = _first_tokens(rules[wrong], logits, drafts, 4000)
    counts = [toks.count(v) for v in range(6)]
    chi2 = _chi2(counts, torch.softmax(logits[0], -1).tolist())
    assert (chi2 < 20.5) == (wrong is None), (chi2, counts)


def test_engine_sampling_distribution(tiny_llama_dir):
    """Chi-square two-sample test at output position 4 (reached through accepted drafts) between
    speculative runs (seeds 0..299) and plain runs (seeds 1000..1299)."""
    sp = [{"temperature": 1.5, "top_k": 3, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": s}
          for s in range(300)]
    spec, _ = _run(tiny_llama_dir, [PROMPTS[1]] * 300, sp, speculative_algorithm="NGRAM")
    plain, _ = _run(tiny_llama_dir, [PROMPTS[1]] * 300, [{**p, "sampling_seed": p["sampling_seed"] + 1000}
                                                         for p in sp])
    a = [o["output_ids"][4] for o in spec]
    b = [o["output_ids"][4] for o in plain]
    cats = sorted(set(a) | set(b))
    chi2 = sum((a.count(c) - b.count(c)) ** 2 / (a.count(c) + b.count(c)) for c in cats)
    dof = max(len(cats) - 1, 1)
    limit = dof + 3.3 * math.sqrt(2 * dof) + 3                # ~ p < 0.001 for small dof
    assert chi2 < limit, (chi2, cats)
    assert sum(o["meta_info"]["spec_accepted_drafts"] for o in spec) > 0


@pytest.mark.parametrize("kw, word", [
    ({"speculative_algorithm": "NEXTN"}, "speculative_algorithm"),
    ({"speculative_algorithm": "BOGUS"}, "speculative_algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}, "speculative_eagle_topk"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/x"}, "speculative_draft_model_path"),
    ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_max_trie_depth": 0}, "speculative_ngram_max_trie_depth"),
])
def test_config_errors(kw, word):
    with pytest.raises(ValueError, match=word):
        nbgen.core.config.EngineConfig(**kw)


def test_ngram_proposer_prefers_longest_recent_match():
    from nbgen.runtime.spec_ngram import NgramProposer

    req = Request("a", [1, 2, 3, 9, 5, 2, 3, 4, 7, 1, 2, 3], SamplingParams())
    prop = NgramProposer(max_match=4)
    assert prop.propose(req, 3) == [9, 5, 2]                  # "1 2 3" beats the more recent "2 3"
    req.output_ids = [5, 6, 5]
    assert prop.propose(req, 2) == [6, 5]                     # the index follows new tokens; recent wins ties
    assert prop.propose(Request("b", [8], SamplingParams()), 3) == []


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory) -> str:
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tiny_llama_draft")), seed=1)


def test_standalone_identical(tiny_llama_dir, other_llama_dir):
    """A draft model: greedy and seeded sampling identical to plain decoding; the target as its own
    draft accepts everything (num_steps + 1 tokens per verify), a different draft less."""
    sp = [GREEDY, {"temperature": 0.6, "max_new_tokens": 30, "ignore_eos": True, "sampling_seed": 3},
          {**GREEDY, "max_new_tokens": 13}]
    prompts = PROMPTS
    plain, _ = _run(tiny_llama_dir, prompts, sp)
    same, stats = _run(tiny_llama_dir, prompts, sp, speculative_algorithm="STANDALONE",
                       speculative_draft_model_path=tiny_llama_dir, speculative_num_steps=4)
    other, _ = _run(tiny_llama_dir, prompts, sp, speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=other_llama_dir, speculative_num_steps=3)
    assert _ids(same) == _ids(plain) and _ids(other) == _ids(plain)
    m = same[0]["meta_info"]
    assert m["spec_accept_length"] == 5.0 and m["spec_accept_rate"] == 1.0       # 40 tokens in 8 verifies
    assert same[1]["meta_info"]["spec_accept_rate"] == 1.0                        # sampled: same seeded noise
    assert stats["spec_accept_length"] > 4
    assert other[0]["meta_info"]["spec_accept_rate"] < 1.0


def test_standalone_draft_share_of_the_budget(tiny_llama_dir, other_llama_dir):
    """The target's KV sizing on a GPU sets aside the STANDALONE draft's weights (its parameters in
    the engine's dtype, counted without reading them) and prices each page with the draft's K/V."""
    import transformers as tf

    from nbgen.core.config import EngineConfig
    from nbgen.runtime.spec_memory import DraftShare, draft_share

    cfg = EngineConfig(model_path=tiny_llama_dir, speculative_algorithm="STANDALONE",
                       speculative_draft_model_path=other_llama_dir, page_size=16)
    share = draft_share(cfg, torch.bfloat16)
    hf = tf.AutoModelForCausalLM.from_pretrained(other_llama_dir)
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert share.weight_bytes == 2 * sum(p.numel() for p in hf.parameters())
    assert share.bytes_per_page == 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * head_dim * 2
    assert draft_share(EngineConfig(model_path=tiny_llama_dir), torch.bfloat16) == DraftShare()


def test_dashboard_shows_speculation():
    from nbgen.notebook.state import StatsHistory, dashboard_html, dashboard_text

    h = StatsHistory()
    h.append({"running": 1, "spec_accept_length": 3.25, "spec_accept_rate": 0.5})
    assert 'data-spec-accept-length="3.250"' in dashboard_html(h)
    assert "3.25 tokens per step, 50% of drafts accepted" in dashboard_text(h.latest)
    h.append({"running": 1})
    assert "nbgen-spec" not in dashboard_html(h)


@pytest.mark.slow
def test_embedded_model_fp32_identical_and_faster_steps():
    """The embedded SmolLM2 in fp32 on extractive prompts: NGRAM output token-identical, > 1.5 tokens
    per verify step."""
    from nbgen.bench.spec_prompts import extractive_chats

    sp = {"temperature": 0.0, "max_new_tokens": 64}
    outs = []
    for kw in ({}, {"speculative_algorithm": "NGRAM"}):
        with nbgen.Engine(dtype="float32", device="cpu", **kw) as eng:
            prompts = [eng.apply_chat_template(c) for c in extractive_chats()[::5]]
            outs.append(eng.generate(prompts, sp))
    assert _ids(outs[0]) == _ids(outs[1])
    toks = sum(o["meta_info"]["completion_tokens"] for o in outs[1])
    assert toks / sum(o["meta_info"]["spec_verify_ct"] for o in outs[1]) > 1.5
