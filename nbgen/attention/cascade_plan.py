"""Which rows of a decode batch share leading KV pages, as fixed-size chunk tables (numpy, torch-free).

The prefix cache hands requests with a common prompt prefix the same physical pages, and a request
always holds a whole root path of the radix tree (runtime/prefix_cache.py: every cached page sits at
one place in the tree). So two live rows with the same page id at position k of their page tables
hold the same pages at every position before k too: the pages two rows share form a leading run,
and its length is found by a binary search over positions instead of a page-by-page comparison.

A plan (``plan_shared``) groups the rows by their first page, finds each row's shared run against
its group's first row (one vectorised binary search over all rows), keeps in each group the
members and run length that save the most page reads (length x (members - 1)), and cuts the
groups into chunks of at most ``rows_per_chunk`` rows (one level-0 tile of the shared-prefix
kernel, kernels/triton_cascade.py). At most ``max_chunks`` chunks are kept (those saving the most);
rows in no kept chunk attend over their whole table in level 1. Cost: ~60-90 us at 256 rows of
~150 pages on this 2-core VM (``tests/test_cascade_plan.py`` prints it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_SHARED_PAGES = 4     # a shared run shorter than this is not worth a level-0 tile


@dataclass
class SharedPlan:
    """The chunk tables of one decode batch (n rows); int32 arrays.

    Per row: ``skip`` [n] leading pages level 1 skips (its chunk's shared pages, else 0), ``chunk``
    [n] its chunk or -1, ``slot`` [n] its place in the chunk. Per chunk (C = len(chunk_pages)):
    ``chunk_start`` [C] offset of the shared pages in ``kv_indices`` (the chunk's first row's table),
    ``chunk_pages`` [C] shared full pages, ``chunk_rows`` [C, rows_per_chunk] batch rows (0-padded),
    ``chunk_len`` [C] rows. ``saved_pages``: page reads per layer and kv head the cascade saves.
    """

    skip: np.ndarray
    chunk: np.ndarray
    slot: np.ndarray
    chunk_start: np.ndarray
    chunk_pages: np.ndarray
    chunk_rows: np.ndarray
    chunk_len: np.ndarray
    saved_pages: int


def shared_runs(kv_indptr: np.ndarray, kv_indices: np.ndarray, rows: np.ndarray, ref: np.ndarray,
                limit: np.ndarray) -> np.ndarray:
    """For each pair (rows[i], ref[i]) with equal first pages, how many leading pages (<= limit[i])
    their tables share: the largest m with equal pages at position m - 1 (a binary search, valid
    because shared pages form a leading run)."""
    lo = np.ones(len(rows), dtype=np.int64)              # position 0 is equal (same first page)
    hi = limit.astype(np.int64)
    a, b = kv_indptr[rows].astype(np.int64) - 1, kv_indptr[ref].astype(np.int64) - 1
    for _ in range(int(hi.max()).bit_length()):          # lo == hi stays put: mid = lo is equal
        mid = (lo + hi + 1) >> 1                         # candidate length; position mid - 1
        same = kv_indices[a + mid] == kv_indices[b + mid]
        lo = np.where(same, mid, lo)
        hi = np.where(same, hi, mid - 1)
    return lo


def _starts(keys: np.ndarray) -> np.ndarray:
    """Where each run of equal values in ``keys`` starts (keys non-empty)."""
    head = np.empty(len(keys), dtype=bool)
    head[0] = True
    np.not_equal(keys[1:], keys[:-1], out=head[1:])
    return np.flatnonzero(head)


def _lengths(starts: np.ndarray, total: int) -> np.ndarray:
    """Run lengths from run starts over ``total`` items."""
    return np.diff(starts, append=total)


def plan_shared(kv_indptr: np.ndarray, kv_indices: np.ndarray, n: int, rows_per_chunk: int,
                max_chunks: int) -> SharedPlan | None:
    """The shared-prefix plan of the first ``n`` rows of decode page tables (``kv_indptr`` [>= n + 1],
    ``kv_indices``; each row's last page holds its new token and is its own), or None when no chunk
    of >= 2 rows shares >= MIN_SHARED_PAGES pages."""
    ip = kv_indptr[: n + 1].astype(np.int64)
    full = ip[1:] - ip[:-1] - 1                          # pages wholly before each row's new-token page
    cand = np.flatnonzero(full >= MIN_SHARED_PAGES)
    if len(cand) < 2:
        return None
    first = kv_indices[ip[cand]]
    o = np.argsort(first, kind="stable")
    cand, first = cand[o], first[o]
    st = _starts(first)                                  # runs of equal first pages
    size = _lengths(st, len(cand))
    multi = np.repeat(size > 1, size)
    if not multi.any():
        return None
    cand = cand[multi]
    run = np.repeat(np.arange(len(st)), size)[multi]
    rs = _starts(run)
    ref = np.repeat(cand[rs], _lengths(rs, len(cand)))   # each run's first row
    m = shared_runs(ip, kv_indices, cand, ref, np.minimum(full[cand], full[ref]))
    # within each run: members by shared length, longest first; keeping the k longest shares m_k pages
    o = np.lexsort((-m, run))
    cand, run, m = cand[o], run[o], m[o]
    rstart, rlen = rs, _lengths(rs, len(cand))          # the runs keep their places
    rank = np.arange(len(cand)) - np.repeat(rstart, rlen)
    gain = m * rank                                      # pages saved keeping ranks 0..rank
    best = np.maximum.reduceat(gain, rstart)
    # the run's length at its best rank: the first rank reaching the best gain
    hit = gain == np.repeat(best, rlen)
    first_hit = np.minimum.reduceat(np.where(hit, rank, len(cand)), rstart)
    keep_len = np.repeat(first_hit, rlen)
    share = np.repeat(m[rstart + first_hit], rlen)
    keep = (rank <= keep_len) & (share >= MIN_SHARED_PAGES) & (np.repeat(best, rlen) > 0)
    cand, run, share, rank = cand[keep], run[keep], share[keep], rank[keep]
    if len(cand) < 2:
        return None
    # chunks: consecutive members of a group, rows_per_chunk at a time; a lone last member is dropped
    ck = run * (n + rows_per_chunk) + rank // rows_per_chunk          # chunk key, ordered by group
    cst = _starts(ck)
    clen = _lengths(cst, len(ck))
    cpages = share[cst]
    saved = cpages * (clen - 1)
    order = np.argsort(-saved, kind="stable")
    order = order[saved[order] > 0][:max_chunks]
    if not len(order):
        return None
    C = len(order)
    skip = np.zeros(n, dtype=np.int32)
    chunk = np.full(n, -1, dtype=np.int32)
    slot = np.zeros(n, dtype=np.int32)
    chunk_rows = np.zeros((C, rows_per_chunk), dtype=np.int32)
    cid = np.full(len(cst), -1, dtype=np.int64)
    cid[order] = np.arange(C)
    member_c = np.repeat(cid, clen)
    member_slot = np.arange(len(ck)) - np.repeat(cst, clen)
    sel = member_c >= 0
    rows_k, c_k, s_k = cand[sel], member_c[sel], member_slot[sel]
    chunk[rows_k], slot[rows_k] = c_k, s_k
    skip[rows_k] = cpages[order][c_k]
    chunk_rows[c_k, s_k] = rows_k
    return SharedPlan(skip, chunk, slot, ip[cand[cst[order]]].astype(np.int32), cpages[order].astype(np.int32),
                      chunk_rows, clen[order].astype(np.int32), int(saved[order].sum()))
