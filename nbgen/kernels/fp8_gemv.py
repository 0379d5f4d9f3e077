"""Decode-size fp8 matmuls: a few rows of per-token-quantized activations against an e4m3 weight.

At 1-16 rows a linear is a weight read (batch-1 decode of Llama-3.1-8B streams every weight once per
token), so with e4m3 weights it reads half the bytes of bf16. ``torch._scaled_mm`` runs a tensor-core
GEMM tiled for large M; at a handful of rows a kernel that streams BLOCK_N weight rows over the whole
K through registers (no split-K reduction pass) is the faster shape, as ``small_gemm`` is for bf16.

Arithmetic (the same as ``nbgen.models.fp8_linear.reference_matmul``, the torch reference the GPU test
compares against): y[m, n] = (sum_k xq[m, k] * wq[n, k]) * sx[m] * sw[n], products of e4m3 values
summed in fp32, one rounding to the output dtype.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

MAX_ROWS = 16   # up to this many rows the streaming kernel replaces torch._scaled_mm


if triton is not None:
    @triton.jit
    def _fp8_gemv_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym,
                         HAS_BIAS: tl.constexpr, QUANT_X: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # one program: BLOCK_N output features for all M (<= BLOCK_M) rows over the whole K.
        # QUANT_X: x is in the model dtype and each program quantizes it per row itself (x is a few
        # KB against the MBs of weight: re-reading it per program costs less than the ~5 launches of a
        # separate quantization, which at batch 1 would add ~1.5 ms a token over Llama-8B's 128 linears)
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        n_mask = rn < N
        m_mask = rm < M
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * swn
        if QUANT_X:
            amax = tl.zeros((BLOCK_M,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :],
                            other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
            sx = tl.maximum(amax, 1e-12) / 448.0
        else:
            sx = tl.load(sx_ptr + rm, mask=m_mask, other=1.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)          # [BLOCK_N, BLOCK_K]
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)                                 # [BLOCK_M, BLOCK_K]
            if QUANT_X:   # the reference's rounding: x / sx clamped to +-448, to e4m3
                x = tl.clamp(x / sx[:, None], -448.0, 448.0).to(tl.float8e4nv).to(tl.float32)
            # [BLOCK_M, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K] summed over K: FMAs, no tensor cores (M is tiny)
            acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
        sw = tl.load(sw_ptr + rn, mask=n_mask, other=0.0)
        y = acc * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def usable(x: torch.Tensor) -> bool:
    """The streaming kernel takes these rows (Triton present, CUDA, 1..MAX_ROWS contiguous rows)."""
    return triton is not None and x.is_cuda and 0 < x.shape[0] <= MAX_ROWS and x.dim() == 2 and x.stride(1) == 1


def pick_config(M: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): the accumulator tile BLOCK_M x BLOCK_N x BLOCK_K stays ~8K values
    per program, and enough programs (N / BLOCK_N) to fill an H100's 132 SMs."""
    if M == 1:
        return (8 if N <= 8192 else 16), 512, 4
    if M <= 4:
        return 8, 256, 4
    return 8, 64, 4


def fp8_gemv(xq: torch.Tensor, sx: Optional[torch.Tensor], wq: torch.Tensor, sw: torch.Tensor,
             bias: Optional[torch.Tensor], out_dtype: torch.dtype,
             config: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """xq [M, K] e4m3 (sx [M] fp32 per row) @ wq [N, K] e4m3 (sw [N] fp32 per output feature) -> [M, N]
    in ``out_dtype`` (+ bias). With ``sx`` None, ``xq`` is the activation in the model dtype and the
    kernel quantizes it per row (the same rounding as ``fp8_linear.quantize_rows``). Graph-capturable
    (one launch, no host sync)."""
    M, K = xq.shape
    N = wq.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    bm = max(2, triton.next_power_of_2(M))
    bn, bk, warps = config or pick_config(M, N)
    _fp8_gemv_kernel[(triton.cdiv(N, bn),)](
        xq, sx if sx is not None else sw, wq, sw, bias if bias is not None else sw, y, M, N, K, xq.stride(0),
        wq.stride(0), y.stride(0), HAS_BIAS=bias is not None, QUANT_X=sx is None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y
