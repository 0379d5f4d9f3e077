"""nbgen's 4-bit CPU kernels from Python (``csrc/cpu_q4.c``, ``csrc/cpu_layers.c``, in ``cpu_ops``' library):
the Q4 GEMV for a few rows, and all decoder layers of a CPU decode step of a few rows in one C call (bf16
Llama-shaped layers whose four linears are 4-bit in the GEMV's layout: the same kernels in the same order as
one call each, without a ctypes transition, allocation and views per kernel)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from nbgen.kernels import cpu_ops

MAX_ROWS = 8          # q4_gemv's row limit
MAX_K = 16384         # and its input width limit (the quantized rows live on the C stack)
_LIB: Optional[Any] = None


def q4_vnni() -> bool:
    """The 4-bit GEMV was built with AVX512-VNNI (its fast path; a plain C loop otherwise); False without the
    C kernels."""
    return cpu_ops.available() and bool(cpu_ops.load().q4_vnni())


def check_weight(qw: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
    """Asserts a weight's layout for ``q4_gemv`` (once, where it is made: the GEMV itself checks only x)."""
    n, k = qw.shape[0], qw.shape[1] * 2
    assert k % 64 == 0 and k <= MAX_K and qw.dtype == torch.uint8 and d.dtype == m.dtype == torch.float16 \
        and d.shape == m.shape == (n, k // 32) and qw.is_contiguous() and d.is_contiguous() and m.is_contiguous()


def q4_gemv(x: torch.Tensor, qw: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [T, K] (T <= 8, bf16 / fp32, contiguous last dim) @ W.T -> [T, N] in x's dtype, W = d * q + m per
    group of 32 along K (``csrc/cpu_q4.c``: qw [N, K/2] uint8 nibbles, d and m [N, K/32] fp16, as
    ``check_weight`` asserts); x is quantized to int16 per group of 32 (no precision lost against x's bf16).
    Needs ``cpu_ops.available()``."""
    T, k = x.shape
    assert T <= MAX_ROWS and x.stride(1) == 1 and qw.shape[1] * 2 == k, "expected x [T <= 8, K] with unit stride"
    n = qw.shape[0]
    y = torch.empty((T, n), dtype=x.dtype)
    _lib().q4_gemv(x.data_ptr(), x.stride(0), qw.data_ptr(), d.data_ptr(), m.data_ptr(), y.data_ptr(), n, T, n, k,
                   int(x.dtype == torch.bfloat16))
    return y


def _lib() -> Any:
    global _LIB
    if _LIB is None:
        _LIB = cpu_ops.load()     # per call it would take the build lock
    return _LIB


@dataclass(frozen=True)
class LayerShape:
    """The decoder's geometry: layers, hidden and intermediate width, heads, head dim, RMSNorm eps."""
    layers: int
    hidden: int
    inter: int
    q_heads: int
    kv_heads: int
    head_dim: int
    eps: float


@dataclass(frozen=True)
class LayerTensors:
    """One layer's tensors: norm weights [H] bf16, per linear (nibbles [N, K/2] uint8, d [N, K/32] fp16,
    m [N, K/32] fp16) for qkv, o, gate|up and down, and its K / V caches [Hkv, S, D] bf16."""
    in_norm: torch.Tensor
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    o: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    post_norm: torch.Tensor
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def addresses(self) -> list[int]:
        """The data pointers in the C driver's order (its LAYER_PTRS)."""
        ts = [self.in_norm, *self.qkv, *self.o, self.post_norm, *self.gate_up, *self.down, self.k_cache, self.v_cache]
        assert all(t.is_contiguous() for t in ts)
        return [t.data_ptr() for t in ts]


class Q4DecodeLayers:
    """The pointer table of all layers (kept with the tensors it points into) and bf16 scratch rows per row
    count, reused across steps."""

    def __init__(self, shape: LayerShape, layers: list[LayerTensors]) -> None:
        assert len(layers) == shape.layers and cpu_ops.available()
        self.shape, self.layers = shape, layers
        self.table = torch.tensor([a for lt in layers for a in lt.addresses()], dtype=torch.int64)
        assert self.table.numel() == shape.layers * cpu_ops.load().decode_layer_ptrs()
        self._scratch: dict[int, tuple[torch.Tensor, ...]] = {}

    def _rows(self, t: int) -> tuple[torch.Tensor, ...]:
        s = self._scratch.get(t)
        if s is None:
            sh = self.shape
            widths = ((sh.q_heads + 2 * sh.kv_heads) * sh.head_dim, sh.q_heads * sh.head_dim, sh.hidden,
                      2 * sh.inter, sh.inter)                                  # qkv, attention out, h, gate|up, act
            s = self._scratch[t] = tuple(torch.empty(t, w, dtype=torch.bfloat16) for w in widths)
        return s

    def run(self, x_in: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, table: torch.Tensor,
            lens: torch.Tensor, page_size: int, slots: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x_in [T, H] bf16 embeddings -> (last layer's output [T, H], residual stream [T, H]); positions,
        slots [T] int64; table [T, max_pages], lens [T] int64 as ``cpu_ops.paged_decode_attention`` takes them."""
        sh = self.shape
        T = x_in.shape[0]
        assert T <= MAX_ROWS and x_in.dtype == torch.bfloat16 and x_in.is_contiguous() and cos_sin.dtype == torch.float32
        assert positions.dtype == slots.dtype == lens.dtype == table.dtype == torch.int64 and table.is_contiguous() \
            and positions.is_contiguous() and slots.is_contiguous() and lens.is_contiguous()
        cpu_ops.check_positions(positions, cos_sin.shape[0])
        x, r = torch.empty_like(x_in), torch.empty_like(x_in)
        qkv, a, h, gu, act = self._rows(T)
        cpu_ops.load().q4_decode_layers(
            sh.layers, self.table.data_ptr(), x_in.data_ptr(), x.data_ptr(), r.data_ptr(), qkv.data_ptr(),
            a.data_ptr(), h.data_ptr(), gu.data_ptr(), act.data_ptr(), T, sh.hidden, sh.inter, sh.q_heads,
            sh.kv_heads, sh.head_dim, sh.eps, positions.data_ptr(), cos_sin.data_ptr(), table.data_ptr(),
            lens.data_ptr(), page_size, table.shape[1], self.layers[0].k_cache.shape[1], scale, slots.data_ptr())
        return x, r
