"""Activation quantization to e4m3 and the output scaling for cuBLAS's fp8 GEMM (``torch._scaled_mm``),
one launch each:
- ``quant_rowwise(x, col_scale)``: one scale per row, s = max(amax(|x[m]|), 1e-10) / 448, [M, 1] fp32 (the
  row-wise GEMM's ``scale_a``; at one row, viewed as 0-dim, the tensorwise GEMM's); ``col_scale``: of x * g
  per column (a folded norm's weight) without an fp32 copy of it. The programs of a row each reduce the
  whole row and round their own blocks.
- ``scale_output(acc, sa, sw, bias, dtype)``: y = acc * sa[m] * sw[n] (+ bias[n]) rounded to ``dtype``:
  the epilogue of a unit-scale tensorwise GEMM (fp32 out) when the weight has one scale per output
  feature (cuBLAS's row-wise fp8 GEMM is slower than bf16 at a few rows; this pair is not); with
  ``accumulate`` it adds y into the residual stream in the same launch.
- ``scale_add_quant(acc, sa, sw, into, col_scale)``: that residual add, and the updated stream's rows
  quantized as ``quant_rowwise(into, col_scale)`` quantizes them (the input of the next folded linear), one
  program a row holding the whole row: the stream is not read back by a second launch.

``QuantizedRows`` hands quantized rows to the next product in place of its bf16 input.

The quantizer rounds as ``nbgen.models.fp8_scaled``'s torch reference does: q = e4m3(clamp(x / s, ±448)),
with ``tl.div_rn``'s quotients (Triton's ``/`` may be approximate) so the e4m3 bytes match it exactly: the
scale by an IEEE division, the values through its reciprocal with one exact correction (``kv_write.div_rcp``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

BLOCK = 2048         # columns a program rounds (and reduces per step of its amax loop)
ONE_PROGRAM_ROWS = 256   # from this many rows on, one program quantizes a whole row
ADD_QUANT_MAX_COLS = 16384   # scale_add_quant holds a whole row in one program's registers


@dataclass
class QuantizedRows:
    """Activation rows quantized for cuBLAS's fp8 GEMM, handed to the next product in place of them:
    ``q`` [M, K] e4m3, ``scale`` [M, 1] fp32 (row m ~ q[m] * scale[m]; of x * g where quantized with a
    folded norm's column scale g); ``dtype`` the rows' own dtype (the product's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

if triton is not None:
    from nbgen.kernels.kv_write import to_e4m3

    @triton.jit
    def e4m3_scale(amax):
        # a token's scale from its amax: max(amax, 1e-10) / 448, an IEEE division (Triton's ``/`` may not be)
        return tl.div_rn(tl.maximum(amax, 1e-10), 448.0)

    @triton.jit
    def _quant_rowwise_kernel(x_ptr, g_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, HAS_G: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        # program (p, row) of P a row: the row's amax (its programs alike), then blocks p, p + P, ... of it
        # (the programs of a row are launched one after the other, so their re-reads hit the L2 cache)
        p = tl.program_id(0)
        row = tl.program_id(1)
        rk = tl.arange(0, BLOCK_K)
        x_row = x_ptr + row.to(tl.int64) * stride_xm
        amax = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(x_row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            if HAS_G:    # a folded norm's weight: the activation is x * g (fp32 products)
                v = v * tl.load(g_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        s = e4m3_scale(tl.max(amax, 0))
        for k0 in range(p * BLOCK_K, K, tl.num_programs(0) * BLOCK_K):
            kk = k0 + rk
            v = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
            if HAS_G:
                v = v * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            q = to_e4m3(v, s)
            tl.store(q_ptr + row.to(tl.int64) * stride_qm + kk, q, mask=kk < K)
        if p == 0:
            tl.store(s_ptr + row, s)

    @triton.jit
    def _scale_output_kernel(acc_ptr, sa_ptr, sw_ptr, b_ptr, y_ptr, N, stride_am, stride_ym,
                             SA_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUM: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = rn < N
        acc = tl.load(acc_ptr + row.to(tl.int64) * stride_am + rn, mask=mask, other=0.0)
        sa = tl.load(sa_ptr + row) if SA_PER_ROW else tl.load(sa_ptr)
        y = acc * sa * tl.load(sw_ptr + rn, mask=mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=mask, other=0.0).to(tl.float32)
        y_ptrs = y_ptr + row.to(tl.int64) * stride_ym + rn
        dt = y_ptr.dtype.element_ty
        if ACCUM:   # the residual add: the product rounded to y's dtype first, as ``into += y`` rounds it
            y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + y.to(dt).to(tl.float32)
        tl.store(y_ptrs, y.to(dt), mask=mask)

    @triton.jit
    def _scale_add_quant_kernel(acc_ptr, sa_ptr, sw_ptr, h_ptr, g_ptr, q_ptr, s_ptr, N, stride_am, stride_hm,
                                stride_qm, BLOCK_N: tl.constexpr):
        # one program a row, the whole row at once: h[row] += acc * sa * sw (as _scale_output_kernel's
        # ACCUM), then the new row times g quantized as _quant_rowwise_kernel does (same fp32 operations)
        row = tl.program_id(0).to(tl.int64)
        rn = tl.arange(0, BLOCK_N)
        mask = rn < N
        acc = tl.load(acc_ptr + row * stride_am + rn, mask=mask, other=0.0)
        y = acc * tl.load(sa_ptr + row) * tl.load(sw_ptr + rn, mask=mask, other=0.0)
        h_ptrs = h_ptr + row * stride_hm + rn
        dt = h_ptr.dtype.element_ty
        h = (tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32) + y.to(dt).to(tl.float32)).to(dt)
        tl.store(h_ptrs, h, mask=mask)
        v = h.to(tl.float32) * tl.load(g_ptr + rn, mask=mask, other=0.0).to(tl.float32)
        s = e4m3_scale(tl.max(tl.abs(v), 0))
        q = to_e4m3(v, s)
        tl.store(q_ptr + row * stride_qm + rn, q, mask=mask)
        tl.store(s_ptr + row, s)


def quant_rowwise(x: torch.Tensor, col_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, s [M, 1] fp32), x[m] ~ q[m] * s[m]; ``col_scale`` [K] (a folded norm's
    weight g): the rows of x * g (fp32 products) instead. One launch; graph-capturable."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        # a few rows: a program per block of each row (each reduces the row); many rows: one a row,
        # which reads its row twice instead of once per block
        per_row = triton.cdiv(K, BLOCK) if M < ONE_PROGRAM_ROWS else 1
        _quant_rowwise_kernel[(per_row, M)](x, col_scale if col_scale is not None else x, q, s, K, x.stride(0),
                                            q.stride(0), HAS_G=col_scale is not None, BLOCK_K=BLOCK)
    return q, s


def scale_output(acc: torch.Tensor, sa: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
                 dtype: torch.dtype, out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """acc [M, N] fp32 (a unit-scale GEMM's output), sa 0-dim or [M, 1], sw [1, N] fp32 ->
    acc * sa * sw (+ bias) in ``dtype``, one launch (fp32 products in this order, one rounding), into
    ``out`` ([M, N], unit column stride) when given; ``accumulate``: added into ``out`` in place (rounded
    to its dtype first, then the sum rounded: ``out += y``)."""
    M, N = acc.shape
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs out (the tensor to add into)")
        out = torch.empty((M, N), dtype=dtype, device=acc.device)
    if M:
        grid = (M, triton.cdiv(N, BLOCK))
        _scale_output_kernel[grid](acc, sa, sw, bias if bias is not None else sw, out, N, acc.stride(0), out.stride(0),
                                   SA_PER_ROW=sa.dim() > 0, HAS_BIAS=bias is not None, ACCUM=accumulate,
                                   BLOCK_N=BLOCK)
    return out


def scale_add_quant(acc: torch.Tensor, sa: torch.Tensor, sw: torch.Tensor, into: torch.Tensor,
                    col_scale: torch.Tensor) -> QuantizedRows:
    """``scale_output(acc, sa, sw, None, into.dtype, out=into, accumulate=True)`` (acc [M, N] fp32, sa
    [M, 1], sw [1, N]), then the updated rows of ``into`` [M, N] (contiguous) quantized as
    ``quant_rowwise(into, col_scale)`` does (col_scale [N]: a folded norm's weight) -> those rows; one
    launch, the same bits as that pair. N at most ``ADD_QUANT_MAX_COLS``."""
    M, N = into.shape
    if N > ADD_QUANT_MAX_COLS:
        raise ValueError(f"into has {N} columns; scale_add_quant takes at most {ADD_QUANT_MAX_COLS}")
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=into.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=into.device)
    if M:
        block = triton.next_power_of_2(N)
        _scale_add_quant_kernel[(M,)](acc, sa, sw, into, col_scale, q, s, N, acc.stride(0), into.stride(0),
                                      q.stride(0), BLOCK_N=block, num_warps=max(4, min(16, block // 512)))
    return QuantizedRows(q, s, into.dtype)
