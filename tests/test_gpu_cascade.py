"""The shared-prefix decode graphs end to end (CUDA): requests sharing a long cached prompt prefix decode
on the cascade graphs, with the plain decode graphs' tokens and logprobs (bf16 near-ties aside)."""
from __future__ import annotations

import random

import pytest

import nbgen
from nbgen.runtime import cascade_graphs
from tests.tiny_models import GREEDY_SP, assert_close_runs

gpu = pytest.mark.gpu


@gpu
def test_engine_cascade_matches_plain_graphs(gpu_model_dir, monkeypatch):
    """Two groups of 12 requests sharing a 640- / 1,000-token prefix plus 6 unrelated ones (rows in no
    chunk), 30 rows: a graph batch of 32 where every decode step runs the cascade graph."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(2, 512) for _ in range(n)] for n in (640, 1000)]
    prompts = [prefixes[i % 2] + [rng.randrange(2, 512) for _ in range(rng.randint(1, 60))] for i in range(24)]
    prompts += [[rng.randrange(2, 512) for _ in range(rng.randint(20, 300))] for _ in range(6)]
    planned: list[int] = []
    plan = cascade_graphs.CascadeTables.plan

    def spy(self, *a):
        p = plan(self, *a)
        if p is not None:
            planned.append(int(p.chunk_len.sum()))
        return p

    monkeypatch.setattr(cascade_graphs.CascadeTables, "plan", spy)

    def run() -> list[dict]:
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=32) as eng:
            eng.generate(input_ids=prefixes, sampling_params={**GREEDY_SP, "max_new_tokens": 1}, use_tqdm=False)
            out = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, use_tqdm=False)
            assert eng.get_server_info()["cuda_graph_batch_sizes"]
        assert all(o["meta_info"]["cached_tokens"] >= 640 for o in out[:24])
        return out

    with monkeypatch.context() as m:
        m.setattr(cascade_graphs, "supported", lambda backend, variant: False)
        plain = run()
    assert not planned
    cascade = run()
    assert len(planned) >= GREEDY_SP["max_new_tokens"] - 2 and max(planned) == 24, planned
    assert_close_runs(cascade, plain)


@gpu
def test_greedy_heads_same_ids(gpu_model_dir, monkeypatch):
    """All-greedy decode steps take their ids from the greedy heads' graphs (runtime/greedy_heads.py),
    over the plain and the shared-prefix decode graphs: the same ids as the sampler over the graphs' logits."""
    from nbgen.runtime import greedy_heads
    from nbgen.runtime.cuda_graphs import CudaGraphRunner

    rng = random.Random(7)
    prefix = [rng.randrange(2, 512) for _ in range(800)]
    prompts = [prefix + [rng.randrange(2, 512) for _ in range(rng.randint(1, 40))] for _ in range(20)]
    prompts += [[rng.randrange(2, 512) for _ in range(rng.randint(20, 300))] for _ in range(10)]
    replays: list[tuple[int, bool]] = []
    run_head = greedy_heads.GreedyHeads.run

    def spy(self, bs, cascade):
        replays.append((bs, cascade))
        run_head(self, bs, cascade)

    monkeypatch.setattr(greedy_heads.GreedyHeads, "run", spy)

    def run() -> list[list[int]]:
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=32) as eng:
            alone = eng.generate(input_ids=prompts[20:], sampling_params=GREEDY_SP, use_tqdm=False)   # plain graphs
            eng.generate(input_ids=[prefix], sampling_params={**GREEDY_SP, "max_new_tokens": 1}, use_tqdm=False)
            out = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False)
        return [o["output_ids"] for o in alone + out]

    heads = run()
    assert any(c for _bs, c in replays) and any(not c for _bs, c in replays), replays
    monkeypatch.setattr(CudaGraphRunner, "capture_heads", lambda self, logits, vocab: None)
    replays.clear()
    plain = run()
    assert not replays
    assert heads == plain
