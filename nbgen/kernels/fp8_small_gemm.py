"""Decode-size matmuls with e4m3 weights: ``kernels.small_gemm``'s streaming structure over fp8 rows.

At 1-16 rows an fp8 linear is a read of N x K weight bytes. cuBLAS's fp8 GEMM reads them at 63-98 % of
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
Products: a tensor-core dot of fp16 operands, x padded to 16 rows (e4m3 values are exact in fp16 and
fp16 products exact in fp32; an fp8 dot would accumulate below fp32 on Hopper). One row (batch-1
decode) goes to ``kernels.fp8_row_gemv`` instead: FMAs with the warps along K, faster on an H100 at
every Llama-3.1-8B shape (``nbgen.bench.fp8_gemv``), with gate|up's SiLU-and-mul in its epilogue when
the layer is folded. Otherwise a gate|up weight runs as one linear and the SiLU-and-mul launch follows.

Folded RMSNorms (``nbgen.models.norm_fold``): the e4m3 weights stay as they are (a checkpoint's bytes);
the norm weight g scales x's columns in the kernel before the quantization (``col_scale``), so the
quantized activation is (x * g) per token: RMSNorm(x) = x * g * r[m] differs by the row factor r only,
which the per-token scale absorbs. r = rsqrt(mean(x^2) + eps) multiplies the output rows afterwards (the
RoPE kernel for q/k/v, the scaled SiLU-and-mul for gate|up, at one row the one-row kernel's epilogue),
and o_proj / down_proj add into the residual stream (``accumulate``), as in a folded bf16 layer.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nbgen.kernels import fp8_quant, fp8_row_gemv, gpu_ops, pdl
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
    """A launch: rows padded to ``block_m`` (>= 16: tensor-core dot), ``block_n`` weight rows and
    ``block_k`` columns per tile, warps, pipeline stages, x quantized beforehand."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    prequant: bool


def pick_config(M: int, N: int, K: int) -> Fp8GemvConfig:
    """The launch for 2-16 rows against an [N, K] weight (one row: ``fp8_row_gemv.pick_config``): padded
    to 16 rows (tensor-core dot), x quantized in the kernel up to 4 rows and by its own launch above."""
    return Fp8GemvConfig(16, 64, 128, 4, 4, M > 4)


