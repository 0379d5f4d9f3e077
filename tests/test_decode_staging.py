"""CPU: a decode graph step's staging buffer written by ``DecodeStaging`` (page tables kept in the
``DecodeTables`` arena, the shared-prefix plan reused over the same rows) equals one built from scratch
from the page lists every step: token ids and placeholders, positions, KV slots, page tables, padding,
the longest-first order and the shared-prefix tables, while rows grow, finish, join, come back with a
new list (preemption), get rewritten in place after a prompt step, and repeat as forced rows."""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import pytest
import torch

from nbgen.attention.cascade_plan import SharedPlan, plan_shared
from nbgen.attention.page_tables import DecodeTables, page_tables
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.kernels.batch_sizes import graph_batch_sizes
from nbgen.kernels.triton_decode import longest_first
from nbgen.runtime import cascade_graphs
from nbgen.runtime.cascade_graphs import CascadeTables
from nbgen.runtime.decode_staging import DecodeStaging, StagingLayout
from nbgen.runtime.pages import SCRATCH_PAGE
from nbgen.runtime.step_inputs import placeholder


class _Spec:
    num_q_heads, num_kv_heads, head_dim, device = 8, 2, 16, torch.device("cpu")

    def __init__(self, P: int) -> None:
        self.page_size = P


class _Backend:
    def __init__(self, P: int) -> None:
        self.spec = _Spec(P)


def _valid_plan(plan: SharedPlan, seqs: list[SeqWork], ip: np.ndarray, P: int) -> None:
    """A reused plan still holds: each chunk's rows share its pages with its first row (whose table
    starts at chunk_start), before their own last page; rows in no chunk skip nothing."""
    skip = np.zeros(len(seqs), dtype=np.int32)
    for c in range(len(plan.chunk_pages)):
        rows = plan.chunk_rows[c, : plan.chunk_len[c]].tolist()
        m = int(plan.chunk_pages[c])
        assert plan.chunk_start[c] == ip[rows[0]]
        for k, r in enumerate(rows):
            assert plan.chunk[r] == c and plan.slot[r] == k
            assert m <= seqs[r].start_pos // P and seqs[r].pages[:m] == seqs[rows[0]].pages[:m]
            skip[r] = m
    assert plan.skip.tolist() == skip.tolist()


