"""Vocabulary-parallel layers: the token embedding and the LM head with the vocabulary split over tensor-parallel
ranks (a plain embedding / projection at tp_size=1), and the CPU pre-packing of a model's bf16 linears and head.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from nbgen.kernels import small_gemm
from nbgen.models import cpu_int8
from nbgen.models.linear import (LinearBase, cpu_packed_matmul_available, default_weight_loader, get_tp,
                                 new_param, pack_linear_weight, packed_linear, tp_all_reduce)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over tp ranks (rows outside a rank's range are zero)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = get_tp()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp_size)            # ceil: last rank may be padded
        self.start = self.tp_rank * self.per_rank
        self.weight = new_param(self.per_rank, embedding_dim)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = max(0, min(self.per_rank, loaded.shape[0] - self.start))
        if rows < self.per_rank:
            param.data[rows:].zero_()
        default_weight_loader(param.data[:rows], loaded.narrow(0, self.start, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(out.masked_fill(outside[:, None], 0), self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab logits; may share its weight with the input embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tied_to: Optional[VocabParallelEmbedding] = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        if tied_to is not None:
            self.weight = tied_to.weight
        self.packed: Optional[torch.Tensor] = None
        self.int8: Optional[cpu_int8.Int8Weight] = None   # a weight on GGUF's Q8_0 grid: decode steps read it

    def prepack_cpu(self) -> None:
        """Keep a oneDNN-packed copy for the logits matmul (the weight may be tied to the embedding), and
        an int8 one for steps of a few rows when the weight is on a Q8_0 grid (models/cpu_int8.py)."""
        self.packed = pack_linear_weight(self.weight.data)
        self.int8 = cpu_int8.from_grid(self.weight.data)


    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """hidden [N, H] -> logits [N, vocab] in the model dtype."""
        if cpu_int8.use_int8(hidden, self.int8):
            logits = cpu_int8.int8_linear(hidden, self.int8)
        elif self.packed is not None:
            logits = packed_linear(hidden, self.packed, None)
        elif small_gemm.usable(hidden, self.weight):
            logits = small_gemm.small_gemm(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.num_embeddings]


def prepack_cpu_linears(model: nn.Module) -> int:
    """Pre-pack every bf16 linear of a CPU model for oneDNN; returns how many were packed."""
    if not cpu_packed_matmul_available():
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, (LinearBase, ParallelLMHead)) and m.weight.device.type == "cpu" \
                and m.weight.dtype == torch.bfloat16 and m.weight.dim() == 2:
            m.prepack_cpu()
            n += 1
    return n
