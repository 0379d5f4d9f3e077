"""A mixed step's decode rows attended inside the piecewise prefill graphs.

A step with prompt chunks runs as graph pieces around one eager attention call per layer
(runtime/prefill_graphs.py); its leading one-token rows (the running decodes) take nbgen's Triton decode
kernel. Launched eagerly, that kernel costs a Triton launch a layer (tens of µs of host time each), which
makes a paced mixed step host-bound on a large model. Here it is captured at the end of each piece instead,
over ``rows(T)`` rows of static page tables, so the eager call keeps only flashinfer's prefill of the chunks.

Rows the step does not use read the scratch page (one token): rows d..n-1 (prompt tokens) are attended as
if they were one-token rows and then overwritten by the prefill kernel, which runs after the piece; rows
n.. are the bucket's padding. The split count is the captured row count's, so a decode row's sums can
differ in the last bits from an eager step's.

Per step the host writes the decode rows' page tables, the padding rows and the longest-first order into
a pinned staging buffer (numpy) and copies them in one transfer. A step whose decode rows do not fit (more
than ``rows(T)``, or more pages than the buffer holds) runs them eagerly as before. Before such a step, and
before one without decode rows, ``idle()`` puts every row on the scratch page. The kernel of bucket T reads
the first ``rows(T)`` entries of the row order; left from a staged step of a larger bucket, those name rows
past T's, whose page tables no step holds any more and which the kernel may read out of bounds.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nbgen.attention.flashinfer_backend import FlashInferBackend
from nbgen.kernels.triton_decode import TritonDecodeWrapper, longest_first
from nbgen.kernels.host_staging import StagingRing
from nbgen.runtime.pages import SCRATCH_PAGE

MAX_ROWS = 256   # decode rows a mixed step may have for the captured kernel (more: eager, as before)


class MixedDecodeRows:
    """Static page tables and the graph-shaped decode wrapper of the piecewise graphs' decode rows."""

    def __init__(self, backend: FlashInferBackend, max_tokens: int, max_context: int) -> None:
        sp = backend.spec
        self.P = sp.page_size
        self.max_rows = B = min(max_tokens, MAX_ROWS)
        # pages the rows may hold: each row its context (shared prefixes counted per row), bounded by twice the pool
        self.cap = min(B * (-(-max_context // self.P) + 1), 2 * sp.num_pages + B)
        self._cut = (B + 1, 2 * B + 1, 3 * B + 1)    # indptr [B+1] | last [B] | order [B] | indices [cap]
        size = self._cut[2] + self.cap
        self._buf = torch.zeros(size, dtype=torch.int32, device=sp.device)
        ip, last, order, idx = self._views(self._buf)
        wrapper = backend.make_decode_wrapper(ip, idx, last, order)
        if not isinstance(wrapper, TritonDecodeWrapper):
            raise RuntimeError("the piecewise graphs' decode rows need nbgen's Triton decode kernel")
        self.wrapper = wrapper
        self.backend = backend
        self._ring = StagingRing(lambda: [torch.zeros(size, dtype=torch.int32)])
        self._ramp = np.arange(B + 1, dtype=np.int32)
        self.staged = 0          # steps whose decode rows the graphs attended (tests, stats)
        self._live = True        # the tables hold a step's rows (else: every row on the scratch page)
        self.idle()

    def _views(self, buf: Any) -> tuple[Any, ...]:
        """(indptr, last, order, indices) of a flat int32 buffer (torch or numpy)."""
        a, b, c = self._cut
        return buf[:a], buf[a:b], buf[b:c], buf[c:]

    def attend(self, layer_id: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """The staged rows' attention over layer ``layer_id``'s pages (captured in the pieces): q [B, Hq*D]
        (strided rows allowed: a view of the fused qkv) into out [B, Hq*D]."""
        be = self.backend
        sp, B = be.spec, q.shape[0]
        ks, vs = be.kv_scales[layer_id]
        self.wrapper.run(q.view(B, sp.num_q_heads, sp.head_dim), (be.k_cache[layer_id], be.v_cache[layer_id]),
                         out=out.view(B, sp.num_q_heads, sp.head_dim), k_scale=ks, v_scale=vs)

    def rows(self, T: int) -> int:
        """Rows the kernel captured at bucket T attends."""
        return min(T, self.max_rows)

    def stage(self, T: int, indptr: np.ndarray, indices: np.ndarray, last: np.ndarray) -> bool:
        """Queue the tables of a step at bucket T with these decode rows (``indptr`` [d+1], ``indices``
        [nnz], ``last`` [d]: DecodeTables.build's); False (nothing queued) where they do not fit."""
        d, B, nnz = len(last), self.rows(T), len(indices)
        if d > B or nnz + B - d > self.cap:
            return False
        st, npv = self._ring.next()
        ip, ls, order, idx = self._views(npv[0])
        ip[: d + 1] = indptr[: d + 1]
        ip[d + 1: B + 1] = nnz + self._ramp[1: B - d + 1]         # padding rows: one scratch page each
        ls[:d] = last
        ls[d:B] = 1
        if d:
            order[:d] = longest_first(indptr[: d + 1], last, self.P)
        order[d:B] = self._ramp[d:B]
        idx[:nnz] = indices
        idx[nnz: nnz + B - d] = SCRATCH_PAGE
        end = self._cut[2] + nnz + B - d
        self._buf[:end].copy_(st[0][:end], non_blocking=True)
        self._ring.done()
        self.staged += d > 0
        self._live = d > 0 or B < self.max_rows
        return True

    def idle(self) -> None:
        """Before a step whose decode rows are not staged (none, or run eagerly): all ``max_rows`` rows on
        the scratch page, so that every bucket's kernel reads its own rows in order; queued once after a
        staged step."""
        if self._live:
            self.stage(self.max_rows, np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.int32),
                       np.zeros(0, dtype=np.int32))
