"""A decode graph step's host side: every per-step input of the decode CUDA graphs written
with numpy into one int32 staging buffer, which ``CudaGraphRunner`` then copies to the GPU in one transfer.

Layout of the buffer (``StagingLayout``; each part starts on a 128-byte boundary, as a separate
allocation would: Triton specialises its kernels on 16-byte pointer alignment): io (4 * max_bs int64:
row 0 token ids, row 1 positions, row 2 KV slots, row 3 placeholder source row or -1; a graph of bs
reads the first 4 * bs as [4, bs]), the decode kernel's page tables: indptr [max_bs + 1], last page
lengths [max_bs], the rows longest first [max_bs], then the shared-prefix tables
(runtime/cascade_graphs.py) where those graphs exist, then kv indices. Rows n..bs-1 of a step padded to
graph size bs hold token 0 at position 0 with one page, the scratch page, written at its slot 0.
``Staged``: such a step once queued, as the graph runner replays it. The step is written into a
``kernels/host_staging.StagingRing``'s pinned buffers, used in turn behind an event each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from nbgen.attention.cascade_plan import SharedPlan
from nbgen.attention.page_tables import DecodeTables
from nbgen.core.batch import SeqWork
from nbgen.runtime.cascade_graphs import CascadeTables, blocks128
from nbgen.runtime.pages import SCRATCH_PAGE
from nbgen.runtime.step_inputs import is_placeholder, placeholder_row, rope_deltas



class StagingLayout:
    """Where each input lives in the flat int32 buffer (see the module docstring)."""

    def __init__(self, max_bs: int, max_context: int, page_size: int, cascade_size: int) -> None:
        mb = max_bs
        a, b = blocks128(8 * mb), blocks128(mb + 1)
        c = a + b + blocks128(mb)
        d = c + blocks128(mb)
        self.cut = (a, a + b, c, d, d + cascade_size)
        self.size = self.cut[4] + mb * ((max_context + page_size - 1) // page_size + 1)

    def views(self, buf: Any) -> tuple[Any, Any, Any, Any, Any]:
        """(io int64, indptr, last, order, indices) views of a flat int32 buffer (torch or numpy)."""
        a, b, c, d, e = self.cut
        io = buf[:a].view(np.int64) if isinstance(buf, np.ndarray) else buf[:a].view(torch.long)
        return io, buf[a:b], buf[b:c], buf[c:d], buf[e:]

    def cascade_region(self, buf: Any) -> Any:
        """The shared-prefix tables' region of the flat buffer (torch or numpy)."""
        return buf[self.cut[3]: self.cut[4]]


@dataclass
class HostStep:
    """A decode step written into a staging buffer."""

    n: int                          # live rows
    bs: int                         # graph batch size (rows n..bs-1 are padding)
    end: int                        # int32 entries of the buffer to copy (inputs, tables, indices)
    placeholders: bool              # some token ids come from the previous step's sampled ids
    plan: Optional[SharedPlan]      # the shared-prefix plan, when the step replays that graph


@dataclass
class Staged:
    """A decode step whose inputs and plan are queued for replay of the bs-sized graph."""

    n: int                 # live rows
    bs: int                # graph batch size (rows n..bs-1 are padding)
    placeholders: bool     # some token ids come from the previous step's sampled ids
    variant: bool = False  # replay the variant's graph (GraphVariant)
    cascade: bool = False  # replay the shared-prefix graph (runtime/cascade_graphs.py)
    lead: int = 0          # > 0: the batch's ``lead`` sampling rows are graph rows 0..lead-1, its other rows
    #                        (jump-forward's forced rows) after them (``stage(sampling_first=True)``)

    @property
    def sampled(self) -> int:
        """The graph rows 0..sampled-1 that are the step's sampling rows, in order, when every row samples
        or the sampling rows lead."""
        return self.lead or self.n


