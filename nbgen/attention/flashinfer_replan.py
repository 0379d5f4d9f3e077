"""DirectReplan: re-plan a CUDA-graph decode wrapper of flashinfer 0.6 straight through its C++ planner.

This reads and writes flashinfer's wrapper internals (``_plan_info``, ``_cached_module``, its buffers),
so it is tied to flashinfer 0.6 and answers False (the caller then uses the public plan()) on any other
version or an unknown planner signature. Why: plan() spends ~0.4 ms of Python per call at batch 256 (it
takes Python's max() over a tensor, element by element, and re-derives dtypes and buffers) in a decode
step whose host budget is ~4 ms. For a graph wrapper only the device copies of indptr / last_page_len
and the planner's output change between steps; the same C++ call with the same arguments as plan()
makes (flashinfer 0.6's fa2 tensor-core path) does that. tests/test_gpu.py checks the two give
identical plans and outputs.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from nbgen.attention.base import KVCacheSpec

logger = logging.getLogger("nbgen")


class DirectReplan:
    """One backend's direct re-plans (its heads and page size; qo indptr per batch size)."""

    def __init__(self, spec: KVCacheSpec, flashinfer_version: str) -> None:
        self.spec = spec
        self.enabled = flashinfer_version.startswith("0.6.")
        self._qo_indptr: dict[int, torch.Tensor] = {}   # bs -> arange(bs + 1) on the host

    def __call__(self, wrapper: Any, kv_indptr: torch.Tensor, last: torch.Tensor) -> bool:
        """Re-plan ``wrapper`` (planned before, CUDA-graph, tensor cores, fa2) for pinned host
        ``kv_indptr`` [bs + 1] / ``last`` [bs]; False when it needs the public plan()."""
        if not (self.enabled and getattr(wrapper, "_plan_info", None) is not None
                and getattr(wrapper, "is_cuda_graph_enabled", False) and wrapper.use_tensor_cores
                and getattr(wrapper, "_backend", None) == "fa2"
                and getattr(wrapper, "_cached_module", None) is not None):
            return False
        sp = self.spec
        bs = len(last)
        ip = kv_indptr.numpy()
        kv_lens = (ip[1:] - ip[:-1] - 1) * sp.page_size + last.numpy()      # [bs] tokens per seq
        wrapper._paged_kv_indptr_buf.copy_(kv_indptr, non_blocking=True)
        wrapper._paged_kv_last_page_len_buf.copy_(last, non_blocking=True)
        qo = self._qo_indptr.get(bs)
        if qo is None:
            qo = self._qo_indptr[bs] = torch.arange(bs + 1, dtype=torch.int32)
        try:
            info = wrapper._cached_module.plan(
                wrapper._float_workspace_buffer, wrapper._int_workspace_buffer,
                wrapper._pin_memory_int_workspace_buffer, qo, kv_indptr,
                torch.from_numpy(kv_lens.astype(np.int32)),
                bs, bs, sp.num_q_heads, sp.num_kv_heads, sp.page_size, True, sp.head_dim, sp.head_dim,
                False, -1,          # causal, window_left
                -1, False, 0, 0)    # fixed_split_size, disable_split_kv, num_colocated_ctas, uniform_q_len
        except (TypeError, RuntimeError) as e:   # a planner signature we do not know: public plan()
            logger.warning("direct decode re-plan unavailable (%s); using flashinfer's plan()", e)
            self.enabled = False
            return False
        wrapper._plan_info, wrapper._max_kv_len = info, int(kv_lens.max()) if bs else 0
        return True
