"""Decode-size matmuls (a few rows of x against a large weight) as one streaming Triton kernel.

At batch 1-16 a linear is mostly a weight read: y[m, n] = sum_k x[m, k] * W[n, k]. cuBLAS picks split-K
kernels for some of these shapes (a second reduce launch) and reaches ~80-90 % of copy bandwidth
on an H100; a kernel that only streams W's rows through registers, each program owning BLOCK_N
output features over the whole K, needs no reduction pass. The gate|up variant also applies
SiLU-and-mul to its two halves in the epilogue (one launch and one [M, 2I] round trip fewer).
On Hopper the kernel is launched as a programmatic dependent launch: its programs start while the
previous kernel drains and wait (griddepcontrol) only before touching memory, which hides most of
the launch gap between the ~300 small kernels of a batch-1 decode step.

Numerics: fp32 accumulation, one rounding to the output dtype, like cuBLAS; the summation order
differs, so results can differ from F.linear in the last bit. The SiLU epilogue rounds gate and up
to the model dtype first, as the unfused path does.

For folded norms (``nbgen.models.norm_fold``) the kernel can also scale each output row by
rsqrt(mean(x_row^2) + eps) of its own input row (``row_scale_eps``: the norm weight is in W, x is the
raw residual stream; each program sums x^2 over the K it streams anyway) and add its result into an
existing [M, N] tensor (``accumulate``: the residual add after o_proj / down_proj, one rounding).
"""
from __future__ import annotations

from typing import Optional

import torch

from nbgen.kernels import gpu_ops, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

# rows of x up to which the streaming kernel replaces F.linear (at 24-32 rows cuBLAS's Llama-8B
# gate|up beats it)
MAX_ROWS = 16


