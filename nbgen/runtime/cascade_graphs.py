"""Shared-prefix decode steps on the decode CUDA graphs: the tables' place in the graph runner's input
buffer, the per-step choice, and the cascade wrapper each batch size's second graph captures.

``CudaGraphRunner`` captures, for batch sizes >= ``MIN_BS``, a second graph whose attention is the
cascade wrapper (kernels/triton_cascade.py) over the same page-table buffers plus the tables here.
A decode step's plan comes from its page tables (attention/cascade_plan.py, numpy, ~0.1 ms at 256
rows) and it replays the cascade graph when the plan saves at least ``MIN_SAVED_TOKENS`` KV token reads
per layer and kv head; the tables go to the GPU in the step's one input copy. Steps over the same rows
(the same page lists in the same order: ``DecodeTables.version``; a step with jump-forward's forced rows
plans over its leading sampling rows only, the forced rows in no chunk) reuse the plan: the rows' lists only
grew since, so a chunk's shared pages are still shared by its rows and still before their new pages
(only where its first row's table starts moved); it is computed again every ``REPLAN_STEPS`` steps,
when a row's shared run may have grown. Off (plain graphs only)
where the Triton decode kernel does not run the decode steps, or with a graph variant (LoRA).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from nbgen.attention.cascade_plan import SharedPlan, plan_shared
from nbgen.attention.flashinfer_backend import FlashInferBackend
from nbgen.kernels import triton_cascade as tc

MIN_BS = 8                # smaller batches: few rows to share a prefix, the plain graphs only
MAX_CHUNKS = 16           # level-0 chunks a step keeps (those saving the most)
MIN_SAVED_TOKENS = 4096   # KV tokens (per layer, kv head) a step must save to run the cascade graph
REPLAN_STEPS = 64         # steps a plan is reused over the same rows before it is computed again


def blocks128(n: int) -> int:
    """n int32 values rounded up to whole 128-byte blocks (32 values): views of the graph runner's flat
    input buffer (runtime/cuda_graphs.py, these tables among them) stay 16-byte aligned."""
    return -(-n // 32) * 32


def supported(backend: FlashInferBackend, variant: Optional[Any]) -> bool:
    """The cascade graphs exist: decode steps on nbgen's Triton kernel, no graph variant (LoRA)."""
    return backend.triton_decode and variant is None


class CascadeTables:
    """The shared-prefix tables as one int32 region: per row skip / chunk / slot [max_bs] each, per
    chunk start / pages / rows [MAX_CHUNKS] each, then the chunks' batch rows [MAX_CHUNKS, R]."""

    def __init__(self, backend: FlashInferBackend, max_bs: int) -> None:
        sp = backend.spec
        self.backend = backend
        self.P = sp.page_size
        self.R = tc.rows_per_chunk(sp.num_q_heads // sp.num_kv_heads)
        self.mb = max_bs
        a, b = blocks128(max_bs), blocks128(MAX_CHUNKS)
        self._cuts = [0, a, 2 * a, 3 * a, 3 * a + b, 3 * a + 2 * b, 3 * a + 3 * b]
        self.size = self._cuts[-1] + blocks128(MAX_CHUNKS * self.R)
        self.scratch = tc.SharedScratch(sp.num_kv_heads, sp.head_dim, MAX_CHUNKS, sp.device)
        self._last: tuple[int, int, int, Optional[SharedPlan]] = (-1, 0, 0, None)   # version, rows, age, plan

    def views(self, region: Any) -> tuple[Any, ...]:
        """(skip, chunk, slot, chunk start, chunk pages, chunk rows count, chunk rows [C, R]) of the region."""
        c = self._cuts
        parts = [region[c[i]: c[i + 1]] for i in range(6)]
        rows = region[c[6]: c[6] + MAX_CHUNKS * self.R]
        return (*parts, rows.view(MAX_CHUNKS, self.R) if isinstance(rows, torch.Tensor)
                else rows.reshape(MAX_CHUNKS, self.R))

    def wrapper(self, region: torch.Tensor, bs: int, indptr: torch.Tensor, indices: torch.Tensor,
                last: torch.Tensor, order: torch.Tensor) -> tc.CascadeDecodeWrapper:
        """The cascade wrapper of the bs graph over the graph runner's device buffers."""
        skip, chunk, slot, cstart, cpages, clen, crows = self.views(region)
        sp = self.backend.spec
        return tc.CascadeDecodeWrapper(sp.num_q_heads, sp.num_kv_heads, sp.head_dim, sp.page_size, sp.device,
                                       indptr, indices, last, order, (skip[:bs], chunk[:bs], slot[:bs]),
                                       (cstart, cpages, clen, crows), self.scratch)

    def plan(self, kv_indptr: np.ndarray, kv_indices: np.ndarray, n: int, version: int = -1) -> Optional[SharedPlan]:
        """The step's plan when it saves enough reads (the first n rows of its page tables), else None.
        ``version``: the tables' ``DecodeTables.version`` (-1: compute anew), whose rows a plan is reused for."""
        v, rows, age, plan = self._last
        if version >= 0 and v == version and rows == n and age < REPLAN_STEPS:
            self._last = (v, rows, age + 1, plan)
            if plan is not None:       # the chunks' first rows' tables may have moved in kv_indices
                plan.chunk_start[:] = kv_indptr[plan.chunk_rows[:, 0]]
            return plan
        plan = plan_shared(kv_indptr, kv_indices, n, self.R, MAX_CHUNKS) if n >= 2 else None
        if plan is not None and plan.saved_pages * self.P < MIN_SAVED_TOKENS:
            plan = None
        self._last = (version, n, 0, plan)
        return plan

    def fill(self, region: np.ndarray, plan: Optional[SharedPlan], n: int, bs: int) -> None:
        """Write a plan's tables (rows n..bs-1 padding: in no chunk); None: no chunks (capture)."""
        skip, chunk, slot, cstart, cpages, clen, crows = self.views(region)
        skip[:bs], chunk[:bs], slot[:bs] = 0, -1, 0
        clen[:] = 0
        if plan is None:
            return
        C = len(plan.chunk_pages)
        skip[:n], chunk[:n], slot[:n] = plan.skip, plan.chunk, plan.slot
        cstart[:C], cpages[:C], clen[:C] = plan.chunk_start, plan.chunk_pages, plan.chunk_len
        crows[:C] = plan.chunk_rows
