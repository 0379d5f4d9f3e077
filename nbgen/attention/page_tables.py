"""Page tables of a step for the paged attention kernels (torch-free; numpy for decode batches).

``page_tables`` flattens any seqs' page lists (prefill chunks and mixed steps). ``DecodeTables`` builds
the tables of one-token rows from per-request int32 copies of ``req.pages``, extended as pages are
added, instead of re-flattening every request's Python list each step.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from nbgen.core.batch import ScheduledBatch, SeqWork


def page_tables(seqs: Sequence[SeqWork], page_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(qo_indptr [B+1], kv_indptr [B+1], kv_indices [nnz], last_page_len [B]) of a batch's seqs."""
    qo, kv_ptr, idx, last = [0], [0], [], []
    for s in seqs:
        n = s.kv_len
        n_pages = (n + page_size - 1) // page_size
        idx.extend(s.pages[:n_pages])
        qo.append(qo[-1] + s.q_len)
        kv_ptr.append(kv_ptr[-1] + n_pages)
        last.append(n - (n_pages - 1) * page_size)
    return qo, kv_ptr, idx, last


class DecodeTables:
    """Page tables of one-token rows (decode-only steps, the leading decode rows of mixed steps), from
    per-request numpy copies of ``req.pages``.

    An entry (pages list object, int32 array, valid length) is trusted while the request keeps the
    same list object and only appends to it, which is all the scheduler does between decode steps;
    the prefix cache rewrites entries in place only after a step that computed prompt tokens, and
    those steps drop the entry (``forget``), so the next decode step rebuilds it.
    """

    def __init__(self, page_size: int) -> None:
        self.P = page_size
        self._cache: dict[str, list] = {}

    def forget(self, batch: ScheduledBatch) -> None:
        """Drop entries of seqs whose pages may be rewritten in place after this step."""
        for s in batch.seqs:
            if s.q_len > 1 or s.start_pos < len(s.req.prompt_ids):
                self._cache.pop(s.req.rid, None)

    def _pages(self, s: SeqWork, n: int) -> np.ndarray:
        pages = s.pages
        if s.start_pos < len(s.req.prompt_ids):          # last prompt token: swap may follow
            self._cache.pop(s.req.rid, None)
            return np.asarray(pages[:n], dtype=np.int32)
        e = self._cache.get(s.req.rid)
        if e is None or e[0] is not pages or e[2] > len(pages):
            arr = np.empty(max(2 * len(pages), 64), dtype=np.int32)
            arr[: len(pages)] = pages
            e = self._cache[s.req.rid] = [pages, arr, len(pages)]
        elif e[2] < len(pages):
            arr, m = e[1], len(pages)
            if m > len(arr):
                arr = np.concatenate([arr, np.empty(max(m, len(arr)), dtype=np.int32)])
                e[1] = arr
            arr[e[2]: m] = pages[e[2]:]
            e[2] = m
        return e[1][:n]

    def build(self, seqs: Sequence[SeqWork]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(kv_indptr [B+1] i32, kv_indices [nnz] i32, last_page_len [B] i32, positions [B] i64, slots [B] i64)
        of one-token seqs (a decode batch, or the leading decode rows of a mixed one)."""
        P = self.P
        B = len(seqs)
        kv = np.fromiter((s.start_pos + 1 for s in seqs), dtype=np.int64, count=B)
        npages = (kv + P - 1) // P
        indptr = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(npages, out=indptr[1:])
        pages_of = self._pages
        idx = np.concatenate([pages_of(s, n) for s, n in zip(seqs, npages.tolist())]) if B else \
            np.zeros(0, dtype=np.int32)
        last = (kv - (npages - 1) * P).astype(np.int32)
        pos = kv - 1
        slots = idx[indptr[1:] - 1].astype(np.int64) * P + (last - 1)
        if len(self._cache) > 2 * B + 256:               # prune finished / preempted requests
            live = {s.req.rid for s in seqs}
            self._cache = {k: v for k, v in self._cache.items() if k in live}
        return indptr, idx, last, pos, slots