if triton is not None:
    from nbgen.kernels.fp8_quant import e4m3_scale, to_e4m3

    @triton.jit
    def _act_scale(x_ptr, s_ptr, g_ptr, rm, sxm, M, K, PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # sa [BLOCK_M] of rows rm: given (PREQUANT), else max(amax(|x[m] (* g)|), 1e-10) / 448 over all of K
        rk = tl.arange(0, BLOCK_K)
        if PREQUANT:
            sa = tl.load(s_ptr + rm, mask=rm < M, other=1.0)
        else:
            amax = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                v = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :],
                            other=0.0).to(tl.float32)
                if COL_SCALE:
                    v = v * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
                amax = tl.maximum(amax, tl.abs(v))
            sa = e4m3_scale(tl.max(amax, 1))
        return sa

    @triton.jit
    def _x_tile(x_ptr, g_ptr, rm, kk, sxm, M, K, sa, PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr):
        # x[rm, kk] as e4m3 [BLOCK_M, BLOCK_K]: loaded as such (PREQUANT), else rounded here from x (* g) / sa
        v = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
        if not PREQUANT:
            v = v.to(tl.float32)
            if COL_SCALE:
                v = v * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
            v = to_e4m3(v, sa[:, None])
        return v

    @triton.jit
    def _stream(x_ptr, g_ptr, w_rows, w0, sa, rm, sxm, M, K, n_mask, PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # sum_k xq[m, k] * wq[n, k] -> fp32 [BLOCK_M, BLOCK_N] (tensor-core dot of fp16 operands); w0: the
        # rows' first tile, already loaded
        rk = tl.arange(0, BLOCK_K)
        x = _x_tile(x_ptr, g_ptr, rm, rk, sxm, M, K, sa, PREQUANT, COL_SCALE)
        acc = tl.dot(x.to(tl.float16), tl.trans(w0.to(tl.float16)), tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w, kk, _k_mask = row_tile(w_rows, k0, K, n_mask, BLOCK_K)
            x = _x_tile(x_ptr, g_ptr, rm, kk, sxm, M, K, sa, PREQUANT, COL_SCALE)
            acc = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
        return acc

    @triton.jit
    def _fp8_small_gemm_kernel(x_ptr, s_ptr, g_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym,
                               PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                               ACCUM: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * swn
        # weights and their scales do not depend on the kernel before: loaded before the wait
        w0, _kk, _km = row_tile(w_rows, 0, K, n_mask, BLOCK_K)
        sw = tl.load(sw_ptr + rn, mask=n_mask, other=0.0)
        if USE_PDL:   # launched early (programmatic dependent launch): wait for x to be written
            pdl.gdc_wait()
        rm = tl.arange(0, BLOCK_M)
        sa = _act_scale(x_ptr, s_ptr, g_ptr, rm, sxm, M, K, PREQUANT, COL_SCALE, BLOCK_M, BLOCK_K)
        y = _stream(x_ptr, g_ptr, w_rows, w0, sa, rm, sxm, M, K, n_mask, PREQUANT, COL_SCALE, BLOCK_M, BLOCK_N, BLOCK_K)
        if USE_PDL:   # the next kernel may start launching (it waits for our writes itself)
            pdl.gdc_launch_dependents()
        y = y * sa[:, None] * sw[None, :]           # the reference's order: (acc * sa) * sw
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        store_rows(y, y, y_ptr, rn, n_mask, M, sym, False, ACCUM, BLOCK_M)   # (the residual add)

def usable(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """True when ``x @ dequant(wq).T`` may take this kernel: Triton and the fused GPU kernels on, 1 to
    MAX_ROWS rows of bf16 / fp16 x, contiguous rows, an e4m3 weight (the caller checks the GPU's fp8
    support: compute capability 8.9+)."""
    return (triton is not None and gpu_ops.fused_enabled(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and wq.dim() == 2 and wq.stride(1) == 1 and wq.dtype == torch.float8_e4m3fn)


def fp8_small_gemm(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   config: Optional[Fp8GemvConfig] = None, col_scale: Optional[torch.Tensor] = None,
                   accumulate: Optional[torch.Tensor] = None, early_tiles: int = 1) -> torch.Tensor:
    """x [M, K] @ (wq [N, K] e4m3 * sw[n]).T (+ bias) -> [M, N] in x's dtype. ``sw``: N fp32 weight
    scales (any shape with N contiguous values; one scale per tensor repeated). The activation is
    quantized per row as the module docstring says.

    Folded RMSNorms (``nbgen.models.norm_fold``; x is then the raw residual stream): ``col_scale`` [K]
    (the norm weight g) multiplies x's columns before the quantization (x is then quantized in the
    kernel whatever ``config`` says); ``accumulate``: a contiguous [M, N] tensor the result is added
    into (and returned). ``early_tiles``: the one-row kernel's (``fp8_row_gemv``)."""
    M, K = x.shape
    N = wq.shape[0]
    if accumulate is not None:
        assert accumulate.shape == (M, N) and accumulate.stride(1) == 1 and accumulate.dtype == x.dtype
        y = accumulate
    else:
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    cfg = config or pick_config(M, N, K)
    if M == 0:
        return y
    if M == 1 and config is None:               # batch 1: the one-row kernel (warps along K)
        return fp8_row_gemv.fp8_row_gemv(x, wq, sw, y, bias, col_scale, accumulate is not None,
                                         early_tiles=early_tiles)
    if col_scale is not None:
        cfg = cfg._replace(prequant=False)       # x * g: quantized here
    if cfg.prequant:
        xs, sa = fp8_quant.quant_rowwise(x)      # xq [M, K] e4m3, sa [M, 1]
    else:
        xs, sa = x, sw                           # sa unused: the kernel reduces x itself
    bm = max(cfg.block_m, triton.next_power_of_2(M), 16)
    args = (xs, sa, col_scale if col_scale is not None else sw, wq, sw, bias if bias is not None else sw, y,
            M, N, K, xs.stride(0), wq.stride(0), y.stride(0))
    kw = dict(PREQUANT=cfg.prequant, COL_SCALE=col_scale is not None, HAS_BIAS=bias is not None,
              ACCUM=accumulate is not None, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    pdl.launch(_fp8_small_gemm_kernel, (triton.cdiv(N, cfg.block_n),), args, x.device, **kw)
    return y
