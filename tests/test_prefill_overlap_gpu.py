"""Prefill-only steps pipelined on the GPU (CUDA only): the overlap stepper's embeddings, ``score`` and
output logprobs equal the plain loop's (``disable_overlap_schedule``: the same kernels in the same
order), with piecewise prefill graphs, shared prefixes and mixed lengths; ``bench.embed`` reports the
GPU's time per forward and between forwards."""
from __future__ import annotations

import random

import pytest

import nbgen

gpu = pytest.mark.gpu


def _prompts() -> tuple[list[int], list[list[int]]]:
    rng = random.Random(1)
    query = [rng.randrange(2, 512) for _ in range(100)]
    items = [[rng.randrange(2, 512) for _ in range(rng.choice([1, 7, 40, 130, 300]))] for _ in range(40)]
    return query, items


def _engine(path: str, overlap: bool, **cfg) -> nbgen.Engine:
    return nbgen.Engine(path, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, chunked_prefill_size=512,
                        max_running_requests=8, disable_overlap_schedule=not overlap, **cfg)


@gpu
def test_pipelined_embeddings_equal_plain_loop(gpu_model_dir):
    query, items = _prompts()
    prompts = [query + it for it in items] + items[:5]
    got = {}
    for overlap in (True, False):
        with _engine(gpu_model_dir, overlap, is_embedding=True) as eng:
            assert eng.get_server_info()["piecewise_cuda_graph_tokens"]
            got[overlap] = [eng.encode(input_ids=prompts), eng.encode(input_ids=prompts)]   # then cache hits
    for a, b in zip(got[True][0] + got[True][1], got[False][0] + got[False][1]):
        assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-6)
        assert a["meta_info"]["cached_tokens"] == b["meta_info"]["cached_tokens"]
    assert got[True][1][0]["meta_info"]["cached_tokens"] > 0


@gpu
def test_pipelined_score_and_logprobs_equal_plain_loop(gpu_model_dir):
    query, items = _prompts()
    labels = [3, 17, 100, 400]
    sp = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    got = {}
    for overlap in (True, False):
        with _engine(gpu_model_dir, overlap) as eng:
            scores = eng.score(query=query, items=items, label_token_ids=labels, apply_softmax=True)
            gen = eng.generate(input_ids=items[:10], sampling_params=sp, return_logprob=True, top_logprobs_num=3,
                               token_ids_logprob=labels, use_tqdm=False)
            got[overlap] = (scores, gen)
    (s1, g1), (s0, g0) = got[True], got[False]
    for a, b in zip(s1, s0):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-7)
    for a, b in zip(g1, g0):
        assert a["output_ids"] == b["output_ids"]
        for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
            fa, fb = a["meta_info"][key], b["meta_info"][key]
            assert len(fa) == len(fb) == len(a["output_ids"]), key
            assert str([[t[1] for t in (r if isinstance(r, list) else [r])] for r in fa]) == \
                str([[t[1] for t in (r if isinstance(r, list) else [r])] for r in fb]), key


@gpu
@pytest.mark.parametrize("score", [False, True])
def test_bench_embed_reports_gpu_spans(gpu_model_dir, score):
    from nbgen.bench.embed import main

    argv = ["--model", gpu_model_dir, "--num-texts", "200", "--min-tokens", "16", "--max-tokens", "200", "--no-peer"]
    r = main(argv + (["--score"] if score else []))[0]
    g = r["steps"]["gpu"]
    assert 0 < g["forwards"] <= r["steps"]["steps"]
    assert g["forward_ms"] > 0 and g["between_ms"] >= 0
