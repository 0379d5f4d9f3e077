"""The fixed-shape layout of a chain verify step for CUDA graphs (runtime/verify_graphs.py; torch-free).

A graph captured for ``bs`` rows of ``q`` tokens each (q = ``speculative_num_draft_tokens``) replays a
step of n <= bs verify seqs ``[last, d1 .. dk]`` (k + 1 <= q tokens). Row i's tokens sit at flat rows
``i * q ..``; everything past a row's real tokens is padding, and so are rows n .. bs - 1. Padding must
never change what a real token computes, nor touch KV anyone reads:

* a padding token's K/V is written to slot 0 of the scratch page (``SCRATCH_PAGE``: owned by no request,
  read by no real token), at position 0;
* every row's attention is causal over ``start_pos + q`` keys (the prefill kernel's fixed
  ``qo_indptr = [0, q, 2q, ..]``): real token j sees keys ``0 .. start_pos + j``, which are its prefix and
  the row's own earlier tokens, written this step; keys past the real tokens are seen by padding queries
  only. Their page-table entries are the row's own last page (slots no token has written yet, or stale)
  and, beyond the pages the row's real tokens use, the scratch page;
* a padding row is q padding tokens over q keys on the scratch page.

So the real rows' outputs equal an unpadded verify forward, and the KV pool changes only at the real
tokens' slots and on the scratch page.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import numpy as np

from nbgen.core.batch import SeqWork
from nbgen.runtime.pages import SCRATCH_PAGE


@dataclass
class VerifyLayout:
    """A padded verify step: bs rows of q tokens (flat row r = row r // q, token r % q)."""

    bs: int
    q: int
    ids: np.ndarray          # [bs * q] int64 token ids (padding 0)
    positions: np.ndarray    # [bs * q] int64 RoPE positions (padding 0)
    slots: np.ndarray        # [bs * q] int64 KV write slots (padding: slot 0 of the scratch page)
    qo_indptr: np.ndarray    # [bs + 1] int32, i * q
    kv_indptr: np.ndarray    # [bs + 1] int32 into kv_indices
    kv_indices: np.ndarray   # [nnz] int32 page ids, row by row
    last_page_len: np.ndarray  # [bs] int32 keys in each row's last page

    def row_pages(self, i: int) -> list[int]:
        """Row i's page table."""
        return self.kv_indices[self.kv_indptr[i]: self.kv_indptr[i + 1]].tolist()


def verify_layout(seqs: Sequence[SeqWork], q: int, bs: int, page_size: int) -> VerifyLayout:
    """The layout of verify seqs ``seqs`` (each at most q tokens, none a tree) padded to bs rows of q
    (vectorised over the batch: one pass over the rows' page lists, no numpy call per row)."""
    n, P = len(seqs), page_size
    assert n <= bs and all(0 < s.q_len <= q and s.tree_parents is None for s in seqs)
    start = np.zeros(bs, dtype=np.int64)
    start[:n] = [s.start_pos for s in seqs]
    L = np.array([s.q_len for s in seqs], dtype=np.int64)                     # [n] real tokens a row
    real = -(-(start[:n] + L) // P)                                             # [n] pages they use
    total = -(-(start + q) // P)                                                # [bs] pages of start + q keys
    kv_indptr = np.zeros(bs + 1, dtype=np.int32)
    np.cumsum(total, out=kv_indptr[1:])
    last = (start + q - (total - 1) * P).astype(np.int32)
    # page tables: each real row's pages first, then the scratch page up to start + q keys
    pages = np.fromiter(chain.from_iterable(s.pages[:r] for s, r in zip(seqs, real.tolist())), dtype=np.int64,
                        count=int(real.sum()))
    first = np.cumsum(real) - real                                              # [n] row's first entry in `pages`
    kv_indices = np.full(int(kv_indptr[-1]), SCRATCH_PAGE, dtype=np.int32)
    kv_indices[np.repeat(kv_indptr[:n].astype(np.int64) - first, real) + np.arange(len(pages))] = pages
    # real tokens at flat rows i * q + j, j < L[i]; the rest stays padding (token 0, position 0, scratch slot)
    row = np.repeat(np.arange(n), L)
    j = np.arange(int(L.sum())) - np.repeat(np.cumsum(L) - L, L)
    flat = row * q + j
    pos = start[row] + j
    ids = np.zeros(bs * q, dtype=np.int64)
    positions = np.zeros(bs * q, dtype=np.int64)
    slots = np.full(bs * q, SCRATCH_PAGE * P, dtype=np.int64)
    ids[flat] = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=len(flat))
    positions[flat] = pos
    slots[flat] = pages[first[row] + pos // P] * P + pos % P
    return VerifyLayout(bs, q, ids, positions, slots, (np.arange(bs + 1) * q).astype(np.int32), kv_indptr,
                        kv_indices, last)