def pick_config(M: int, N: int, K: int, silu_mul: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), from sweeps on an H100 over the Llama-3.1-8B and
    Qwen3-0.6B decode shapes (1-4 and 5-16 rows; best or within ~2 % of it on each shape). One row:
    from ``nbgen.bench.decode_layers --sweep`` over Llama-3.1-8B's whole layers and tp 2 / 4 shards
    (each linear's launch inside the layer's graph: 4 warps everywhere; gate|up, whose programs stream
    a gate and an up row each, 2 output features a program)."""
    if M == 1:
        return (2 if silu_mul else 4 if N < 4096 else 8), 1024, 4, 4
    if M <= 4:   # tensor-core dot, x padded to 16 rows
        return (64, 256, 4, 5) if N * K >= (1 << 24) else (32, 128, 4, 5)
    return (16 if N <= 1024 else 32), (256 if K >= 2048 else 128), 4, 4


if triton is not None:
    @triton.jit
    def row_tile(w_rows, k0, K, n_mask, BLOCK_K: tl.constexpr):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        return w, kk, k_mask

    @triton.jit
    def store_rows(y, u, y_ptr, rn, n_mask, M, sym, SILU_MUL: tl.constexpr, ACCUM: tl.constexpr,
                   BLOCK_M: tl.constexpr):
        # fp32 results [BLOCK_M, BLOCK_N] of output columns rn -> rows [0, M) of y_ptr, one rounding: with
        # SILU_MUL, silu(y) * u (gate and up rounded to the output dtype before the activation, as the
        # unfused path does); with ACCUM added to what y_ptr holds (the residual stream)
        dt = y_ptr.dtype.element_ty
        if SILU_MUL:
            g = y.to(dt).to(tl.float32)
            u = u.to(dt).to(tl.float32)
            y = g / (1.0 + tl.exp(-g)) * u
        rm = tl.arange(0, BLOCK_M)
        y_tile = y_ptr + rm[:, None] * sym + rn[None, :]
        out_mask = (rm < M)[:, None] & n_mask[None, :]
        if ACCUM:
            y += tl.load(y_tile, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(y_tile, y.to(dt), mask=out_mask)

    @triton.jit
    def _one_row(x_ptr, w_rows, w0, K, n_mask, BLOCK_K: tl.constexpr, SUMSQ: tl.constexpr):
        # x [K] against BLOCK_N weight rows whose first tile w0 is already loaded -> (fp32 [1, BLOCK_N],
        # sum of x^2: a scalar, over all of K only when SUMSQ): elementwise FMAs into a [BLOCK_N, BLOCK_K]
        # tile, one reduction at the end
        rk = tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        acc = w0.to(tl.float32) * x[None, :]
        ss = x * x
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w, kk, k_mask = row_tile(w_rows, k0, K, n_mask, BLOCK_K)
            x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            if SUMSQ:
                ss += x * x
        return tl.sum(acc, 1)[None, :], tl.sum(ss, 0)

    @triton.jit
    def _few_rows(x_ptr, w_rows, w0, K, sxm, n_mask, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SUMSQ: tl.constexpr):
        # x rows [0, M) padded to BLOCK_M (>= 16) against BLOCK_N weight rows whose first tile w0 is
        # already loaded, tensor-core dot -> (fp32 [BLOCK_M, BLOCK_N], per-row sum of x^2 [BLOCK_M] when
        # SUMSQ)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w0), tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
        ss = tl.zeros((BLOCK_M,), tl.float32)
        if SUMSQ:
            ss += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w, kk, k_mask = row_tile(w_rows, k0, K, n_mask, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm < M)[:, None] & k_mask[None, :],
                        other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            if SUMSQ:
                ss += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
        return acc, ss

    # M (2-16 rows share a BLOCK_M of 16) only bounds masks: not specialised on, so batch 8 and 16 share a
    # variant (fewer compiles on a cold start)
    @triton.jit(do_not_specialize=["M"])
    def _small_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym, HALF, eps,
                           HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ROW_SCALE: tl.constexpr,
                           ACCUM: tl.constexpr, USE_PDL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        out_n = HALF if SILU_MUL else N
        n_mask = rn < out_n
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * swn
        u_rows = w_ptr + (rn + HALF).to(tl.int64)[:, None] * swn   # SILU_MUL: rows [HALF, 2 HALF) are "up"
        # the weights do not depend on the kernel before: their first tiles load before the wait
        w0, _kk, _km = row_tile(w_rows, 0, K, n_mask, BLOCK_K)
        if SILU_MUL:
            u0, _kk, _km = row_tile(u_rows, 0, K, n_mask, BLOCK_K)
        if USE_PDL:   # launched early (programmatic dependent launch): wait for x to be written
            pdl.gdc_wait()
        if BLOCK_M == 1:
            y, ss = _one_row(x_ptr, w_rows, w0, K, n_mask, BLOCK_K, ROW_SCALE)
            if SILU_MUL:
                u, _ss = _one_row(x_ptr, u_rows, u0, K, n_mask, BLOCK_K, False)
        else:
            y, ss = _few_rows(x_ptr, w_rows, w0, K, sxm, n_mask, M, BLOCK_M, BLOCK_N, BLOCK_K, ROW_SCALE)
            ss = ss[:, None]
            if SILU_MUL:
                u, _ss = _few_rows(x_ptr, u_rows, u0, K, sxm, n_mask, M, BLOCK_M, BLOCK_N, BLOCK_K, False)
        if USE_PDL:   # the next kernel may start launching (it waits for our writes itself)
            pdl.gdc_launch_dependents()
        if ROW_SCALE:   # folded RMSNorm: the rows of x were not normalised yet
            r = tl.math.rsqrt(ss / K + eps)
            y = y * r
            if SILU_MUL:
                u = u * r
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if not SILU_MUL:
            u = y
        store_rows(y, u, y_ptr, rn, n_mask, M, sym, SILU_MUL, ACCUM, BLOCK_M)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` should take the streaming kernel (fused GPU kernels on, few rows,
    contiguous W)."""
    return (triton is not None and gpu_ops.fused_enabled(x) and 0 < x.shape[0] <= MAX_ROWS and x.dim() == 2
            and weight.dim() == 2 and weight.stride(1) == 1 and x.stride(1) == 1
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16))


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               silu_mul: bool = False, config: Optional[tuple[int, int, int, int]] = None,
               row_scale_eps: Optional[float] = None, accumulate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N]; with ``silu_mul`` -> [M, N/2] = silu(gate) * up.

    ``row_scale_eps``: scale each row by rsqrt(mean(x_row^2) + eps) first (a folded RMSNorm).
    ``accumulate``: a contiguous [M, N] tensor the result is added into (and returned)."""
    M, K = x.shape
    N = weight.shape[0]
    out_n = N // 2 if silu_mul else N
    if accumulate is not None:
        assert accumulate.shape == (M, out_n) and accumulate.stride(1) == 1
        y = accumulate
    else:
        y = torch.empty((M, out_n), dtype=x.dtype, device=x.device)
    bm = 1 if M == 1 else max(16, triton.next_power_of_2(M))
    bn, bk, warps, stages = config or pick_config(M, out_n, K, silu_mul)
    args = (x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0),
            y.stride(0), N // 2, 0.0 if row_scale_eps is None else float(row_scale_eps))
    kw = dict(HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ROW_SCALE=row_scale_eps is not None,
              ACCUM=accumulate is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
              num_warps=warps, num_stages=stages)
    pdl.launch(_small_gemm_kernel, (triton.cdiv(out_n, bn),), args, x.device, **kw)
    return y