def _reference(layout: StagingLayout, casc: CascadeTables, seqs: list[SeqWork], ids: list[int], bs: int, P: int,
               cascade: bool, fresh: bool = True, plan: Optional[SharedPlan] = None,
               lead: int = 0) -> tuple[np.ndarray, int, bool]:
    """The staging buffer built from the page lists alone, the entries to copy, whether it plans a cascade
    (``fresh``: planned here, else ``plan`` is used; over the first ``lead`` rows only when given)."""
    buf = np.zeros(layout.size, dtype=np.int32)
    io64, ip, last, order, idx = layout.views(buf)
    n = len(seqs)
    _qo, kv_ptr, pages, lens = page_tables(seqs, P)
    nnz, pad = len(pages), bs - n
    ip[: n + 1], idx[:nnz], last[:n] = kv_ptr, pages, lens
    ip[n + 1: bs + 1] = nnz + np.arange(1, pad + 1)
    last[n:bs] = 1
    idx[nnz: nnz + pad] = SCRATCH_PAGE
    io = io64[: 4 * bs].reshape(4, bs)
    io[0, :n] = [max(t, 0) for t in ids]
    io[1, :n] = [s.start_pos for s in seqs]
    io[2, :n] = [s.pages[s.start_pos // P] * P + s.start_pos % P for s in seqs]
    io[3, :n] = [-t - 1 if t < 0 else -1 for t in ids]
    io[3, n:] = -1
    m = lead or n
    if fresh and cascade and m >= 2:
        plan = plan_shared(ip, idx, m, casc.R, cascade_graphs.MAX_CHUNKS)
        if plan is not None and plan.saved_pages * P < cascade_graphs.MIN_SAVED_TOKENS:
            plan = None
    elif fresh:
        plan = None
    skip = None
    if plan is not None:
        casc.fill(layout.cascade_region(buf), plan, m, bs)
        skip = casc.views(layout.cascade_region(buf))[0][:bs]
    order[:bs] = longest_first(ip[: bs + 1], last[:bs], P, skip)
    return buf, layout.cut[4] + nnz + pad, plan is not None


def _new_request(rng: random.Random, k: int, P: int, prefixes: list[list[int]], pool: list[int]) -> Request:
    n_prompt = rng.randint(2, 12) * P + rng.randrange(P)
    req = Request(str(k), [1] * n_prompt, SamplingParams())
    shared = list(rng.choice(prefixes)) if rng.random() < 0.6 else []
    shared = shared[: n_prompt // P]                  # the prefix cache holds full prompt pages only
    req.pages = shared + [pool.pop() for _ in range(-(-(n_prompt + 1) // P) - len(shared))]
    req.output_ids = []
    return req


@pytest.mark.parametrize("seed,leading", [(seed, False) for seed in range(6)] + [(seed, True) for seed in range(3)])
def test_staging_matches_page_lists(seed: int, leading: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``leading``: steps with forced rows put their sampling rows first (``write(lead=S)``, as the forward
    path stages them): the shared-prefix plan covers those rows only, and is reused while they stay the same
    rows in the same order, whatever forced rows follow."""
    monkeypatch.setattr(cascade_graphs, "MIN_SAVED_TOKENS", 256)     # plans at this small scale too
    rng = random.Random(seed)
    P = rng.choice([4, 16])
    pool = list(range(2, 200_000))
    rng.shuffle(pool)
    prefixes = [[pool.pop() for _ in range(rng.randint(4, 10))] for _ in range(3)]
    casc = CascadeTables(_Backend(P), 64)
    layout = StagingLayout(64, 4096, P, casc.size)
    tables = DecodeTables(P, arena=rng.choice([256, 1 << 14]))    # a small arena: compactions and growth
    staging = DecodeStaging(layout, tables, graph_batch_sizes(64), casc, mrope=False)
    bufs = [np.zeros(layout.size, dtype=np.int32) for _ in range(2)]
    live = [_new_request(rng, k, P, prefixes, pool) for k in range(rng.randint(20, 60))]
    k_next = len(live)
    cascades = reused = leads = forced_reused = 0
    for step in range(120):
        if rng.random() < 0.25 and live:                      # a request finishes
            live.pop(rng.randrange(len(live)))
        if rng.random() < 0.25 and len(live) < 60:            # one joins
            live.insert(rng.randrange(len(live) + 1), _new_request(rng, k_next, P, prefixes, pool))
            k_next += 1
        if rng.random() < 0.05 and live:                      # preempted and back: a new list object
            r = rng.choice(live)
            r.pages = list(r.pages)
        if rng.random() < 0.05 and live:                      # a prompt step, then its pages rewritten in place
            r = rng.choice(live)
            tables.forget(ScheduledBatch([SeqWork(r, [1, 1], 0, r.pages, True)], P))
            r.pages[-1] = pool.pop()
        seqs, ids = [], []
        forced = rng.randrange(len(live)) if rng.random() < (0.5 if leading else 0.1) else -1   # a request's forced rows
        prompt = rng.randrange(len(live)) if rng.random() < 0.05 else -1    # a row at its last prompt token
        for row, r in enumerate(live):
            r.output_ids.append(0)
            kv = r.num_tokens
            while len(r.pages) * P < kv + 2:
                r.pages.append(pool.pop())
            k = 2 if row == forced else 1
            for j in range(k):
                start = kv - k + j if row != prompt else len(r.prompt_ids) - 1
                seqs.append(SeqWork(r, [0], start, r.pages, j == k - 1))
                ids.append(placeholder(row) if rng.random() < 0.7 else rng.randrange(1000))
        seqs = seqs[:64]
        ids = ids[: len(seqs)]
        lead = 0
        if leading:                                            # the sampling rows first, forced rows after
            order = [i for i, s in enumerate(seqs) if s.sample] + [i for i, s in enumerate(seqs) if not s.sample]
            lead = sum(s.sample for s in seqs) if len(order) and not seqs[order[-1]].sample else 0
            seqs, ids = [seqs[i] for i in order], [ids[i] for i in order]
        n = len(seqs)
        bs = staging.bs_of[n]
        cascade = bs >= cascade_graphs.MIN_BS
        buf = bufs[step % 2]
        buf[:] = 7
        version = tables.version
        host = staging.write(buf, seqs, ids, cascade, lead)
        same_rows = tables.version == version                  # the plan may be the one of earlier steps
        reuse = host.plan is not None and same_rows
        ref, end, planned = _reference(layout, casc, seqs, ids, bs, P, cascade, not same_rows, host.plan, lead)
        leads += lead > 0 and planned
        forced_reused += lead > 0 and reuse
        assert (host.n, host.bs, host.end) == (n, bs, end)
        assert host.placeholders == any(t < 0 for t in ids)
        assert (host.plan is not None) == planned
        if host.plan is not None:
            _valid_plan(host.plan, seqs[: lead or n], layout.views(ref)[1], P)
        cascades += planned
        reused += reuse
        got, want = layout.views(buf), layout.views(ref)
        for name, a, b, m in zip(("io", "indptr", "last", "order"), got, want, (4 * bs, bs + 1, bs, bs)):
            assert np.array_equal(a[:m], b[:m]), (step, name)
        assert np.array_equal(buf[layout.cut[4]: end], ref[layout.cut[4]: end]), step
        if planned:
            C = len(host.plan.chunk_pages)
            for k, (a, b) in enumerate(zip(casc.views(layout.cascade_region(buf)),
                                           casc.views(layout.cascade_region(ref)))):
                m = bs if k < 3 else cascade_graphs.MAX_CHUNKS if k == 5 else C
                assert np.array_equal(a[:m], b[:m]), (step, k)
    assert cascades > 0 and reused > 0
    if leading:
        assert leads > 0 and forced_reused > 0                # planned and reused over steps with forced rows


def test_padding_step() -> None:
    P = 16
    casc = CascadeTables(_Backend(P), 32)
    layout = StagingLayout(32, 1024, P, casc.size)
    staging = DecodeStaging(layout, DecodeTables(P), graph_batch_sizes(32), casc, mrope=False)
    buf = np.full(layout.size, 7, dtype=np.int32)
    host = staging.write_padding(buf, 24)
    io64, ip, last, order, idx = layout.views(buf)
    assert (host.n, host.bs, host.end, host.placeholders, host.plan) == (0, 24, layout.cut[4] + 24, False, None)
    assert io64[: 3 * 24].tolist() == [0] * 72 and io64[72: 96].tolist() == [-1] * 24
    assert ip[:25].tolist() == list(range(25)) and last[:24].tolist() == [1] * 24
    assert order[:24].tolist() == list(range(24)) and idx[:24].tolist() == [SCRATCH_PAGE] * 24


def test_tables_prune_finished_lists() -> None:
    """Many short-lived requests: the slots of lists no longer stepped are freed (and their arena space
    reused), the tables still equal the page lists'."""
    P, rng = 4, random.Random(1)
    tables = DecodeTables(P, arena=512)
    live: list[Request] = []
    for step in range(400):
        live = [r for r in live if rng.random() < 0.7]
        while len(live) < 4:
            r = Request(str(step * 10 + len(live)), [1] * rng.randint(1, 30), SamplingParams())
            r.pages = [rng.randrange(1, 10_000) for _ in range(-(-(len(r.prompt_ids) + 1) // P))]
            live.append(r)
        seqs = []
        for r in live:
            r.output_ids.append(0)
            while len(r.pages) * P < r.num_tokens:
                r.pages.append(rng.randrange(1, 10_000))
            seqs.append(SeqWork(r, [0], r.num_tokens - 1, r.pages, True))
        indptr, idx, last, pos, slots = tables.build(seqs)
        _, ref_ptr, ref_idx, ref_last = page_tables(seqs, P)
        assert indptr.tolist() == ref_ptr and idx.tolist() == ref_idx and last.tolist() == ref_last
        assert slots.tolist() == [s.pages[s.start_pos // P] * P + s.start_pos % P for s in seqs]
