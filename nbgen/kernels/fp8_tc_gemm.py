"""The per-feature fp8 matmul on tensor cores (Triton, Hopper wgmma) with its scales in the epilogue:

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * sa[m] * sw[n]  (+ bias[n])  (+ y[m, n] when accumulating)

xq [M, K] e4m3 (one scale per token, ``kernels.fp8_quant.quant_rowwise``), wq [N, K] e4m3 (one scale per
output feature), fp32 products and sums, one rounding to the output dtype, as
``nbgen.models.fp8_scaled.reference_matmul`` computes it (the residual add rounds once more, as
``into += y`` does). One launch replaces cuBLAS's GEMM plus the scaling or residual-add launch after it.

A program owns a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K steps (a last partial step masked): both
operands are K-major, as the fp8 wgmma wants them. Programs are ordered in groups of GROUP_M row blocks
over all column blocks, so a group's programs share each weight tile through the L2 cache. Rows past M
and columns past N read row M - 1 / N - 1 again (no masks in the K loop) and are not stored.
``PRECISE``: the tensor cores' partial sums are moved into the fp32 accumulator every BLOCK_K products
(Triton's default on sm_90 accumulates fp8 products in the tensor core's narrower accumulator).
Which launch shape serves a step is the table ``CONFIGS`` (rows bucket -> TcConfig), from
``python -m nbgen.bench.fp8_kernels --tc`` on an H100.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nbgen.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


@dataclass(frozen=True)
class TcConfig:
    """One launch shape of ``_fp8_tc_kernel``."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    precise: bool = True


# rows bucket (the smallest key >= M) -> launch shape
CONFIGS: dict[int, TcConfig] = {
    64: TcConfig(64, 128, 128, 4, 4),
    128: TcConfig(64, 128, 128, 4, 4),
    256: TcConfig(128, 128, 128, 8, 4),
    1 << 62: TcConfig(128, 256, 128, 8, 3),
}


def pick_config(m: int) -> TcConfig:
    """The ``CONFIGS`` entry for ``m`` rows."""
    return CONFIGS[min(b for b in CONFIGS if b >= m)]


if triton is not None:
    @triton.jit
    def _fp8_tc_kernel(x_ptr, sa_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, ACCUM: tl.constexpr, PRECISE: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, USE_PDL: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rm_in = tl.minimum(rm, M - 1).to(tl.int64)         # out-of-range rows / columns re-read the last
        rn_in = tl.minimum(rn, N - 1).to(tl.int64)
        x_ptrs = x_ptr + rm_in[:, None] * stride_xm + rk[None, :]          # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + rn_in[:, None] * stride_wn + rk[None, :]          # [BLOCK_N, BLOCK_K]
        if USE_PDL:
            pdl.gdc_wait()                     # x (and y when accumulating) come from the kernels before
            pdl.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:       # the last step's columns past K read as zeros
                a = tl.load(x_ptrs, mask=(k0 + rk < K)[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=(k0 + rk < K)[None, :], other=0.0)
            if PRECISE:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        sa = tl.load(sa_ptr + rm_in)
        sw = tl.load(sw_ptr + rn_in)
        acc = acc * sa[:, None] * sw[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_in).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        dt = y_ptr.dtype.element_ty
        if ACCUM:   # y += the product rounded to y's dtype first (as ``into += x @ W.T`` rounds)
            acc = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + acc.to(dt).to(tl.float32)
        tl.store(y_ptrs, acc.to(dt), mask=mask)


def usable(xq: torch.Tensor, wq: torch.Tensor) -> bool:
    """The kernel takes this product: Triton present, CUDA, K a multiple of 16, unit column strides."""
    return (triton is not None and xq.is_cuda and xq.shape[1] % 16 == 0 and xq.stride(1) == 1
            and wq.stride(1) == 1)


def fp8_tc_gemm(xq: torch.Tensor, sa: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                out: Optional[torch.Tensor] = None, accumulate: bool = False,
                cfg: Optional[TcConfig] = None) -> torch.Tensor:
    """xq [M, K] e4m3, sa [M, 1] fp32, wq [N, K] e4m3, sw [1, N] fp32 -> y [M, N] in ``out_dtype`` (see the
    module docstring), into ``out`` ([M, N], unit column stride) when given; ``accumulate``: y is added
    into ``out`` in place. One launch, graph-capturable."""
    M, K = xq.shape
    N = wq.shape[0]
    cfg = cfg or pick_config(M)
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs out (the tensor to add into)")
        out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    pdl.launch(_fp8_tc_kernel, grid,
               (xq, sa, wq, sw, bias if bias is not None else sw, out, M, N, K, xq.stride(0), wq.stride(0),
                out.stride(0)), xq.device,
               HAS_BIAS=bias is not None, ACCUM=accumulate, PRECISE=cfg.precise, EVEN_K=K % cfg.block_k == 0,
               BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
