"""Attention masks of a step's chunks when one of them is a tree verify chunk (SeqWork.tree_parents):
each tree token sees the cached prefix, its ancestors and itself; other chunks stay causal."""
from __future__ import annotations

import torch

from nbgen.core.batch import SeqWork


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row i is True at i and at every ancestor of i (parents[i] < i, -1 for a root)."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]              # a parent's row already holds its own ancestors
        m[i, i] = True
    return m


def chunk_mask(s: SeqWork) -> torch.Tensor:
    """[q_len, kv_len] bool mask of one chunk (CPU): the prefix fully visible, then causal or the tree."""
    q, pre = s.q_len, s.start_pos
    m = torch.ones(q, pre + q, dtype=torch.bool)
    if s.tree_parents is not None:
        m[:, pre:] = ancestor_matrix(s.tree_parents)
    else:
        m[:, pre:] = torch.ones(q, q, dtype=torch.bool).tril()
    return m


def has_tree(seqs: list[SeqWork]) -> bool:
    """Whether any chunk of ``seqs`` is a tree verify chunk."""
    return any(s.tree_parents is not None for s in seqs)


def flat_masks(seqs: list[SeqWork]) -> torch.Tensor:
    """The chunks' masks flattened row-major one after the other (flashinfer's ``custom_mask`` layout:
    sum of q_len * kv_len booleans)."""
    return torch.cat([chunk_mask(s).reshape(-1) for s in seqs])
