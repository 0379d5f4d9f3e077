"""flashinfer attention backend (CUDA): paged prefill / decode kernels planned once per step.

Per layer ``k_cache``/``v_cache`` are HND pages [num_pages, Hkv, page_size, D] (each head's tokens of
a page contiguous, which the decode kernels read ~1.5 % faster than NHD). A step's new K/V are
written into their page slots by the model's fused RoPE kernel (``kv_target``) or else by one Triton
kernel per layer for K and V together (``kv_write``), then attention runs over each sequence's page
table:
  * decode-only step -> nbgen's split-KV Triton kernel, merge included (``triton_decode``; faster
    than flashinfer's decode + merge at every batch size measured), for the head sizes it supports;
    other head sizes take BatchDecodeWithPagedKVCacheWrapper, tensor-core variant for grouped-query
    attention (``decode_tensor_cores``);
  * any step with a prefill chunk -> its chunks (or draft tree) on one of the prefill wrappers
    (attention/prefill_plans.py: flashinfer's prefill; nbgen's Triton chunk attention for small
    chunks over e4m3 pages). The step's leading one-token rows (the running decodes) go through the
    Triton decode kernel instead (flashinfer's prefill kernel reads a one-query row's KV at about half
    the bandwidth), inside the piecewise graphs where those run the step (``decode_stage``:
    runtime/mixed_decode.py); so are chunks on the Triton chunk attention (``chunk_stage``:
    runtime/mixed_chunks.py), and the eager forward of such a step does nothing.
An fp8 pool (``kv_cache_dtype="fp8_e4m3"``) holds e4m3 pages: the K/V writes quantize (each layer's
k_scale / v_scale), the Triton kernels widen the tiles in registers, and flashinfer's kernels are
planned with ``kv_data_type`` e4m3 (bf16 / fp16 queries) and run with the layer's scales.
``plan()`` runs once per step in ``prepare``; all layers reuse it. Page tables (``page_tables``) go to
the GPU from pinned host memory without a host sync. The module imports without flashinfer; the
backend raises ImportError when it is missing.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from nbgen.attention.base import AttentionBackend, AttentionMetadata, KVCacheSpec
from nbgen.attention.flashinfer_replan import DirectReplan
from nbgen.attention.page_tables import DecodeTables, page_tables
from nbgen.attention.prefill_plans import PlanFence, PrefillPlans, pinned
from nbgen.attention.tree_mask import flat_masks, has_tree
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.kernels import triton_decode
from nbgen.kernels.kv_write import KVTarget, write_kv

try:
    import flashinfer
except ImportError:  # pragma: no cover - CPU installs: the runner falls back to the torch backend
    flashinfer = None

WORKSPACE_BYTES = 256 << 20


def decode_tensor_cores(group: int) -> bool:
    """Whether flashinfer's decode uses its tensor-core kernel for q/kv head ratio ``group``.

    Measured on an H200 at batch 256 x 200-2000 tokens: the CUDA-core kernel reads the KV at 86 % of
    copy bandwidth for group 2 and 59 % for group 4, the tensor-core one at 94-96 % for both; so it
    is used for every grouped-query model (group > 1). MHA (group 1) keeps the CUDA-core kernel.
    """
    return group > 1


class FlashInferMetadata(AttentionMetadata):
    """Per-step data: slot of each new token and the planned wrapper every layer runs."""

    def __init__(self, backend: "FlashInferBackend", slot_mapping: torch.Tensor, wrapper: Any,
                 decode_rows: int = 0, decodes_staged: bool = False, chunks_staged: bool = False) -> None:
        self.backend = backend
        self.slot_mapping = slot_mapping      # [T] long, flat cache slot of each new token
        self.wrapper = wrapper                # planned decode or prefill wrapper
        self.decode_rows = decode_rows        # mixed step: leading one-token rows on the Triton decode kernel
        self.decodes_staged = decodes_staged  # ... attended by the piecewise graphs (runtime/mixed_decode.py)
        self.chunks_staged = chunks_staged    # the whole step attended by them (runtime/mixed_chunks.py)


# a mixed step's decode-row page tables (indptr, indices, last) -> whether the piecewise graphs took them
DecodeStage = Callable[[np.ndarray, np.ndarray, np.ndarray], bool]
# a mixed step's chunk tables after its d decode rows (d, qo_indptr, kv_indptr, kv_indices, last) -> whether the
# piecewise graphs took them
ChunkStage = Callable[[int, list[int], list[int], list[int], list[int]], bool]


class FlashInferBackend(AttentionBackend):
    """Paged attention through flashinfer; also builds the fixed-size wrappers CUDA graphs replay."""

    kv_layout = "HND"

    def __init__(self, spec: KVCacheSpec) -> None:
        if flashinfer is None:
            raise ImportError("flashinfer is not installed")
        super().__init__(spec)      # allocates the caches in cache_shape()
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        self.use_tensor_cores = decode_tensor_cores(spec.num_q_heads // spec.num_kv_heads)
        # nbgen's split-KV kernel takes every decode batch where it supports the head size
        self.triton_decode = triton_decode.supported(spec.head_dim)
        self.decode_wrapper = self.make_decode_wrapper()
        self.triton_wrapper = self._triton_wrapper() if self.triton_decode else None
        # flashinfer's plans stage their data in one pinned host buffer: each waits for the last one's copy
        self.fence = PlanFence(spec.device)
        self.prefill = PrefillPlans(spec, self.workspace, self.kv_layout, self.fence, self.triton_decode)
        self.tables = DecodeTables(spec.page_size)
        # a graph wrapper's re-plan straight through flashinfer 0.6's C++ planner (public plan() otherwise)
        self.direct_replan = DirectReplan(spec, flashinfer.__version__)
        # per layer: (k_scale, v_scale) for the K/V writes and the Triton decode kernel, the scale arguments
        # of flashinfer's run() (none for model-dtype pages or unit scales: no extra work) and of the
        # Triton chunk attention's (both, always)
        self.kv_scales = [spec.scales(i) for i in range(spec.num_layers)]
        fp8 = spec.cache_dtype != spec.dtype
        self._fi_scales = [{k: x for k, x in (("k_scale", ks), ("v_scale", vs)) if fp8 and x != 1.0}
                           for ks, vs in self.kv_scales]
        self._tx_scales = [{"k_scale": ks, "v_scale": vs} for ks, vs in self.kv_scales]

    def cache_shape(self) -> tuple[int, ...]:
        """Per-layer K (and V) shape: HND pages [num_pages, Hkv, page_size, D]."""
        sp = self.spec
        return (sp.num_pages, sp.num_kv_heads, sp.page_size, sp.head_dim)

    def _triton_wrapper(self, *buffers: torch.Tensor) -> triton_decode.TritonDecodeWrapper:
        sp = self.spec
        return triton_decode.TritonDecodeWrapper(sp.num_q_heads, sp.num_kv_heads, sp.head_dim, sp.page_size,
                                                 sp.device, *buffers)

    def make_decode_wrapper(self, indptr: Optional[torch.Tensor] = None, indices: Optional[torch.Tensor] = None,
                            last_page_len: Optional[torch.Tensor] = None, order: Optional[torch.Tensor] = None) -> Any:
        """A decode wrapper; with the GPU buffers it is a fixed-batch-size CUDA-graph wrapper (nbgen's
        Triton decode where it supports the head size, which also reads ``order``, the rows longest
        first; else flashinfer's)."""
        graph = indptr is not None
        if graph and self.triton_decode:
            return self._triton_wrapper(indptr, indices, last_page_len, order)
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, self.kv_layout, use_cuda_graph=graph, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len)

    def plan_decode(self, wrapper: Any, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last: torch.Tensor) -> None:
        """Plan a decode wrapper from pinned CPU indptr / last_page_len and kv_indices.

        For a CUDA-graph wrapper ``kv_indices`` must already be on the device (ideally the wrapper's
        own indices buffer): flashinfer copies host indices into that buffer *blocking*, which
        would wait for all queued GPU work every step and undo overlap scheduling.
        """
        if isinstance(wrapper, triton_decode.TritonDecodeWrapper):   # no planner: page tables only
            wrapper.plan(kv_indptr, kv_indices, last)
            return
        sp = self.spec
        self.fence.wait()
        if not self.direct_replan(wrapper, kv_indptr, last):
            wrapper.plan(kv_indptr, kv_indices, last, sp.num_q_heads, sp.num_kv_heads,
                         sp.head_dim, sp.page_size, pos_encoding_mode="NONE", q_data_type=sp.dtype,
                         kv_data_type=sp.cache_dtype, sm_scale=self.scale, non_blocking=True)
        self.fence.mark()

    def plan_prefill(self, qo: list[int], kv_indptr: list[int], kv_indices: list[int], last: list[int],
                     custom_mask: Optional[torch.Tensor] = None) -> Any:
        """Plan the prefill wrapper a step's chunks take and return it (``PrefillPlans.plan``)."""
        return self.prefill.plan(qo, kv_indptr, kv_indices, last, custom_mask)

    def prepare(self, batch: ScheduledBatch, slot_mapping: Optional[torch.Tensor] = None,
                decode_stage: Optional[DecodeStage] = None,
                chunk_stage: Optional[ChunkStage] = None) -> FlashInferMetadata:
        """Plan this step's kernels; ``slot_mapping`` may come precomputed (already on the GPU).
        ``decode_stage(indptr, indices, last)``: the piecewise graphs take a mixed step's decode rows
        when it returns True (their tables queued), else they are planned here. ``chunk_stage(d, qo,
        kv_indptr, indices, last)``: likewise its chunks on the Triton chunk attention, once its decode rows
        (if any) were staged; then nothing of the step is left to the eager forward."""
        d = 0
        staged = chunks = False
        if batch.is_decode_only:
            kv_ptr, idx, last, _pos, slots = self.tables.build(batch.seqs)
            wrapper = self.triton_wrapper if self.triton_decode else self.decode_wrapper
            self.plan_decode(wrapper, pinned(kv_ptr), pinned(idx), pinned(last))
        else:
            self.tables.forget(batch)
            d = self._leading_decodes(batch.seqs)
            if d:
                dptr, didx, dlast, _pos, _slots = self.tables.build(batch.seqs[:d])
                staged = decode_stage is not None and decode_stage(dptr, didx, dlast)
                if not staged:
                    self.plan_decode(self.triton_wrapper, pinned(dptr), pinned(didx), pinned(dlast))
            qo, kv_ptr, idx, last = page_tables(batch.seqs[d:], self.spec.page_size)
            tree = has_tree(batch.seqs[d:])
            chunks = (staged or not d) and chunk_stage is not None and self.prefill.takes_extend(qo[-1], tree) \
                and chunk_stage(d, qo, kv_ptr, idx, last)
            wrapper = self.prefill.extend if chunks else \
                self.plan_prefill(qo, kv_ptr, idx, last, flat_masks(batch.seqs[d:]) if tree else None)
            slots = None
        if slot_mapping is None:
            if slots is None:
                slots = self.slot_mapping(batch)
            slot_mapping = pinned(slots, torch.long).to(self.spec.device, non_blocking=True)
        return FlashInferMetadata(self, slot_mapping, wrapper, d, staged, chunks)

    def _leading_decodes(self, seqs: Sequence[SeqWork]) -> int:
        """How many leading one-token rows of a mixed step the Triton decode kernel takes (the scheduler
        puts the running decodes first); flashinfer's prefill kernel reads a one-query row's KV at
        about half the bandwidth. 0: the whole step is prefill."""
        if not self.triton_decode:
            return 0
        d = 0
        while d < len(seqs) and seqs[d].q_len == 1:
            d += 1
        return d if d < len(seqs) else 0

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V at flat cache slots ``src`` [n] copied to slots ``dst`` [n] (HND pages)."""
        P = self.spec.page_size
        sp, so, dp, do = src // P, src % P, dst // P, dst % P
        for c in self.k_cache + self.v_cache:                       # [pages, Hkv, P, D]
            c = c.view(torch.uint8) if c.element_size() == 1 else c    # fp8 pages copied as bytes
            c[dp, :, do] = c[sp, :, so]                             # the gather copies before the write

    def kv_target(self, layer_id: int, meta: FlashInferMetadata) -> Optional[KVTarget]:
        """The layer's caches and slots: the fused RoPE kernel writes the step's K/V there."""
        return KVTarget(self.k_cache[layer_id], self.v_cache[layer_id], meta.slot_mapping, *self.kv_scales[layer_id])

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: FlashInferMetadata, kv_written: bool = False,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if meta.chunks_staged:       # the piecewise graphs attended the whole step (K/V written there)
            if out is None or not kv_written:
                raise ValueError("a step the piecewise graphs attended needs out= and kv_written=True")
            return out
        sp = self.spec
        T = q.shape[0]
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]
        ks, vs = self.kv_scales[layer_id]
        # write the new tokens' K/V into their slots, K and V in one kernel, unless the model's
        # fused RoPE kernel did (padding rows of a graph batch hit slot 0 of the scratch page)
        if not kv_written:
            write_kv(k, v, kc, vc, meta.slot_mapping, ks, vs)
        # q may be a strided view of the fused qkv projection: flashinfer takes q's row/head strides
        q3 = q.view(T, sp.num_q_heads, sp.head_dim) if q.stride(-1) == 1 else \
            q.reshape(T, sp.num_q_heads, sp.head_dim).contiguous()
        if self.prefill.owns(meta.wrapper):
            # every row is a planned query token, so the kernels write all of `out`: without one,
            # flashinfer zero-fills a fresh buffer first (~11 us a layer at 8k tokens on an H100)
            o = torch.empty((T, sp.num_q_heads, sp.head_dim), dtype=q.dtype, device=q.device) \
                if out is None else out.view(T, sp.num_q_heads, sp.head_dim)
            d = meta.decode_rows
            if d and not meta.decodes_staged:
                self.triton_wrapper.run(q3[:d], (kc, vc), out=o[:d], k_scale=ks, v_scale=vs)
            scales = self._tx_scales if meta.wrapper is self.prefill.extend else self._fi_scales
            meta.wrapper.run(q3[d:], (kc, vc), out=o[d:], **scales[layer_id])
            return o.view(T, sp.num_q_heads * sp.head_dim)
        if isinstance(meta.wrapper, triton_decode.TritonDecodeWrapper):
            o = meta.wrapper.run(q3, (kc, vc), k_scale=ks, v_scale=vs)
        else:
            o = meta.wrapper.run(q3, (kc, vc), **self._fi_scales[layer_id])
        o = o.view(T, sp.num_q_heads * sp.head_dim)
        return o if out is None else out.copy_(o)
