"""flashinfer attention backend (CUDA): paged prefill / decode kernels planned once per step.

KV layout is NHD, per layer ``k_cache``/``v_cache`` [num_pages, page_size, Hkv, D] (the base class
allocates them). A step's new K/V are written into their page slots with one ``index_copy_`` per
layer (over the flat [num_pages * page_size, Hkv, D] view), then attention runs over each sequence's
page table:
  * decode-only step  -> BatchDecodeWithPagedKVCacheWrapper (tensor-core variant when the q/kv head
    ratio is not 1, 2, 4 or 8, where the CUDA-core kernel has no specialisation);
  * any step with a prefill chunk -> BatchPrefillWithPagedKVCacheWrapper over the whole batch
    (decodes are rows with q_len 1); ``causal=True`` aligns each chunk's queries to the end of its
    KV, which is what cached prefixes and chunked prefill need.
``plan()`` runs once per step in ``prepare``; all layers reuse it. Page tables go to the GPU from
pinned host memory without a host sync.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from nbgen.attention.base import AttentionBackend, AttentionMetadata, KVCacheSpec
from nbgen.runtime.batch import ScheduledBatch

WORKSPACE_BYTES = 256 << 20


class FlashInferMetadata(AttentionMetadata):
    """Per-step data: slot of each new token and the planned wrapper every layer runs."""

    def __init__(self, backend: "FlashInferBackend", slot_mapping: torch.Tensor, wrapper: Any) -> None:
        self.backend = backend
        self.slot_mapping = slot_mapping      # [T] long, flat cache slot of each new token
        self.wrapper = wrapper                # planned decode or prefill wrapper


def page_tables(batch: ScheduledBatch, page_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(qo_indptr [B+1], kv_indptr [B+1], kv_indices [nnz], last_page_len [B]) of a batch."""
    qo, kv_ptr, idx, last = [0], [0], [], []
    for s in batch.seqs:
        n = s.kv_len
        n_pages = (n + page_size - 1) // page_size
        idx.extend(s.pages[:n_pages])
        qo.append(qo[-1] + s.q_len)
        kv_ptr.append(kv_ptr[-1] + n_pages)
        last.append(n - (n_pages - 1) * page_size)
    return qo, kv_ptr, idx, last


def _pinned(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).pin_memory()


class FlashInferBackend(AttentionBackend):
    """Paged attention through flashinfer; also builds the fixed-size wrappers CUDA graphs replay."""

    def __init__(self, spec: KVCacheSpec) -> None:
        super().__init__(spec)
        import flashinfer

        self._fi = flashinfer
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        ratio = spec.num_q_heads // spec.num_kv_heads
        # NBGEN_DECODE_TENSOR_CORES=1 forces the tensor-core decode kernel (for benchmarking)
        self.use_tensor_cores = ratio not in (1, 2, 4, 8) or os.environ.get("NBGEN_DECODE_TENSOR_CORES") == "1"
        self.decode_wrapper = self.make_decode_wrapper()
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # plan() stages its scheduling data in a pinned host buffer and copies it asynchronously;
        # the next plan() must not overwrite that buffer before the copy ran (matters under overlap)
        self._plan_done: Optional[torch.cuda.Event] = None

    def make_decode_wrapper(self, indptr: Optional[torch.Tensor] = None, indices: Optional[torch.Tensor] = None,
                            last_page_len: Optional[torch.Tensor] = None) -> Any:
        """A decode wrapper; with the three GPU buffers it is a fixed-batch-size CUDA-graph wrapper."""
        graph = indptr is not None
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=graph, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len)

    def _before_plan(self) -> None:
        if self._plan_done is not None:
            self._plan_done.synchronize()

    def _after_plan(self) -> None:
        ev = torch.cuda.Event()
        ev.record()
        self._plan_done = ev

    def plan_decode(self, wrapper: Any, kv_indptr: list[int], kv_indices: list[int], last: list[int]) -> None:
        sp = self.spec
        self._before_plan()
        wrapper.plan(_pinned(kv_indptr), _pinned(kv_indices), _pinned(last), sp.num_q_heads, sp.num_kv_heads,
                     sp.head_dim, sp.page_size, pos_encoding_mode="NONE", q_data_type=sp.dtype,
                     kv_data_type=sp.dtype, sm_scale=self.scale, non_blocking=True)
        self._after_plan()

    def plan_prefill(self, qo: list[int], kv_indptr: list[int], kv_indices: list[int], last: list[int]) -> None:
        sp = self.spec
        self._before_plan()
        self.prefill_wrapper.plan(_pinned(qo), _pinned(kv_indptr), _pinned(kv_indices), _pinned(last),
                                  sp.num_q_heads, sp.num_kv_heads, sp.head_dim, sp.page_size, causal=True,
                                  sm_scale=self.scale, q_data_type=sp.dtype, kv_data_type=sp.dtype,
                                  non_blocking=True)
        self._after_plan()

    def prepare(self, batch: ScheduledBatch, slot_mapping: Optional[torch.Tensor] = None) -> FlashInferMetadata:
        """Plan this step's kernels; ``slot_mapping`` may come precomputed (already on the GPU)."""
        qo, kv_ptr, idx, last = page_tables(batch, self.spec.page_size)
        if batch.is_decode_only:
            self.plan_decode(self.decode_wrapper, kv_ptr, idx, last)
            wrapper = self.decode_wrapper
        else:
            self.plan_prefill(qo, kv_ptr, idx, last)
            wrapper = self.prefill_wrapper
        if slot_mapping is None:
            slot_mapping = torch.tensor(self.slot_mapping(batch), dtype=torch.long).pin_memory().to(
                self.spec.device, non_blocking=True)
        return FlashInferMetadata(self, slot_mapping, wrapper)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: FlashInferMetadata) -> torch.Tensor:
        sp = self.spec
        T = q.shape[0]
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]
        # write the new tokens' K/V into their slots (padding rows of a graph batch hit scratch page 0)
        kc.view(-1, sp.num_kv_heads, sp.head_dim).index_copy_(0, meta.slot_mapping, k.reshape(T, sp.num_kv_heads, sp.head_dim))
        vc.view(-1, sp.num_kv_heads, sp.head_dim).index_copy_(0, meta.slot_mapping, v.reshape(T, sp.num_kv_heads, sp.head_dim))
        o = meta.wrapper.run(q.reshape(T, sp.num_q_heads, sp.head_dim).contiguous(), (kc, vc))
        return o.view(T, sp.num_q_heads * sp.head_dim)
