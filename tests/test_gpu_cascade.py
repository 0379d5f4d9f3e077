"""Shared-prefix (cascade) decode attention on flashinfer (CUDA only): the two-level kernels against the
torch reference, and an engine whose decode steps run by cascade against the plain decode graphs."""
from __future__ import annotations

import random

import pytest
import torch

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.page_tables import DecodeTables
from nbgen.attention.cascade_torch import cascade_decode

import nbgen
from tests.test_cascade import plan_of
from tests.tiny_models import GREEDY_SP, assert_close_runs

gpu = pytest.mark.gpu


def _hnd_to_torch(c: torch.Tensor) -> torch.Tensor:
    """HND pages [pages, Hkv, P, D] -> the torch backend's [Hkv, pages * P, D] (fp32)."""
    n, h, p, d = c.shape
    return c.permute(1, 0, 2, 3).reshape(h, n * p, d).float()


@gpu
@pytest.mark.parametrize("hq,hkv,page", [(16, 8, 16), (32, 8, 16), (8, 8, 64)])
def test_flashinfer_cascade_matches_reference(hq, hkv, page):
    from nbgen.attention.cascade_flashinfer import FlashInferCascade
    from nbgen.attention.flashinfer_backend import WORKSPACE_BYTES, decode_tensor_cores

    rng = random.Random(hq + page)
    torch.manual_seed(0)
    D, num_pages, dev = 128, 4096, torch.device("cuda")
    spec = KVCacheSpec(1, num_pages, page, hq, hkv, D, torch.bfloat16, dev)
    kc = torch.randn(num_pages, hkv, page, D, dtype=torch.bfloat16, device=dev)
    vc = torch.randn_like(kc)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    prefixes = [[free.pop() for _ in range(rng.randint(1, 40))] for _ in range(5)]
    pages, lens = [], []
    for _ in range(70):                 # groups of several rows, and rows in no group
        head = rng.choice(prefixes + [[]])
        n = len(head) * page + rng.randint(1, 5 * page)
        pages.append(head + [free.pop() for _ in range((n + page - 1) // page - len(head))])
        lens.append(n)
    plan = plan_of(pages, lens, page, min_saved_tokens=1)
    assert plan is not None and len(plan.groups) >= 4
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    fc = FlashInferCascade(spec, ws, "HND", decode_tensor_cores(hq // hkv), D ** -0.5, DecodeTables(page))
    q = torch.randn(len(lens), hq, D, dtype=torch.bfloat16, device=dev)
    for _ in range(2):                  # a second plan of the same wrappers
        out = fc.run(fc.plan(plan), q, (kc, vc))
    ref = cascade_decode(q.float(), _hnd_to_torch(kc), _hnd_to_torch(vc), plan, D ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.parametrize("eager", [False, True])
def test_engine_cascade_matches_plain_graphs(gpu_model_dir, monkeypatch, eager):
    """Requests sharing a 40-page prompt prefix: decode steps by cascade (through the piecewise graphs,
    or eagerly) give the plain decode graphs' tokens and logprobs (bf16 near-ties aside:
    ``assert_close_runs``)."""
    from nbgen.attention import cascade_flashinfer as cf
    from nbgen.runtime import prefill_graphs

    rng = random.Random(5)
    prefix = [rng.randrange(2, 512) for _ in range(640)]
    prompts = [prefix + [rng.randrange(2, 512) for _ in range(rng.randint(1, 60))] for _ in range(12)]

    def run() -> list[dict]:
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16,
                          disable_piecewise_cuda_graph=eager) as eng:
            eng.generate(input_ids=[prefix], sampling_params={**GREEDY_SP, "max_new_tokens": 1}, use_tqdm=False)
            out = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, use_tqdm=False)
            assert eng.get_server_info()["cuda_graph_batch_sizes"]
        assert all(o["meta_info"]["cached_tokens"] >= len(prefix) for o in out)
        return out
    planned = []
    plan = cf.FlashInferCascade.plan

    def spy(self, p):
        planned.append(p)
        return plan(self, p)

    monkeypatch.setattr(cf.FlashInferCascade, "plan", spy)
    pieces: list[int] = []
    run_pieces = prefill_graphs.PrefillGraphRunner.run

    def pieces_spy(self, batch, ids, patch=None):
        pieces.append(batch.is_decode_only)
        return run_pieces(self, batch, ids, patch)

    monkeypatch.setattr(prefill_graphs.PrefillGraphRunner, "run", pieces_spy)
    monkeypatch.setattr(cf.FlashInferCascade, "min_saved_layer_bytes", None)
    plain = run()
    assert not planned
    monkeypatch.setattr(cf.FlashInferCascade, "min_saved_layer_bytes", 1)
    cascade = run()
    assert len(planned) >= GREEDY_SP["max_new_tokens"] // 2
    assert max(len(g.rows) for p in planned for g in p.groups) == len(prompts)
    assert sum(pieces) == (0 if eager else len(planned))       # cascade decode steps on the graph pieces
    assert_close_runs(cascade, plain)