class DecodeStaging:
    """Writes decode steps into staging buffers (``write``): token ids, positions, KV slots, placeholder
    rows, page tables (``DecodeTables``), the longest-first row order and, where the shared-prefix graphs
    exist, their plan (``CascadeTables``); rows past the batch padded to the graph's batch size."""

    def __init__(self, layout: StagingLayout, tables: DecodeTables, batch_sizes: Sequence[int],
                 cascade: Optional[CascadeTables], mrope: bool) -> None:
        self.layout = layout
        self.tables = tables
        self.P = tables.P
        self.cascade = cascade
        self.mrope = mrope                  # vision-language models decode at p + rope_delta
        mb = max(batch_sizes)
        self.bs_of = [next(b for b in batch_sizes if b >= n) for n in range(mb + 1)]   # n rows -> graph size
        self._ramp = np.arange(mb + 1, dtype=np.int32)
        self._views: dict[int, tuple[Any, ...]] = {}

    def _views_of(self, buf: np.ndarray) -> tuple[Any, ...]:
        v = self._views.get(id(buf))
        if v is None:
            v = self._views[id(buf)] = (*self.layout.views(buf), self.layout.cascade_region(buf), buf)
        return v

    def write(self, buf: np.ndarray, seqs: Sequence[SeqWork], ids: Optional[Sequence[int]] = None,
              cascade: bool = False, lead: int = 0) -> HostStep:
        """Write a decode step of one-token ``seqs`` into ``buf`` (a staging buffer kept alive by its
        owner). ``ids``: their token ids (default: each seq's token), ids < 0 placeholders for rows of the
        previous step's sampled ids. ``cascade``: plan the shared-prefix graph (its batch size has one).
        ``lead`` > 0: only the first ``lead`` rows (the sampling rows; forced rows after them) may share a
        prefix chunk, so the plan is reused while they stay, whatever forced rows come and go."""
        n = len(seqs)
        bs = self.bs_of[n]
        io64, ip, last, order, idx, region, _ = self._views_of(buf)
        r = self.tables.fill(seqs, ip, idx, last, lead)
        nnz, pad = r.nnz, bs - n
        io = io64[: 4 * bs].reshape(4, bs)
        tok = np.fromiter(ids if ids is not None else [s.token_ids[0] for s in seqs], dtype=np.int64, count=n)
        placeholders = n > 0 and bool(is_placeholder(tok.min()))
        np.maximum(tok, 0, out=io[0, :n])                  # placeholders: token 0, filled in the graph
        np.maximum(placeholder_row(tok), -1, out=io[3, :n])   # their source rows; -1 for real ids
        io[1, :n] = r.positions + rope_deltas(seqs) if self.mrope else r.positions
        io[2, :n] = r.slots
        if pad:
            io[:3, n:] = 0
            io[3, n:] = -1
            ip[n + 1: bs + 1] = self._ramp[1: pad + 1] + nnz
            last[n:bs] = 1
            idx[nnz: nnz + pad] = SCRATCH_PAGE
        m = lead or n                                       # the rows the plan covers
        plan = self.cascade.plan(ip, idx, m, self.tables.version) if cascade and self.cascade else None
        kv = r.positions                                    # KV lengths less 1
        if plan is not None:
            self.cascade.fill(region, plan, m, bs)
            kv = kv.copy()
            kv[:m] -= plan.skip.astype(np.int64) * self.P
        # the decode kernel's row order: longest first (ties in row order), padding rows (one token) last
        order[:n] = np.argsort(-kv, kind="stable")
        order[n:bs] = self._ramp[n:bs]
        return HostStep(n, bs, self.layout.cut[4] + nnz + pad, placeholders, plan)

    def write_padding(self, buf: np.ndarray, bs: int) -> HostStep:
        """A step of padding rows only (the graph captures)."""
        io64, ip, last, order, idx, region, _ = self._views_of(buf)
        io = io64[: 4 * bs].reshape(4, bs)
        io[:] = 0
        io[3] = -1
        ip[: bs + 1] = self._ramp[: bs + 1]
        last[:bs] = 1
        order[:bs] = self._ramp[:bs]
        idx[:bs] = SCRATCH_PAGE
        if self.cascade is not None:       # no chunks: the cascade graph's capture runs level 1 plainly
            self.cascade.fill(region, None, 0, bs)
        return HostStep(0, bs, self.layout.cut[4] + bs, False, None)
