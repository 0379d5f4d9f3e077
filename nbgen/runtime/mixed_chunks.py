"""A mixed step's prompt chunks attended inside the piecewise prefill graphs.

The causal chunks of a step over e4m3 pages (at most ``EXTEND_MAX_TOKENS`` tokens, attention/prefill_plans.py)
take nbgen's Triton chunk attention (kernels/triton_extend.py). Launched eagerly, that is a Triton launch a
layer from Python; captured at the end of each piece (after the decode rows' kernel, runtime/mixed_decode.py)
over static tables, the step's pieces replay back to back with no eager attention call at all.

Static tables, one layout for every bucket (the kernel's ``batch`` and ``blocks`` arguments fixed at
``MAX_SEQS + 1`` and ``blocks``): qo_indptr [S+2] | kv_indptr [S+2] | last [S+1] | blocks' sequence [NB] |
first token [NB] | page indices (16-byte aligned) [cap], with S = MAX_SEQS. A step of B sequences after d
decode rows writes qo_indptr shifted by d (the kernel reads q and writes out at the bucket's rows d..), then
sequence B: an empty padding sequence (no rows; one scratch page with no token), which every block past the
step's real blocks names: its programs read one scratch key and store nothing. Bucket T's capture launches
``rows(T)`` blocks a kv head (every sequence may add one partial block), split count 1 (no partial buffers
or merge counters for the graph to reset), so the chunk rows' sums can differ in the last bits from an eager
step's split form.

Per step the host plans the blocks (``plan_blocks``) into a pinned staging buffer and copies it in one
transfer. A step that does not fit (more sequences, pages or blocks than the tables hold) runs its chunks
eagerly; before such a step replays the pieces, ``idle`` stages the padding-only tables once (every block on
the padding sequence), so the captured kernel stores nothing over rows the eager calls write.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nbgen.attention import prefill_plans
from nbgen.attention.flashinfer_backend import FlashInferBackend
from nbgen.kernels.extend_plan import plan_blocks
from nbgen.kernels.host_staging import StagingRing
from nbgen.runtime.pages import SCRATCH_PAGE

MAX_SEQS = 16   # chunk sequences a mixed step may have for the captured kernel (more: eager, as before)


class MixedChunkRows:
    """Static tables of the piecewise graphs' chunk attention and their per-step staging."""

    def __init__(self, backend: FlashInferBackend, max_tokens: int, max_context: int) -> None:
        sp = backend.spec
        wrapper = backend.prefill.extend
        if wrapper is None:
            raise RuntimeError("the piecewise graphs' chunk rows need nbgen's Triton chunk attention")
        self.wrapper, self.backend, self.P = wrapper, backend, sp.page_size
        self.tokens = wrapper.tokens                  # chunk tokens a block
        S = MAX_SEQS
        self.batch = S + 1                            # the kernel's sequence count: S and the padding one
        self.blocks = self.rows(max_tokens)           # ... its block count
        # pages the sequences may hold (shared prefixes counted per sequence), bounded by twice the pool
        self.cap = min(S * (-(-max_context // self.P) + 1), 2 * sp.num_pages + S) + 1
        c = (S + 2, 2 * S + 4, 3 * S + 5, 3 * S + 5 + self.blocks)
        self._cut = (*c, c[3] + self.blocks, -(-(c[3] + self.blocks) // 4) * 4)
        size = self._cut[5] + self.cap
        self._buf = torch.zeros(size, dtype=torch.int32, device=sp.device)
        self.tab, self.indices = self._buf[: self._cut[4]], self._buf[self._cut[5]:]
        self._ring = StagingRing(lambda: [torch.zeros(size, dtype=torch.int32)])
        self.staged = 0          # steps whose chunks the graphs attended (tests, stats)
        self._live = True        # the static tables name a step's rows (``idle`` clears them)
        self.idle()

    @property
    def max_chunk_tokens(self) -> int:
        """Chunk tokens a staged step may have (the routing's bound for the Triton chunk attention)."""
        return prefill_plans.EXTEND_MAX_TOKENS

    def _views(self, buf: Any) -> tuple[Any, ...]:
        """(qo_indptr, kv_indptr, last, seq, first, indices) of a flat int32 buffer (torch or numpy)."""
        a, b, c, d, e, f = self._cut
        return buf[:a], buf[a:b], buf[b:c], buf[c:d], buf[d:e], buf[f:]

    def rows(self, T: int) -> int:
        """Blocks a kv head the kernel captured at bucket T runs: its chunk tokens' blocks, one partial block
        more per sequence (at least one block)."""
        tc = min(T, prefill_plans.EXTEND_MAX_TOKENS)
        return max(1, (tc + min(MAX_SEQS, tc) * (self.tokens - 1)) // self.tokens)

    def attend(self, layer_id: int, T: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """The staged chunks' attention over layer ``layer_id``'s pages (captured in the pieces at bucket T):
        q [T, Hq*D] (strided rows allowed: a view of the fused qkv) into out [T, Hq*D], chunk rows only."""
        be, w = self.backend, self.wrapper
        ks, vs = be.kv_scales[layer_id]
        w.launch(q.view(T, w.hq, w.d), (be.k_cache[layer_id], be.v_cache[layer_id]), out.view(T, w.hq, w.d),
                 self.tab, self.indices, self.batch, self.blocks, self.rows(T), 1, ks, vs)

    def stage(self, T: int, d: int, qo: list[int], kv_indptr: list[int], indices: list[int],
              last: list[int]) -> bool:
        """Queue the tables of a step at bucket T whose chunks (``qo`` [B+1], ``kv_indptr`` [B+1], ``indices``
        [nnz], ``last`` [B]: page_tables') follow ``d`` decode rows; False (nothing queued) where they do not
        fit. The caller routed them to the Triton chunk attention (attention/prefill_plans.py)."""
        B, nnz, n = len(last), len(indices), qo[-1]
        if B > MAX_SEQS or nnz + 1 > self.cap or n > self.max_chunk_tokens or d + n > T:
            return False
        qa, kvp = np.asarray(qo, dtype=np.int64), np.asarray(kv_indptr, dtype=np.int64)
        la = np.asarray(last, dtype=np.int64)
        # at most rows(T) blocks: n <= min(T, EXTEND_MAX_TOKENS) tokens over at most MAX_SEQS sequences
        seq, first, _ = plan_blocks(qa[1:] - qa[:-1], (kvp[1:] - kvp[:-1] - 1) * self.P + la, self.tokens)
        nb, R = len(seq), self.rows(T)
        st, npv = self._ring.next()
        ip, kp, ls, sq, fs, idx = self._views(npv[0])
        self._write_padding(ip, kp, ls, sq, fs, idx, B, d + qo[-1], nnz, nb, R)
        ip[: B + 1] = qa + d
        kp[: B + 1] = kvp
        ls[:B] = la
        sq[:nb], fs[:nb] = seq, first
        idx[:nnz] = indices
        self._send(st[0], nnz + 1)
        self.staged += 1
        self._live = True
        return True

    def idle(self) -> None:
        """Before a step whose chunks run eagerly: every block on the padding sequence (the captured kernel
        stores nothing), queued once after a staged step."""
        if not self._live:
            return
        st, npv = self._ring.next()
        self._write_padding(*self._views(npv[0]), 0, 0, 0, 0, self.blocks)
        self._send(st[0], 1)
        self._live = False

    @staticmethod
    def _write_padding(ip: np.ndarray, kp: np.ndarray, ls: np.ndarray, sq: np.ndarray, fs: np.ndarray,
                       idx: np.ndarray, B: int, row: int, nnz: int, nb: int, R: int) -> None:
        """Sequence B: no rows (at ``row``), one scratch page (page ``nnz``) with no token; blocks nb..R-1
        on it."""
        ip[B: B + 2] = row
        kp[B], kp[B + 1] = nnz, nnz + 1
        ls[B] = 0
        sq[nb:R] = B
        fs[nb:R] = 0
        idx[nnz] = SCRATCH_PAGE

    def _send(self, host: torch.Tensor, pages: int) -> None:
        """One copy: the tables and the first ``pages`` page indices."""
        end = self._cut[5] + pages
        self._buf[:end].copy_(host[:end], non_blocking=True)
        self._ring.done()
