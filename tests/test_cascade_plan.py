"""attention/cascade_plan.py: the shared-prefix chunk tables against a brute-force grouping, on random
page tables whose shared pages form leading runs (as the radix prefix cache hands them out), and its
host cost at 256 rows."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

from nbgen.attention.cascade_plan import MIN_SHARED_PAGES, plan_shared


def _tables(rng: random.Random, n: int, max_pages: int = 60):
    """n page tables: a tree of cached prefixes (each a path of page ids; later ones branch off earlier
    ones at random depths), each row taking a prefix of one path (or none) then pages of its own."""
    nxt = iter(range(1, 10 ** 7))
    paths: list[list[int]] = []
    for _ in range(rng.randint(1, 8)):
        base = rng.choice(paths)[: rng.randint(0, max_pages)] if paths and rng.random() < 0.5 else []
        paths.append(base + [next(nxt) for _ in range(rng.randint(1, max_pages))])
    tables = []
    for _ in range(n):
        head = rng.choice(paths)[: rng.randint(0, max_pages)] if rng.random() < 0.8 else []
        tables.append(head + [next(nxt) for _ in range(rng.randint(1, 6))])
    indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum([len(t) for t in tables], out=indptr[1:])
    return tables, indptr, np.asarray([p for t in tables for p in t], dtype=np.int32)


def _brute_saved(tables: list[list[int]]) -> int:
    """Best pages saved per group of equal first pages, page by page: max over m of m x (rows sharing
    >= m leading full pages with the group's first row - 1), m >= MIN_SHARED_PAGES."""
    groups: dict[int, list[list[int]]] = {}
    for t in tables:
        if len(t) - 1 >= MIN_SHARED_PAGES:
            groups.setdefault(t[0], []).append(t)
    total = 0
    for rows in groups.values():
        ref = rows[0]
        lcp = []
        for t in rows:
            k = 0
            while k < min(len(t), len(ref)) - 1 and t[k] == ref[k]:
                k += 1
            lcp.append(k)
        total += max([m * (sum(x >= m for x in lcp) - 1) for m in set(lcp) if m >= MIN_SHARED_PAGES] + [0])
    return total


@pytest.mark.parametrize("seed", range(40))
def test_plan_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 8, 30, 100])
    tables, indptr, indices = _tables(rng, n)
    plan = plan_shared(indptr, indices, n, rows_per_chunk=10 ** 6, max_chunks=10 ** 6)
    best = _brute_saved(tables)
    if plan is None:
        assert best == 0
        return
    assert plan.saved_pages == best
    _check_valid(plan, tables, indices, 10 ** 6)


def _check_valid(plan, tables, indices, rows_per_chunk: int) -> None:
    """Every chunk's rows hold its shared pages (and a page of their own after them), slots agree."""
    C = len(plan.chunk_pages)
    assert (plan.chunk_len >= 2).all() and (plan.chunk_len <= rows_per_chunk).all()
    for c in range(C):
        shared = indices[plan.chunk_start[c]: plan.chunk_start[c] + plan.chunk_pages[c]].tolist()
        assert len(shared) >= MIN_SHARED_PAGES
        for j in range(plan.chunk_len[c]):
            r = int(plan.chunk_rows[c, j])
            assert plan.chunk[r] == c and plan.slot[r] == j and plan.skip[r] == len(shared)
            assert tables[r][: len(shared)] == shared and len(tables[r]) > len(shared)
    grouped = plan.chunk >= 0
    assert grouped.sum() == plan.chunk_len.sum() and (plan.skip[~grouped] == 0).all()


@pytest.mark.parametrize("seed", range(10))
def test_plan_chunks_and_limits(seed):
    """Groups cut into chunks of rows_per_chunk rows, at most max_chunks of them, the best kept."""
    rng = random.Random(100 + seed)
    tables, indptr, indices = _tables(rng, 120)
    free = plan_shared(indptr, indices, 120, rows_per_chunk=10 ** 6, max_chunks=10 ** 6)
    plan = plan_shared(indptr, indices, 120, rows_per_chunk=7, max_chunks=5)
    if free is None:
        assert plan is None
        return
    _check_valid(plan, tables, indices, 7)
    assert len(plan.chunk_pages) <= 5 and plan.saved_pages <= free.saved_pages
    assert list(plan.chunk_pages * (plan.chunk_len - 1)) == sorted(plan.chunk_pages * (plan.chunk_len - 1),
                                                                   reverse=True)


def test_no_sharing_and_short_rows():
    indptr = np.array([0, 5, 10, 11], dtype=np.int32)
    assert plan_shared(indptr, np.arange(11, dtype=np.int32), 3, 32, 16) is None
    same = np.array([1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 5], dtype=np.int32)   # 4 shared full pages
    plan = plan_shared(indptr, same, 3, 32, 16)
    assert plan is not None and plan.skip.tolist() == [4, 4, 0] and plan.chunk_len.tolist() == [2]
    # the same pages but the 4th is the rows' new-token page: only 3 full pages shared, below the minimum
    assert plan_shared(np.array([0, 4, 8], dtype=np.int32), same[:8], 2, 32, 16) is None


def test_plan_host_cost_at_256_rows():
    """W-prefix's shape: 8 prefixes of 125 pages, 256 rows with 5-40 pages of their own; the plan
    must cost far below a decode step's ~1 ms host budget for it."""
    rng = random.Random(0)
    prefixes = [list(range(1000 * (i + 1), 1000 * (i + 1) + 125)) for i in range(8)]
    nxt = iter(range(10 ** 5, 10 ** 7))
    tables = [prefixes[i % 8] + [next(nxt) for _ in range(rng.randint(5, 40))] for i in range(256)]
    indptr = np.zeros(257, dtype=np.int32)
    np.cumsum([len(t) for t in tables], out=indptr[1:])
    indices = np.asarray([p for t in tables for p in t], dtype=np.int32)
    plan = plan_shared(indptr, indices, 256, 32, 16)
    assert plan is not None and len(plan.chunk_pages) == 8 and (plan.chunk_pages == 125).all()
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        plan_shared(indptr, indices, 256, 32, 16)
        times.append(time.perf_counter() - t0)
    us = 1e6 * float(np.median(times))
    print(f"plan_shared at 256 rows x ~147 pages: {us:.0f} us (median of 200)")
    assert us < 500
