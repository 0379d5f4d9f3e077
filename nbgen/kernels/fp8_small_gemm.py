"""Decode-size matmuls with e4m3 weights: ``kernels.small_gemm``'s streaming structure over fp8 rows.

At 1-16 rows an fp8 linear is a read of N x K weight bytes. cuBLAS's fp8 GEMM reads them at ~63 % of
the copy rate on an H100 at one row; here each program streams BLOCK_N e4m3 weight rows over the whole
K (16-byte loads, evicted first: they are read once), widens them in registers and accumulates in fp32;
no split-K, no reduce launch, launched with PDL like the bf16 kernel.

The recipe is ``nbgen.models.fp8_scaled``'s, so results equal its ``reference_matmul`` up to fp32
summation order: per row m, sa = max(amax(|x[m]|), 1e-10) / 448 and xq = e4m3(clamp(x / sa, +-448)) (IEEE
divisions), y = (sum_k xq[m, k] * wq[n, k]) * sa[m] * sw[n] (+ bias[n]), rounded once to x's dtype.
Two ways to get xq (``Fp8GemvConfig.prequant``):
- in the kernel: each program reduces its rows' amax over x first (x is a few KB, L2-resident), then
  rounds each x tile as it streams K; one launch per linear.
- ``kernels.fp8_quant.quant_rowwise`` first (one launch), the kernel then reads e4m3 x and sa: a
  quarter of the activation bytes per program and no divisions, for more rows.
Products: one row by fp32 FMAs into a [BLOCK_N, BLOCK_K] tile; more rows by a tensor-core dot of bf16
operands (e4m3 values are exact in bf16 and bf16 products exact in fp32; an fp8 dot would accumulate
below fp32 on Hopper). ``silu_mul``: the gate|up weight's two halves and SiLU-and-mul in the epilogue
(gate and up rounded to the output dtype first, as the unfused path does).

Folded RMSNorms (``nbgen.models.norm_fold``): the e4m3 weights stay as they are (a checkpoint's bytes);
the norm weight g scales x's columns in the kernel before the quantization (``col_scale``), so the
quantized activation is (x * g) per token: RMSNorm(x) = x * g * r[m] differs by the row factor r only,
which the per-token scale absorbs. r = rsqrt(mean(x^2) + eps) multiplies the output rows afterwards
(``row_scale_eps`` here for gate|up, the RoPE kernel for q/k/v), and o_proj / down_proj add into the
residual stream (``accumulate``): a decoder layer runs the same six launches as a folded bf16 one.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nbgen.kernels import fp8_quant, gpu_ops, pdl
from nbgen.kernels.small_gemm import row_tile, store_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

MAX_ROWS = 16      # rows of x up to which scaled fp8 linears take this kernel
FP8_MAX = 448.0
MIN_AMAX = 1e-10


class Fp8GemvConfig(NamedTuple):
    """A launch: rows padded to ``block_m`` (1: FMA products, >= 16: tensor-core dot), ``block_n``
    weight rows and ``block_k`` columns per tile, warps, pipeline stages, x quantized beforehand."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    prequant: bool


def pick_config(M: int, N: int, K: int) -> Fp8GemvConfig:
    """The launch for M rows against an [N, K] weight (N: output features, the gate half for
    ``silu_mul``). Tiles of ~8-16 KB of weight bytes, as the bf16 kernel's, and at most ~64 fp32
    accumulators a thread (no register spills on sm_90 with every epilogue); M > 1 pads to 16 rows."""
    if M == 1:
        return Fp8GemvConfig(1, 8 if N <= 4096 else 16, 1024, 8 if K <= 4096 else 4, 4, False)
    return Fp8GemvConfig(16, 64, 128, 4, 4, M > 4)


