"""Shared-prefix (cascade) decode: the plan (torch-free), the torch two-level math against plain
attention, and an engine whose decode steps run it against the plain path (greedy, fp32)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import nbgen
from nbgen.attention import torch_backend
from nbgen.attention.cascade_torch import attend_lse, cascade_decode, merge_states
from nbgen.core.cascade_plan import plan_cascade


def plan_of(pages: list[list[int]], kv_lens: list[int], page_size: int, min_saved_tokens: int):
    """plan_cascade of rows given as page lists (exactly their pages) and token counts."""
    ptr = np.cumsum([0] + [len(p) for p in pages])
    last = [n - (len(p) - 1) * page_size for p, n in zip(pages, kv_lens)]
    assert all(1 <= x <= page_size for x in last)
    return plan_cascade(ptr, np.concatenate(pages), last, page_size, min_saved_tokens)


def test_plan_groups_rows_by_shared_full_pages():
    P = 4
    pre = [10, 11, 12]
    pages = [pre + [20, 21], pre + [30], pre + [40, 41, 42], [50, 51], [10, 11, 60]]
    lens = [19, 13, 23, 6, 10]        # row 1: 13 tokens = 3 full pages + its own page
    plan = plan_of(pages, lens, P, min_saved_tokens=1)
    assert plan is not None
    # row 4 shares only two pages with the reference: kept out (3 x 2 others beats 2 x 3)
    assert [(g.rows, g.prefix_pages) for g in plan.groups] == [([0, 1, 2], pre)]
    assert plan.level0_rows.tolist() == [0, 1, 2] and plan.level0_qo_indptr.tolist() == [0, 3]
    assert plan.level0_kv_indptr.tolist() == [0, 3] and plan.level0_kv_indices.tolist() == pre
    ip, idx = plan.suffix_kv_indptr, plan.suffix_kv_indices.tolist()
    assert [idx[ip[i]: ip[i + 1]] for i in range(5)] == [[20, 21], [30], [40, 41, 42], [50, 51], [10, 11, 60]]
    assert plan.suffix_last_page_len.tolist() == [3, 1, 3, 2, 2]
    assert plan.saved_tokens == 3 * P * 2 and plan.total_tokens == sum(lens)


def test_plan_threshold_and_own_page():
    P = 4
    pages = [[1, 2, 3], [1, 2, 4]]
    assert plan_of(pages, [12, 12], P, min_saved_tokens=9) is None       # saves 2 pages x 1 row = 8
    assert plan_of(pages, [12, 12], P, min_saved_tokens=8) is not None
    # the page of a row's new token is never shared, even when both rows list the same page there
    assert plan_of([[1, 2], [1, 2]], [8, 8], P, min_saved_tokens=1).groups[0].prefix_pages == [1]
    assert plan_of([[1], [1]], [4, 4], P, min_saved_tokens=1) is None
    assert plan_of([[1, 2], [3, 4]], [8, 8], P, min_saved_tokens=1) is None


def _plain(q, kc, vc, pages, lens, P, scale):
    """Each row over all its tokens, one at a time (the reference)."""
    out = []
    for i, (p, n) in enumerate(zip(pages, lens)):
        slots = (torch.tensor(p)[:, None] * P + torch.arange(P)).reshape(-1)[:n]
        o, _ = attend_lse(q[i][None, None], kc[:, slots][None], vc[:, slots][None], scale)
        out.append(o[0, 0])
    return torch.stack(out)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_cascade_equals_plain_attention(hq, hkv):
    rng = random.Random(hq)
    torch.manual_seed(hq)
    P, D, num_pages = 4, 16, 200
    kc = torch.randn(hkv, num_pages * P, D)
    vc = torch.randn(hkv, num_pages * P, D)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    prefixes = [[free.pop() for _ in range(rng.randint(1, 6))] for _ in range(3)]
    pages, lens, heads = [], [], []
    for _ in range(12):
        head = rng.choice(prefixes + [[]])
        n = len(head) * P + rng.randint(1, 11)
        own = [free.pop() for _ in range((n + P - 1) // P - len(head))]
        pages.append(head + own)
        lens.append(n)
        heads.append(tuple(head))
    plan = plan_of(pages, lens, P, min_saved_tokens=1)
    assert plan is not None and len(plan.groups) >= 2
    # every prefix used by two or more rows is one group of exactly those rows
    want = sorted(([i for i, h in enumerate(heads) if h == x], list(x)) for x in set(heads) if x and heads.count(x) > 1)
    assert sorted((g.rows, g.prefix_pages) for g in plan.groups) == want
    q = torch.randn(len(lens), hq, D)
    scale = D ** -0.5
    torch.testing.assert_close(cascade_decode(q, kc, vc, plan, scale), _plain(q, kc, vc, pages, lens, P, scale),
                               rtol=1e-5, atol=1e-5)


def test_merge_states_is_softmax_over_the_union():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    full, lse = attend_lse(q, k, v, 0.3)
    a, la = attend_lse(q, k[:, :, :4], v[:, :, :4], 0.3)
    b, lb = attend_lse(q, k[:, :, 4:], v[:, :, 4:], 0.3)
    o, l2 = merge_states(a, la, b, lb)
    torch.testing.assert_close(o, full)
    torch.testing.assert_close(l2, lse)


def test_engine_cascade_greedy_matches_plain(tiny_llama_dir, monkeypatch):
    """Requests sharing a 5-page prompt prefix (from the prefix cache) decode through the cascade path:
    the same greedy ids as the plain decode path."""
    rng = random.Random(0)
    prefix = [rng.randint(5, 250) for _ in range(22)]
    prompts = [prefix + [rng.randint(5, 250) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

    def run() -> list[list[int]]:
        with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", page_size=4) as eng:
            eng.generate(input_ids=[prefix], sampling_params={**sp, "max_new_tokens": 1})   # cache the prefix
            return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]

    plain = run()
    calls = []

    def counting(*a, **kw):
        calls.append(a[3])
        return cascade_decode(*a, **kw)

    monkeypatch.setattr(torch_backend.TorchAttentionBackend, "cascade_min_saved_tokens", 1)
    monkeypatch.setattr(torch_backend, "cascade_decode", counting)
    assert run() == plain
    assert calls and max(len(p.groups[0].rows) for p in calls) == len(prompts)
    assert all(len(p.groups[0].prefix_pages) >= 5 for p in calls)


def test_shared_floor_counts_each_prefix_once_per_step():
    from nbgen.bench.floor import floor_seconds, shared_floor_seconds
    from nbgen.bench.workloads import PREFIX_LEN, prefix_workload

    prompts, outs, groups = prefix_workload()
    ins = [len(p) for p in prompts]
    assert len(prompts) == 256 and sorted(set(groups)) == list(range(8))
    assert all(p[:PREFIX_LEN] == prompts[groups.index(g)][:PREFIX_LEN] for p, g in zip(prompts, groups))
    # no prefix: every token is a seq's own, the naive floor
    assert shared_floor_seconds(0, groups, ins, outs, 10, 3, 1.0) == floor_seconds(ins, outs, 10, 3, 1.0)
    # one seq per group: the same; two seqs of one group, both decoding 4 steps: the prefix once a step
    assert shared_floor_seconds(5, [0, 1], [7, 9], [5, 5], 0, 1, 1.0) == floor_seconds([7, 9], [5, 5], 0, 1, 1.0)
    assert shared_floor_seconds(5, [0, 0], [7, 9], [5, 5], 0, 1, 1.0) == floor_seconds([7, 9], [5, 5], 0, 1, 1.0) - 5 * 4


class _FakeFlashInfer:
    """flashinfer's paged wrappers and merge as torch references on HND pages (CPU), so the cascade
    module's glue (plans, row gathers, merge, scatter) runs without a GPU."""

    @staticmethod
    def _tokens(kv, pages, n):
        k, v = (c[torch.as_tensor(pages, dtype=torch.long)] for c in kv)          # [n_pages, Hkv, P, D]
        return [x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, :n].float() for x in (k, v)]

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, ws, layout, backend=None):
            assert layout == "HND"

        def plan(self, qo, ptr, idx, last, hq, hkv, d, P, causal=True, sm_scale=None, **kw):
            assert not causal
            self.t = (qo.tolist(), ptr.tolist(), idx.tolist(), last.tolist(), P, sm_scale)

        def run(self, q, kv, out=None, return_lse=False):
            qo, ptr, idx, last, P, scale = self.t
            o, lse = torch.empty(q.shape) if out is None else out, torch.empty(q.shape[:2])
            for r in range(len(qo) - 1):
                n = (ptr[r + 1] - ptr[r] - 1) * P + last[r]
                k, v = _FakeFlashInfer._tokens(kv, idx[ptr[r]: ptr[r + 1]], n)
                a, b = attend_lse(q[None, qo[r]: qo[r + 1]], k[None], v[None], scale)
                o[qo[r]: qo[r + 1]], lse[qo[r]: qo[r + 1]] = a[0], b[0]
            return o, lse

    class BatchDecodeWithPagedKVCacheWrapper(BatchPrefillWithPagedKVCacheWrapper):
        def __init__(self, ws, layout, use_tensor_cores=False):
            assert layout == "HND"

        def plan(self, ptr, idx, last, hq, hkv, d, P, sm_scale=None, **kw):
            self.t = (list(range(len(last) + 1)), ptr.tolist(), idx.tolist(), last.tolist(), P, sm_scale)

    @staticmethod
    def merge_state_in_place(v, s, v2, s2):
        o, lse = merge_states(v.float(), s, v2.float(), s2)
        v.copy_(o)
        s.copy_(lse)


