"""BatchedCache: the EAGLE head's K/V for many requests drafting in one forward (models/eagle.py ``HeadCache``).

Request b's committed rows (its ``DraftCache``, ``base[b]`` rows) are copied once per draft into a padded
buffer [B, cap, Hkv, D]; slot j of request b holds its row j. A draft runs two kinds of row sets:

* ``catch_up``: each request's ``new[b]`` waiting feature rows (ragged, flattened request by request) at
  slots ``base[b] ..``; query t of request b sees slots ``0 .. base[b] + t`` (causal);
* ``draft_step(j)``: one row per request at slot ``base[b] + new[b] + j`` (the j-th draft row), seeing
  every slot up to its own.

Queries are scattered into a padded [B, Tq, Hq, D] block and attend in one batched SDPA with a
[B, 1, Tq, cap] mask; padded query rows see their request's first slot (no all-masked row, no NaN) and are
dropped. ``commit`` hands each request its committed rows (``base + new``) back: draft rows never enter a
``DraftCache`` (they are recomputed from the target's features next time).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from nbgen.models.eagle import DraftCache


class BatchedCache:
    """Padded head K/V of B requests (``caches``, already cut to their committed rows) for one batched draft
    of ``new[b]`` catch-up rows and up to ``extra`` draft rows each."""

    def __init__(self, caches: list[DraftCache], new: list[int], extra: int, device: torch.device) -> None:
        self.caches, self.new, self.device = caches, new, device
        self.base = [c.length for c in caches]
        self.cap = max(b + n for b, n in zip(self.base, new)) + extra
        self.k: list[torch.Tensor] = []                                  # per layer [B, cap, Hkv, D]
        self.v: list[torch.Tensor] = []
        self.catch_up()

    def _rows(self, b: list[int], t: list[int], slot: list[int], tq: int, limit: list[list[int]]) -> None:
        """Set the current rows: flat row r is query t[r] of request b[r], written at slot[r]; ``limit[b][t]``
        the last slot query t of request b sees."""
        dev = self.device
        self.b_idx = torch.tensor(b, device=dev)                          # [T]
        self.t_idx = torch.tensor(t, device=dev)                          # [T]
        self.slot = torch.tensor(slot, device=dev)                        # [T]
        self.tq = tq
        lim = torch.tensor(limit, device=dev)                             # [B, Tq]
        self.mask = (torch.arange(self.cap, device=dev) <= lim[:, :, None])[:, None]   # [B, 1, Tq, cap]

    def catch_up(self) -> None:
        """Rows: every request's waiting feature rows, request by request."""
        b, t, slot, limit = [], [], [], []
        tq = max(self.new)
        for i, (c, n) in enumerate(zip(self.base, self.new)):
            b += [i] * n
            t += list(range(n))
            slot += range(c, c + n)
            limit.append([c + min(j, n - 1) for j in range(tq)])
        self._rows(b, t, slot, tq, limit)

    def draft_step(self, j: int) -> None:
        """Rows: each request's j-th draft row (j = 0: the row after its last waiting row)."""
        n = len(self.base)
        slot = [c + m + j for c, m in zip(self.base, self.new)]
        self._rows(list(range(n)), [0] * n, slot, 1, [[s] for s in slot])

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the current rows' k, v [T, Hkv, D] into layer ``li``'s slots; q [T, Hq, D] -> [T, Hq, D]."""
        assert mask is None, "a batched draft is causal per request"
        if len(self.k) <= li:
            self.k.append(self._padded([c.k[li] if c.k else None for c in self.caches], k))
            self.v.append(self._padded([c.v[li] if c.v else None for c in self.caches], v))
        K, V = self.k[li], self.v[li]
        K[self.b_idx, self.slot] = k
        V[self.b_idx, self.slot] = v
        B, hq, D = len(self.base), q.shape[1], q.shape[2]
        Q = q.new_zeros(B, self.tq, hq, D)
        Q[self.b_idx, self.t_idx] = q
        rep = hq // K.shape[2]
        Kr, Vr = K.repeat_interleave(rep, 2), V.repeat_interleave(rep, 2)      # [B, cap, Hq, D]
        o = F.scaled_dot_product_attention(Q.transpose(1, 2), Kr.transpose(1, 2), Vr.transpose(1, 2),
                                           attn_mask=self.mask)             # [B, Hq, Tq, D]
        return o.transpose(1, 2)[self.b_idx, self.t_idx]

    def _padded(self, rows: list[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        """[B, cap, Hkv, D] zeros with request b's committed rows at its first slots."""
        out = like.new_zeros(len(rows), self.cap, like.shape[1], like.shape[2])
        for i, r in enumerate(rows):
            if r is not None and r.shape[0]:
                out[i, : r.shape[0]] = r
        return out

    def commit(self) -> None:
        """Each request's cache becomes its committed rows (views of the padded buffer, ``base + new`` rows)."""
        for i, c in enumerate(self.caches):
            n = self.base[i] + self.new[i]
            c.k = [K[i, :n] for K in self.k]
            c.v = [V[i, :n] for V in self.v]
