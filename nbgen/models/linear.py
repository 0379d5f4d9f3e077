"""Tensor-parallel-ready linears (column / row parallel): plain layers at tp_size=1; the vocabulary-parallel
embedding and LM head are in ``models/vocab_parallel.py``.

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies an HF
checkpoint tensor into (its shard of) the parameter, so fused q/k/v and gate/up parameters load
from separate HF tensors, and sharding over GPUs later changes no model file. With tp_size > 1 the
forward passes communicate through torch.distributed (set up by the caller via ``set_tp``).
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from nbgen.kernels import small_gemm
from nbgen.models import all_reduce, cpu_int4
from nbgen.models.cpu_int4 import Int4Weight
from nbgen.models.fp8_linear import Fp8Weight, fp8_linear
from nbgen.models.fp8_scaled import (Activation, Fp8ScaledWeight, QuantizedRows, quantized_input_usable,
                                     scaled_accumulate, scaled_accumulate_quantized)

_TP = (1, 0)  # (tp_size, tp_rank) of this process


def set_tp(size: int, rank: int) -> None:
    """Declare this process's tensor-parallel group (before building a model)."""
    global _TP
    assert 0 <= rank < size
    _TP = (size, rank)


def get_tp() -> tuple[int, int]:
    """(tp_size, tp_rank) of this process."""
    return _TP


def tp_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    # the layer's own tp_size (fixed when it was built), not the process-wide setting
    if tp_size > 1:
        all_reduce.all_reduce(x)     # small tensors peer-to-peer where set up, else NCCL / gloo
    return x


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Copy a whole tensor (cast to the parameter's dtype/device)."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


@functools.lru_cache(maxsize=None)
def cpu_packed_matmul_available() -> bool:
    """oneDNN can pre-pack bf16 linear weights on this CPU (saves a weight reorder per call).

    Probed once with a tiny weight: the bf16 reorder needs AVX512 (bw/vl/dq) or AVX-NE-CONVERT, and on
    an AVX2-only CPU torch raises at the first pack (the plain F.linear path is used there)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        w = torch.zeros(32, 32, dtype=torch.bfloat16)
        packed_linear(torch.zeros(2, 32, dtype=torch.bfloat16), pack_linear_weight(w), None)
    except RuntimeError:
        return False
    return True


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """oneDNN-blocked copy of a bf16 CPU weight [out, in] for ``packed_linear``."""
    # 32: the batch size the blocking is tuned for; any row count works at run time
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 32)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [N, in] @ W.T (+ b) with a pre-packed W: same numbers as F.linear, ~25% faster at decode sizes."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def new_param(*shape: int) -> nn.Parameter:
    # uninitialised: weights come from a checkpoint or the dummy initialiser
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(nn.Module):
    """y = x @ W.T (+ b) with W [out_local, in_local]."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = new_param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = new_param(out_features)
            self.bias.weight_loader = self.weight_loader

    packed: Optional[torch.Tensor] = None  # set by prepack_cpu(): the weight in oneDNN's layout
    int4: Optional[Int4Weight] = None      # set by prepack_cpu() for weights on a 4-bit grid (GGUF Q4)
    # LoRA serving (runtime/lora.py): a hook adding the step's adapters' low-rank products into the
    # output, ``lora(x [T, in], y [T, out])`` in place; ``lora.active`` is False on steps without adapters
    lora: Optional[Any] = None
    # fp8 weights (models/fp8_linear.py ``quantize_linears``): the e4m3 weight and its scales (per
    # feature or 1x128 groups); the parameter then holds the same e4m3 tensor
    fp8: Optional[Union[Fp8Weight, Fp8ScaledWeight]] = None
    # fp8 residual add at one row: weight tiles the one-row kernel loads before its PDL wait (more after
    # a latency-bound kernel: ``fp8_row_gemv.EARLY_TILES_AFTER_ATTENTION`` for o_proj)
    early_tiles: int = 1

    @property
    def lora_active(self) -> bool:
        """This step adds LoRA products to the output (fused epilogues must not skip ``forward``)."""
        return self.lora is not None and self.lora.active

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded)

    def prepack_cpu(self) -> None:
        """Re-lay the weight out for oneDNN (bf16 on CPU, after loading). The parameter keeps its shape
        but its storage is released (a stride-0 view; no second copy in memory): only forward() reads W.
        A weight on a 4-bit grid also keeps an int4 copy for steps of a few rows (models/cpu_int4.py)."""
        self.int4 = cpu_int4.from_grid(self.weight.data)
        self.packed = pack_linear_weight(self.weight.data)
        self.weight.data = torch.zeros(1, dtype=self.weight.dtype).expand(self.weight.shape)

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] as values: the parameter, or rebuilt from the packed copy (exactly:
        identity @ W.T through the same oneDNN call, each output one product with 1)."""
        if self.packed is None:
            return self.weight.data
        eye = torch.eye(self.weight.shape[1], dtype=self.weight.dtype)
        return packed_linear(eye, self.packed, None).t().contiguous()

    def unpack_cpu(self) -> None:
        """Undo ``prepack_cpu``: the parameter holds the weight again (before a weight update)."""
        if self.packed is not None:
            self.weight.data = self.dense_weight()
            self.packed = self.int4 = None

    def _mm(self, x: Activation, bias: Optional[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_linear(x, self.fp8, bias, out=out)
        assert not isinstance(x, QuantizedRows), "quantized rows go to fp8 weights only (takes_quantized)"
        if out is not None:
            # into the caller's buffer (piecewise prefill graphs keep q/k/v in a static one): the same
            # cuBLAS call F.linear makes (addmm / mm with the transposed weight)
            w = self.weight.t()
            return torch.addmm(bias, x, w, out=out) if bias is not None else torch.mm(x, w, out=out)
        if cpu_int4.use_int4(x, self.int4):
            return cpu_int4.int4_linear(x, self.int4, bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        if small_gemm.usable(x, self.weight):
            return small_gemm.small_gemm(x, self.weight, bias)    # decode batch of a few rows
        return F.linear(x, self.weight, bias)

    def forward(self, x: Activation, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] (or its rows quantized, where ``takes_quantized``) -> [T, out]; ``out``: a [T, out]
        buffer to write into (CUDA, cuBLAS path)."""
        y = self._mm(x, self.bias, out)
        if self.lora is not None and self.lora.active:
            self.lora(x, y)
        return y

    def takes_quantized(self, x: torch.Tensor) -> bool:
        """This linear (fp8, no bias, no active adapter) may take rows like x's (count, device, dtype) as
        ``QuantizedRows`` in ``forward`` / ``accumulate``: its product quantizes them before cuBLAS."""
        return self.bias is None and not self.lora_active and quantized_input_usable(x, self.fp8)

    def accumulate_quantized(self, x: Activation, into: torch.Tensor,
                             then: LinearBase) -> Optional[QuantizedRows]:
        """``accumulate(x, into)``, and where one launch can do both, the updated rows of ``into``
        quantized for ``then`` (the next fp8 linear, taking them in ``forward``) -> those rows, else None
        (``into`` is updated either way). ``x`` may be quantized rows where ``takes_quantized``."""
        if get_tp()[0] == 1 and self.bias is None and not self.lora_active and then.takes_quantized(into):
            rows = scaled_accumulate_quantized(x, self.fp8, into, then.fp8)
            if rows is not None:
                return rows
        self.accumulate(x, into)
        return None

    def accumulate(self, x: Activation, into: torch.Tensor) -> torch.Tensor:
        """into += x @ W.T (+ b), in place: a residual add folded into the projection (one launch on
        CUDA: the streaming kernel's epilogue at a few rows, else cuBLAS with beta = 1). ``x`` may be
        quantized rows where ``takes_quantized``."""
        if get_tp()[0] != 1:
            raise RuntimeError("accumulate() needs tp_size 1 (partial sums would add the stream per rank)")
        lora = self.lora is not None and self.lora.active
        if self.bias is None and not lora and scaled_accumulate(x, self.fp8, into, self.early_tiles):   # fp8
            return into
        if self.fp8 is None and self.packed is None and self.bias is None and into.is_cuda \
                and into.is_contiguous():
            if small_gemm.usable(x, self.weight):
                small_gemm.small_gemm(x, self.weight, accumulate=into)
            else:
                into.addmm_(x, self.weight.t())
            if lora:             # the adapters' products added in place too (no [T, out] temporary)
                self.lora(x, into)
            return into
        if lora:
            return into.add_(self.forward(x))
        return into.add_(self._mm(x, self.bias))