if triton is not None:
    @triton.jit
    def _act_scale(x_ptr, s_ptr, g_ptr, rm, sxm, M, K, PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr,
                   SUMSQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # (sa [BLOCK_M], sum of x^2 [BLOCK_M]) of rows rm: sa given (PREQUANT), else
        # max(amax(|x[m] (* g)|), 1e-10) / 448 over all of K; the sums of squares of the raw x alike
        rk = tl.arange(0, BLOCK_K)
        ss = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        if PREQUANT:
            sa = tl.load(s_ptr + rm, mask=rm < M, other=1.0)
        else:
            amax = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                v = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :],
                            other=0.0).to(tl.float32)
                if SUMSQ:
                    ss += v * v
                if COL_SCALE:
                    v = v * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
                amax = tl.maximum(amax, tl.abs(v))
            sa = tl.div_rn(tl.maximum(tl.max(amax, 1), 1e-10), 448.0)
        return sa, tl.sum(ss, 1)

    @triton.jit
    def _x_tile(x_ptr, g_ptr, rm, kk, sxm, M, K, sa, PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr,
                BLOCK_M: tl.constexpr):
        # x[rm, kk] as e4m3 [BLOCK_M, BLOCK_K]: loaded as such (PREQUANT), else rounded here from
        # x (* g) / sa. One row: a 1-D tile, so that each element is rounded once per program (its
        # layout then spreads the vector over the weight tile's threads)
        if BLOCK_M == 1:
            v = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
            if not PREQUANT:
                v = v.to(tl.float32)
                if COL_SCALE:
                    v = v * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                v = tl.clamp(tl.div_rn(v, tl.max(sa, 0)), -448.0, 448.0).to(tl.float8e4nv)
            v = v[None, :]
        else:
            v = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :],
                        other=0.0)
            if not PREQUANT:
                v = v.to(tl.float32)
                if COL_SCALE:
                    v = v * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
                v = tl.clamp(tl.div_rn(v, sa[:, None]), -448.0, 448.0).to(tl.float8e4nv)
        return v

    @triton.jit
    def _stream(x_ptr, g_ptr, w_rows, w0, sa, rm, sxm, M, K, n_mask, PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # sum_k xq[m, k] * wq[n, k] -> fp32 [BLOCK_M, BLOCK_N]; w0: the rows' first tile, already loaded
        rk = tl.arange(0, BLOCK_K)
        x = _x_tile(x_ptr, g_ptr, rm, rk, sxm, M, K, sa, PREQUANT, COL_SCALE, BLOCK_M)
        if BLOCK_M == 1:    # elementwise FMAs into a [BLOCK_N, BLOCK_K] tile, one reduction at the end
            acc = w0.to(tl.float32) * x.to(tl.float32)
        else:
            acc = tl.dot(x.to(tl.float16), tl.trans(w0.to(tl.float16)), tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w, kk, _k_mask = row_tile(w_rows, k0, K, n_mask, BLOCK_K)
            x = _x_tile(x_ptr, g_ptr, rm, kk, sxm, M, K, sa, PREQUANT, COL_SCALE, BLOCK_M)
            if BLOCK_M == 1:
                acc += w.to(tl.float32) * x.to(tl.float32)
            else:
                acc = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
        if BLOCK_M == 1:
            out = tl.sum(acc, 1)[None, :]
        else:
            out = acc
        return out

    @triton.jit
    def _fp8_small_gemm_kernel(x_ptr, s_ptr, g_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym, HALF, eps,
                               PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr, ROW_SCALE: tl.constexpr,
                               HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ACCUM: tl.constexpr,
                               USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < (HALF if SILU_MUL else N)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * swn
        u_rows = w_ptr + (rn + HALF).to(tl.int64)[:, None] * swn   # SILU_MUL: rows [HALF, 2 HALF) are "up"
        # weights and their scales do not depend on the kernel before: loaded before the wait
        w0, _kk, _km = row_tile(w_rows, 0, K, n_mask, BLOCK_K)
        sw = tl.load(sw_ptr + rn, mask=n_mask, other=0.0)
        if SILU_MUL:
            u0, _kk, _km = row_tile(u_rows, 0, K, n_mask, BLOCK_K)
            sw_u = tl.load(sw_ptr + rn + HALF, mask=n_mask, other=0.0)
        if USE_PDL:   # launched early (programmatic dependent launch): wait for x to be written
            pdl.gdc_wait()
        rm = tl.arange(0, BLOCK_M)
        sa, ss = _act_scale(x_ptr, s_ptr, g_ptr, rm, sxm, M, K, PREQUANT, COL_SCALE, ROW_SCALE, BLOCK_M, BLOCK_K)
        y = _stream(x_ptr, g_ptr, w_rows, w0, sa, rm, sxm, M, K, n_mask, PREQUANT, COL_SCALE, BLOCK_M, BLOCK_N, BLOCK_K)
        if SILU_MUL:
            u = _stream(x_ptr, g_ptr, u_rows, u0, sa, rm, sxm, M, K, n_mask, PREQUANT, COL_SCALE, BLOCK_M, BLOCK_N,
                        BLOCK_K)
        if USE_PDL:   # the next kernel may start launching (it waits for our writes itself)
            pdl.gdc_launch_dependents()
        y = y * sa[:, None] * sw[None, :]           # the reference's order: (acc * sa) * sw
        if ROW_SCALE:   # folded RMSNorm: the rows of x were not normalised yet
            r = tl.math.rsqrt(ss / K + eps)[:, None]
            y = y * r
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            u = u * sa[:, None] * sw_u[None, :]
            if ROW_SCALE:
                u = u * r
            if HAS_BIAS:
                u += tl.load(b_ptr + rn + HALF, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            u = y
        store_rows(y, u, y_ptr, rn, n_mask, M, sym, SILU_MUL, ACCUM, BLOCK_M)   # (SiLU-and-mul, residual add)


def usable(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """True when ``x @ dequant(wq).T`` may take this kernel: Triton and the fused GPU kernels on, 1 to
    MAX_ROWS rows of bf16 / fp16 x, contiguous rows, an e4m3 weight (the caller checks the GPU's fp8
    support: compute capability 8.9+)."""
    return (triton is not None and gpu_ops.fused_enabled(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and wq.dim() == 2 and wq.stride(1) == 1 and wq.dtype == torch.float8_e4m3fn)


def fp8_small_gemm(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   silu_mul: bool = False, config: Optional[Fp8GemvConfig] = None,
                   col_scale: Optional[torch.Tensor] = None, row_scale_eps: Optional[float] = None,
                   accumulate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ (wq [N, K] e4m3 * sw[n]).T (+ bias) -> [M, N] in x's dtype; with ``silu_mul`` ->
    [M, N / 2] = silu(gate) * up. ``sw``: N fp32 weight scales (any shape with N contiguous values; one
    scale per tensor repeated). The activation is quantized per row as the module docstring says.

    Folded RMSNorms (``nbgen.models.norm_fold``; x is then the raw residual stream): ``col_scale`` [K]
    (the norm weight g) multiplies x's columns before the quantization; ``row_scale_eps`` scales each
    output row by rsqrt(mean(x_row^2) + eps); ``accumulate``: a contiguous [M, N] tensor the result is
    added into (and returned). These quantize x in the kernel whatever ``config`` says."""
    M, K = x.shape
    N = wq.shape[0]
    out_n = N // 2 if silu_mul else N
    if accumulate is not None:
        assert accumulate.shape == (M, out_n) and accumulate.stride(1) == 1 and accumulate.dtype == x.dtype
        y = accumulate
    else:
        y = torch.empty((M, out_n), dtype=x.dtype, device=x.device)
    cfg = config or pick_config(M, out_n, K)
    if M == 0:
        return y
    if col_scale is not None or row_scale_eps is not None:
        cfg = cfg._replace(prequant=False)       # both need x itself
    if cfg.prequant:
        xs, sa = fp8_quant.quant_rowwise(x)      # xq [M, K] e4m3, sa [M, 1]
    else:
        xs, sa = x, sw                           # sa unused: the kernel reduces x itself
    bm = cfg.block_m if cfg.block_m == 1 else max(cfg.block_m, triton.next_power_of_2(M))
    assert bm >= M, f"block_m {cfg.block_m} < {M} rows"
    args = (xs, sa, col_scale if col_scale is not None else sw, wq, sw, bias if bias is not None else sw, y,
            M, N, K, xs.stride(0), wq.stride(0), y.stride(0), N // 2,
            0.0 if row_scale_eps is None else float(row_scale_eps))
    kw = dict(PREQUANT=cfg.prequant, COL_SCALE=col_scale is not None, ROW_SCALE=row_scale_eps is not None,
              HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ACCUM=accumulate is not None, BLOCK_M=bm,
              BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    pdl.launch(_fp8_small_gemm_kernel, (triton.cdiv(out_n, cfg.block_n),), args, x.device, **kw)
    return y
