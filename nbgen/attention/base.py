"""The attention-backend interface: one KV page pool per layer, per-step metadata, per-layer forward."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from nbgen.core.batch import ScheduledBatch
from nbgen.kernels.kv_write import KVTarget


@dataclass
class KVCacheSpec:
    """Shape of the paged KV cache: per layer, K and V hold num_pages pages of page_size tokens x
    num_kv_heads x head_dim (each backend chooses the tensor layout: ``cache_shape``)."""

    num_layers: int
    num_pages: int
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    # the pool's element type when it differs from the model dtype (kv_cache_dtype="fp8_e4m3":
    # attention/kv_quant.py) and the per-tensor K / V scales of an fp8 pool
    kv_dtype: Optional[torch.dtype] = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    # per layer (k_scale, v_scale) of an fp8 pool, from the checkpoint (models/kv_scales.py); empty:
    # k_scale / v_scale above for every layer
    layer_scales: tuple[tuple[float, float], ...] = ()

    def scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of layer ``layer_id``'s fp8 pages (1.0 and unused for a model-dtype pool)."""
        if self.kv_dtype is None:
            return 1.0, 1.0
        return self.layer_scales[layer_id] if self.layer_scales else (self.k_scale, self.v_scale)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV pool's element type."""
        return self.kv_dtype or self.dtype

    def bytes_per_page(self) -> int:
        """K and V bytes of one page over all layers (the KV pool's sizing unit)."""
        itemsize = torch.empty((), dtype=self.cache_dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * itemsize


class AttentionMetadata:
    """Per-step data shared by all layers; each backend subclasses it. ``backend`` routes the call."""

    backend: "AttentionBackend"


class AttentionBackend(ABC):
    """Owns the KV cache tensors; ``prepare`` once per step, ``forward`` once per layer."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        self.scale = spec.head_dim ** -0.5
        shape = self.cache_shape()
        dt = spec.cache_dtype
        self.k_cache = [torch.zeros(shape, dtype=dt, device=spec.device) for _ in range(spec.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dt, device=spec.device) for _ in range(spec.num_layers)]

    def cache_shape(self) -> tuple[int, ...]:
        """Per-layer K (and V) tensor shape; default NHD pages: [num_pages, page_size, Hkv, D]."""
        sp = self.spec
        return (sp.num_pages, sp.page_size, sp.num_kv_heads, sp.head_dim)

    @abstractmethod
    def prepare(self, batch: ScheduledBatch) -> AttentionMetadata:
        """Build the metadata of one step (slot mapping, page tables, masks / kernel plans)."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, kv_written: bool = False,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D] for the step's flat tokens -> [T, Hq*D] (written into ``out``
        when given: a contiguous [T, Hq*D] buffer, as piecewise prefill graphs pass).

        Writes k/v of the new tokens into their pages (unless ``kv_written``: a fused kernel already
        stored them at ``kv_target``), then attends over each sequence's cached prefix plus its new
        tokens (causal within the new tokens).
        """

    @abstractmethod
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V at flat cache slots ``src`` [n] to slots ``dst`` [n] (long, on the
        device; a tree verify step moves its accepted tokens' KV into place: runtime/spec_tree_step.py)."""

    def kv_target(self, layer_id: int, meta: AttentionMetadata) -> Optional[KVTarget]:
        """Where a fused kernel may write this step's K/V itself: (k_cache, v_cache, slots [T] long),
        HND pages; None when this backend writes them in ``forward``."""
        return None

    def slot_mapping(self, batch: ScheduledBatch) -> list[int]:
        """Flat cache slot (page * page_size + offset) of every new token, in batch order."""
        P = self.spec.page_size
        out: list[int] = []
        for s in batch.seqs:
            a, b = s.start_pos, s.kv_len
            if b - a == 1:                   # a decode token (hot path: no numpy per token)
                out.append(s.pages[a // P] * P + a % P)
                continue
            # a prefill chunk: vectorised (a per-token generator cost ~3 ms per 8k-token step)
            pages = np.asarray(s.pages[a // P: (b - 1) // P + 1], dtype=np.int64)
            pos = np.arange(a, b)
            out.extend((pages[pos // P - a // P] * P + pos % P).tolist())
        return out

    def slot_mapping_into(self, batch: ScheduledBatch, out: np.ndarray) -> None:
        """``slot_mapping`` written straight into ``out`` (int64, at least the batch's token count),
        vectorised over the whole batch: the pages each seq's tokens land in, gathered into one array,
        then slot = page * page_size + offset per token (no Python list of the step's slots)."""
        P = self.spec.page_size
        pages: list[int] = []
        base, start, q = [], [], []          # per seq: its pages' offset in `pages`, first position, tokens
        for s in batch.seqs:
            a, b = s.start_pos, s.kv_len
            base.append(len(pages) - a // P)
            pages.extend(s.pages[a // P: (b - 1) // P + 1])
            start.append(a)
            q.append(b - a)
        n = sum(q)
        qa = np.asarray(q, dtype=np.int64)
        first_row = np.cumsum(qa) - qa
        pos = np.arange(n, dtype=np.int64) + np.repeat(np.asarray(start, dtype=np.int64) - first_row, qa)
        page = np.asarray(pages, dtype=np.int64)[np.repeat(np.asarray(base, dtype=np.int64), qa) + pos // P]
        out[:n] = page * P + pos % P


class Attention(nn.Module):
    """The attention call site inside a model layer: forwards to the step's backend."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any,
                kv_written: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return meta.backend.forward(self.layer_id, q, k, v, meta, kv_written, out)

    def kv_target(self, meta: Any) -> Optional[KVTarget]:
        """This layer's K/V destination for a fused write (see AttentionBackend.kv_target)."""
        return meta.backend.kv_target(self.layer_id, meta)