def test_flashinfer_cascade_glue_with_reference_kernels(monkeypatch):
    """FlashInferCascade (choose from a batch's page tables, plan, run) with reference kernels in place
    of flashinfer's: the plain attention of every row."""
    from types import SimpleNamespace

    from nbgen.attention import cascade_flashinfer as cf
    from nbgen.attention.base import KVCacheSpec
    from nbgen.attention.page_tables import DecodeTables

    monkeypatch.setattr(cf, "flashinfer", _FakeFlashInfer)
    monkeypatch.setattr(cf, "_pinned", lambda values, dtype=np.int32: torch.from_numpy(np.asarray(values, dtype=dtype)))
    monkeypatch.setattr(cf.FlashInferCascade, "_planned", lambda self, w: None)
    rng = random.Random(7)
    torch.manual_seed(7)
    P, D, hq, hkv, num_pages = 4, 16, 8, 2, 300
    spec = KVCacheSpec(2, num_pages, P, hq, hkv, D, torch.float32, torch.device("cpu"))
    kc, vc = torch.randn(num_pages, hkv, P, D), torch.randn(num_pages, hkv, P, D)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    prefixes = [[free.pop() for _ in range(rng.randint(2, 8))] for _ in range(3)]
    seqs = []
    for i in range(16):
        head = rng.choice(prefixes + [[]])
        n = len(head) * P + rng.randint(1, 9)
        pages = head + [free.pop() for _ in range((n + P - 1) // P - len(head))]
        seqs.append(SimpleNamespace(pages=pages, start_pos=n - 1, kv_len=n, q_len=1,
                                    req=SimpleNamespace(rid=str(i), prompt_ids=[0])))
    batch = SimpleNamespace(seqs=seqs, is_decode_only=True)
    fc = cf.FlashInferCascade(spec, torch.zeros(1), "HND", True, D ** -0.5, DecodeTables(P))
    monkeypatch.setattr(cf.FlashInferCascade, "min_saved_layer_bytes", None)
    assert fc.choose(batch) is None
    fc = cf.FlashInferCascade(spec, torch.zeros(1), "HND", True, D ** -0.5, DecodeTables(P))
    monkeypatch.setattr(cf.FlashInferCascade, "min_saved_layer_bytes", 1)
    plan = fc.choose(batch)
    assert plan is not None and len(plan.groups) >= 2 and fc.choose(batch) is plan
    assert fc.slots(batch).tolist() == [s.pages[-1] * P + (s.kv_len - 1) % P for s in seqs]
    q = torch.randn(len(seqs), hq, D)
    out = fc.run(fc.plan(plan), q, (kc, vc))
    into = torch.empty_like(q)
    assert fc.run(fc.plan(plan), q, (kc, vc), into) is into
    torch.testing.assert_close(into, out)
    ref = _plain(q, kc.permute(1, 0, 2, 3).reshape(hkv, -1, D), vc.permute(1, 0, 2, 3).reshape(hkv, -1, D),
                 [s.pages for s in seqs], [s.kv_len for s in seqs], P, D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
