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
