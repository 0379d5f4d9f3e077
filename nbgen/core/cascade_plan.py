"""Shared-prefix (cascade) decode plans: which rows of a decode batch share leading KV pages (torch-free).

The prefix cache hands requests with a common prompt prefix the same physical pages, so rows whose
page tables start with the same full pages read the same KV. A cascade step splits each row's
attention in two levels:
  * level 0: each group's shared prefix pages, attended once by all of the group's query rows
    (one prefill-shaped call, non-causal: every row sees the whole prefix);
  * level 1: each row's remaining pages (its own suffix, the new token included), a plain decode;
the two partial results are merged with their log-sum-exps. The KV a step reads drops from
sum(rows' tokens) to sum(distinct tokens); ``plan_cascade`` builds the plan when that saving is at
least ``min_saved_tokens`` and returns None otherwise (the plain decode path runs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class CascadeGroup:
    """Rows (indices into the decode batch) that share ``prefix_pages`` (full pages) at the head of
    their page tables."""

    rows: list[int]
    prefix_pages: list[int]


@dataclass
class CascadePlan:
    """A decode batch's two-level plan (B rows, page_size P).

    Level 0: ``groups``; ``level0_rows`` lists their rows group after group, ``level0_qo_indptr``
    [G + 1] the groups' bounds in it, ``level0_kv_indptr`` [G + 1] / ``level0_kv_indices`` their
    prefix pages (all full). Level 1: every row's page table after its group's prefix (the whole
    table for rows in no group): ``suffix_kv_indptr`` [B + 1], ``suffix_kv_indices``,
    ``suffix_last_page_len`` [B] (tokens in each row's last page, >= 1).
    """

    page_size: int
    groups: list[CascadeGroup]
    suffix_kv_indptr: list[int]
    suffix_kv_indices: list[int]
    suffix_last_page_len: list[int]
    level0_rows: list[int] = field(default_factory=list)
    level0_qo_indptr: list[int] = field(default_factory=lambda: [0])
    level0_kv_indptr: list[int] = field(default_factory=lambda: [0])
    level0_kv_indices: list[int] = field(default_factory=list)
    total_tokens: int = 0          # KV tokens the plain decode reads (every row's whole context)
    saved_tokens: int = 0          # of which the cascade reads only once per group

    def __post_init__(self) -> None:
        for g in self.groups:
            self.level0_rows.extend(g.rows)
            self.level0_qo_indptr.append(len(self.level0_rows))
            self.level0_kv_indices.extend(g.prefix_pages)
            self.level0_kv_indptr.append(len(self.level0_kv_indices))


def _shared_len(ref: list[int], other: list[int], hi: int) -> int:
    """Length of the common head of ``ref`` and ``other`` (at most ``hi``): one C-speed slice compare
    when they agree up to ``hi``, else a binary search over slice compares."""
    if ref[:hi] == other[:hi]:
        return hi
    lo = 0                                     # ref[:lo] == other[:lo] holds; ref[:hi] != other[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ref[:mid] == other[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _best_group(rows: list[int], shared: list[int]) -> tuple[list[int], int]:
    """From rows (the reference first) and each row's shared page count with the reference, the
    subset and prefix length that save the most reads: length m x (rows sharing >= m pages - 1)."""
    order = sorted(range(1, len(rows)), key=lambda i: -shared[i])
    best_gain, best_k = 0, 0
    for k, i in enumerate(order, start=1):       # k other rows share >= shared[i] pages
        gain = shared[i] * k
        if gain > best_gain:
            best_gain, best_k = gain, k
    if best_k == 0:
        return [], 0
    m = shared[order[best_k - 1]]
    return sorted([rows[0]] + [rows[i] for i in order[:best_k]]), m


def plan_cascade(pages: Sequence[list[int]], kv_lens: Sequence[int], page_size: int,
                 min_saved_tokens: int) -> Optional[CascadePlan]:
    """The cascade plan of a decode batch, or None when sharing saves fewer than ``min_saved_tokens``
    KV token reads this step.

    ``pages[i]``: row i's page list (may be longer than its KV); ``kv_lens[i]``: its tokens, the new
    one included. Rows are grouped by their first page; within a group, the shared prefix is the
    full pages every member has in common before the page of its new token (that page is the row's
    own), with rows sharing too little left out of the group (``_best_group``).
    """
    P = page_size
    by_first: dict[int, list[int]] = {}
    full = [(n - 1) // P for n in kv_lens]         # pages wholly before each row's new-token page
    for i, p in enumerate(pages):
        if full[i] > 0:
            by_first.setdefault(p[0], []).append(i)
    groups: list[CascadeGroup] = []
    prefix_of: dict[int, int] = {}
    saved = 0
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        ref = pages[rows[0]]
        shared = [full[rows[0]]] + [_shared_len(ref, pages[i], min(full[i], full[rows[0]])) for i in rows[1:]]
        members, m = _best_group(rows, shared)
        if m == 0:
            continue
        groups.append(CascadeGroup(members, list(ref[:m])))
        saved += m * P * (len(members) - 1)
        for r in members:
            prefix_of[r] = m
    if saved < max(min_saved_tokens, 1):
        return None
    indptr, indices, last = [0], [], []
    for i, (p, n) in enumerate(zip(pages, kv_lens)):
        n_pages = (n + P - 1) // P
        indices.extend(p[prefix_of.get(i, 0): n_pages])
        indptr.append(len(indices))
        last.append(n - (n_pages - 1) * P)
    return CascadePlan(P, groups, indptr, indices, last, total_tokens=sum(kv_lens), saved_tokens=saved)
