"""Overlap scheduling (placeholder tokens, one step in flight) gives the same outputs as the plain loop.

The stepper is forced on for a CPU engine: CPU work is synchronous, but the bookkeeping (placeholders,
late stop-token finishes, preemption with a step in flight, sync fallback for logprobs) is the same.
"""
from __future__ import annotations

import random

import pytest

import nbgen
from nbgen.runtime.overlap import OverlapStepper


def _run(path: str, overlap: bool, prompts: list[list[int]], sps: list[dict], **cfg) -> list[dict]:
    with nbgen.Engine(path, dtype="float32", device="cpu", **cfg) as eng:
        if overlap:
            loop = eng.loop
            loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
        return eng.generate(input_ids=prompts, sampling_params=sps)


@pytest.mark.parametrize("cfg", [{}, {"max_total_tokens": 400, "chunked_prefill_size": 64},
                                 {"schedule_policy": "lof", "chunked_prefill_size": 48}])
def test_overlap_same_outputs(tiny_llama_dir, cfg):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(1, 120))] for _ in range(12)]
    sps = []
    for i in range(12):
        sp = {"max_new_tokens": rng.randint(1, 30), "temperature": 0.0}
        if i % 3 == 1:
            sp.update(temperature=0.9, top_p=0.9, sampling_seed=i)
        if i == 5:
            sp.update(ignore_eos=True)
        sps.append(sp)
    first = _run(tiny_llama_dir, False, prompts, sps, **cfg)
    for i in (0, 3, 6, 9):   # stop on a token greedy decoding will produce (after min_new_tokens)
        ids = first[i]["output_ids"]
        if len(ids) > 3:
            sps[i].update(stop_token_ids=[ids[2]], min_new_tokens=2)
    ref = _run(tiny_llama_dir, False, prompts, sps, **cfg)
    got = _run(tiny_llama_dir, True, prompts, sps, **cfg)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in ref]
    assert all(t >= 0 for o in got for t in o["output_ids"])
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in got)  # late stop path ran


def test_overlap_falls_back_for_logprobs_and_penalties(tiny_llama_dir):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    sps = [{"max_new_tokens": 8, "temperature": 0.0},
           {"max_new_tokens": 8, "temperature": 0.0, "repetition_penalty": 1.3},
           {"max_new_tokens": 8, "temperature": 0.0, "frequency_penalty": 0.5}]
    ref = _run(tiny_llama_dir, False, prompts, sps)
    got = _run(tiny_llama_dir, True, prompts, sps)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu") as eng:
        loop = eng.loop
        loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
        a = eng.generate(input_ids=prompts[0], sampling_params=sps[0], return_logprob=True, logprob_start_len=0)
    assert a["output_ids"] == ref[0]["output_ids"]
    assert len(a["meta_info"]["output_token_logprobs"]) == 8


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_overlap_embeddings_same_vectors(tiny_llama_dir, tmp_path, mode):
    """Embedding steps pipelined by the stepper (vectors read after the next launch) give the plain
    loop's vectors: chunked prompts, mean sums carried across chunks, repeated prompts (cache hits)."""
    from tests.test_embeddings import st_dir

    path = st_dir(tiny_llama_dir, str(tmp_path / mode), mode, normalize=True)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(1, 150))] for _ in range(16)]
    prompts += prompts[:4]

    def run(overlap: bool) -> list[dict]:
        with nbgen.Engine(path, dtype="float32", device="cpu", is_embedding=True, chunked_prefill_size=64,
                          max_running_requests=5) as eng:
            if overlap:
                loop = eng.loop
                loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
            return eng.encode(input_ids=prompts)

    plain, piped = run(False), run(True)
    assert [o["meta_info"]["prompt_tokens"] for o in piped] == [len(p) for p in prompts]
    for a, b in zip(plain, piped):
        assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-6)