class ColumnParallelLinear(LinearBase):
    """Output features split over tp ranks (each rank computes a slice of y)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size, self.tp_rank = get_tp()
        assert out_features % self.tp_size == 0, "output features must divide by tp_size"
        super().__init__(in_features, out_features // self.tp_size, bias)

    def _shard(self, loaded: torch.Tensor, size: int, index: int) -> torch.Tensor:
        """Rows [index*size, (index+1)*size) of the checkpoint tensor (dim 0 = output features)."""
        return loaded.narrow(0, index * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = param.shape[0]
        default_weight_loader(param, self._shard(loaded, n, self.tp_rank))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate|up); shard_id = index into output_sizes."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = [s // self.tp_size for s in output_sizes]   # local sizes

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        """(first row, rows) of sub-matrix ``shard_id`` in this rank's parameter."""
        assert isinstance(shard_id, int), "MergedColumnParallelLinear loads one sub-matrix at a time"
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        offset, size = self.shard_rows(shard_id)
        default_weight_loader(param.data.narrow(0, offset, size), self._shard(loaded, size, self.tp_rank))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q|k|v projection; shard_id in {"q", "k", "v"}. KV heads are replicated when tp > kv heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size, _ = get_tp()
        assert num_heads % tp_size == 0, "attention heads must divide by tp_size"
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)   # ranks sharing one kv head
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias)

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        """(first row, rows) of q, k or v in this rank's parameter."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        offset, size = self.shard_rows(shard_id)
        index = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        default_weight_loader(param.data.narrow(0, offset, size), self._shard(loaded, size, index))


class RowParallelLinear(LinearBase):
    """Input features split over tp ranks; partial outputs are summed (all-reduce) across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size, self.tp_rank = get_tp()
        assert in_features % self.tp_size == 0, "input features must divide by tp_size"
        super().__init__(in_features // self.tp_size, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 2:   # weight: shard the input dim; bias stays whole
            n = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * n, n)
        default_weight_loader(param, loaded)

    def _partial(self, x: Activation) -> torch.Tensor:
        """[T, out] this rank's partial product (its input features; the active adapter's share added)."""
        y = self._mm(x, None)
        if self.lora is not None and self.lora.active:
            self.lora(x, y)
        return y

    def forward(self, x: Activation) -> torch.Tensor:
        y = tp_all_reduce(self._partial(x), self.tp_size)
        # bias once, after the sum (not once per rank)
        return y + self.bias if self.bias is not None else y

    def accumulate(self, x: Activation, into: torch.Tensor) -> torch.Tensor:
        """into += x @ W.T (+ b) over the whole input: at tp_size > 1 each rank's partial product is summed
        over the ranks straight into ``into`` (the all-reduce adds it: ``all_reduce.all_reduce_add``)."""
        if self.tp_size == 1:
            return super().accumulate(x, into)
        all_reduce.all_reduce_add(self._partial(x), into)
        return into.add_(self.bias) if self.bias is not None else into
