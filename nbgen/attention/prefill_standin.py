"""Paged causal prefill attention in torch, standing in for flashinfer's prefill kernels while they build.

On a host whose flashinfer JIT cache is empty, flashinfer's paged prefill module for the model's shapes
takes about a minute to compile (74 s measured for Qwen3-0.6B's on an H100 host). The engine builds it
on a background thread from its start (runtime/jit_prebuild.py); until that build is done, steps with
prefill chunks plan this wrapper instead, so neither the start-up nor the first requests wait for nvcc.
Once the module is built the backend plans flashinfer's wrapper again, for good; with a warm cache
this wrapper is never used.

Same plan / run interface as ``BatchPrefillWithPagedKVCacheWrapper`` as the backend calls it: causal
chunks whose queries are the last ``q_len`` positions of their sequence, HND pages [num_pages, Hkv, P,
D] (an fp8 pool's pages widened and scaled), grouped-query heads. Per sequence: its pages gathered, one
``scaled_dot_product_attention`` with the bottom-right causal mask. Its bf16 results differ from
flashinfer's in the last bits (another summation order), as results do between batch compositions.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F


class SdpaPrefill:
    """A planned step's causal chunks over paged KV, attended with torch's SDPA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seqs: list[tuple[int, int, int, int, int]] = []   # (q start, q end, page start, page end, kv len)
        self._indices = torch.zeros(0, dtype=torch.int64, device=device)
        self.sm_scale = 1.0

    def plan(self, qo: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = True,
             sm_scale: Optional[float] = None, **_: Any) -> None:
        """Host tensors as the backend passes them to flashinfer: qo / kv_indptr [n + 1], kv_indices
        [pages], last [n] (tokens in each sequence's last page)."""
        assert causal, "the stand-in serves causal chunks only"
        qo_l, ip, ln = qo.tolist(), kv_indptr.tolist(), last.tolist()
        self._seqs = [(qo_l[i], qo_l[i + 1], ip[i], ip[i + 1], (ip[i + 1] - ip[i] - 1) * page_size + ln[i])
                      for i in range(len(ln))]
        self._indices = kv_indices.to(self.device, torch.int64, non_blocking=True)
        self.sm_scale = sm_scale if sm_scale is not None else head_dim ** -0.5

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], out: Optional[torch.Tensor] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> torch.Tensor:
        """q [T, Hq, D] (the planned chunks' tokens, in order) -> out [T, Hq, D]."""
        kc, vc = kv                                          # [pages, Hkv, P, D]
        o = torch.empty_like(q) if out is None else out
        for q0, q1, p0, p1, kv_len in self._seqs:
            n = q1 - q0
            if n == 0:
                continue
            pages = self._indices[p0:p1]
            k = _gather(kc, pages, kv_len, q.dtype, k_scale)   # [Hkv, L, D]
            v = _gather(vc, pages, kv_len, q.dtype, v_scale)
            # query j is position kv_len - n + j: it sees keys up to there (bottom-right causal)
            qpos = torch.arange(kv_len - n, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos[:, None]
            att = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                                 v.unsqueeze(0), attn_mask=mask, scale=self.sm_scale,
                                                 enable_gqa=True)              # [1, Hq, n, D]
            o[q0:q1] = att[0].transpose(0, 1)
        return o


def _gather(cache: torch.Tensor, pages: torch.Tensor, kv_len: int, dtype: torch.dtype,
            scale: Optional[float]) -> torch.Tensor:
    """A sequence's [Hkv, kv_len, D] keys (or values) from its HND pages, in ``dtype``."""
    x = cache.index_select(0, pages)                         # [np, Hkv, P, D]
    x = x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, :kv_len]
    x = x.to(dtype)
    return x * scale if scale is not None else x
