"""Group-scaled fp8 matmuls (Triton): e4m3 activations with one scale per token and 128 columns against
an e4m3 weight with one scale per output row and 128 columns (the "1x128 x 1x128" block-fp8 recipe).

y[m, n] = sum_g (sum_{k in g} xq[m, k] * wq[n, k]) * sx[m, g] * sw[n, g]   (+ bias[n])

products of e4m3 values summed in fp32 per 128-column group, scaled, summed over groups in fp32, one
rounding to the output dtype. ``nbgen.models.fp8_linear.reference_matmul`` computes the same in torch
(the reference the GPU tests compare with).

One kernel serves every row count. A program owns a BLOCK_M x BLOCK_N tile of y and walks its share of
the K groups (SPLIT_K programs share one tile's K range and add their partial sums atomically into an
fp32 buffer). Each step loads one 128-column group: BLOCK_N weight rows of 128 bytes (eight 16-byte
vectors a row), the matching activation columns, and the two scale vectors.
- QUANT_X: the activation arrives in the model dtype and each program rounds its own group to e4m3
  (at decode sizes x is a few KB against MBs of weight: re-reading it beats a separate launch).
- USE_DOT: the group product on tensor cores (``tl.dot``, fp8 x fp8 -> fp32; BLOCK_M >= 16) or as
  FMAs on a [BLOCK_M, BLOCK_N, 128] broadcast (no padding of 1-row GEMVs to 16 rows).
Which variant runs is the table ``CONFIGS`` below (rows bucket -> GemmConfig), filled from
``python -m nbgen.bench.fp8_kernels`` on a GPU; edit it there.
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

GROUP = 128          # columns per scale (weights and activations)
FP8_MAX = 448.0      # largest finite e4m3fn value
MIN_AMAX = 1e-10     # an all-zero group keeps a finite scale


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of ``_fp8_group_gemm_kernel``."""

    block_m: int          # rows of y per program (>= 16 with use_dot)
    block_n: int          # output features per program
    split_k: int          # programs sharing one tile's K groups (> 1: fp32 atomics + a cast)
    num_warps: int
    num_stages: int
    use_dot: bool         # tensor cores (tl.dot) or FMAs
    quant_x: bool         # quantize x inside the kernel (else a per_token_group_quant launch first)


# rows bucket (the smallest key >= M) -> config. Edit from the sweep's winners
# (python -m nbgen.bench.fp8_kernels prints one line per shape and variant).
CONFIGS: dict[int, GemmConfig] = {      # H200 sweep winners (sum of the four Llama-8B shapes per rows bucket)
    1: GemmConfig(block_m=16, block_n=64, split_k=2, num_warps=4, num_stages=3, use_dot=True, quant_x=True),
    4: GemmConfig(block_m=16, block_n=64, split_k=2, num_warps=4, num_stages=3, use_dot=True, quant_x=True),
    16: GemmConfig(block_m=16, block_n=64, split_k=2, num_warps=4, num_stages=3, use_dot=True, quant_x=True),
    64: GemmConfig(block_m=64, block_n=64, split_k=1, num_warps=4, num_stages=3, use_dot=True, quant_x=False),
    1 << 62: GemmConfig(block_m=64, block_n=64, split_k=1, num_warps=4, num_stages=3, use_dot=True, quant_x=False),
}


def pick_config(m: int) -> GemmConfig:
    """The ``CONFIGS`` entry for ``m`` rows."""
    return CONFIGS[min(b for b in CONFIGS if b >= m)]


if triton is not None:
    @triton.jit
    def _fp8_group_gemm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, G,
                               stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
                               HAS_BIAS: tl.constexpr, QUANT_X: tl.constexpr, USE_DOT: tl.constexpr,
                               SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               GROUP_K: tl.constexpr):
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        n_tiles = tl.cdiv(N, BLOCK_N)
        rm = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, GROUP_K)
        m_mask = rm < M
        n_mask = rn < N
        per_split = tl.cdiv(G, SPLIT_K)
        g_lo = pid_k * per_split
        g_hi = tl.minimum(g_lo + per_split, G)
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for g in range(g_lo, g_hi):
            kk = g * GROUP_K + rk
            k_mask = kk < K
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if QUANT_X:   # the reference's rounding: scale = max(amax, MIN_AMAX) / 448, x / scale to e4m3
                xf = x.to(tl.float32)
                sx = tl.maximum(tl.max(tl.abs(xf), 1), 1e-10) / 448.0                    # [BLOCK_M]
                xq = tl.clamp(xf / sx[:, None], -448.0, 448.0).to(tl.float8e4nv)
            else:
                xq = x
                sx = tl.load(sx_ptr + rm * stride_sxm + g, mask=m_mask, other=1.0)
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")                                    # [BLOCK_N, GROUP_K]
            sw = tl.load(sw_ptr + rn * stride_swn + g, mask=n_mask, other=0.0)            # [BLOCK_N]
            if USE_DOT:
                part = tl.dot(xq, tl.trans(w))                                            # fp32 [BLOCK_M, BLOCK_N]
            else:
                part = tl.sum(xq.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
            acc += part * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            if pid_k == 0:
                acc += bias[None, :]
        out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out, acc, mask=mask)

    @triton.jit
    def _per_token_group_quant_kernel(x_ptr, q_ptr, s_ptr, K, G, stride_xm, stride_qm,
                                      GROUP_K: tl.constexpr):
        pid = tl.program_id(0)           # one program per (row, group)
        row = pid // G
        g = pid % G
        kk = g * GROUP_K + tl.arange(0, GROUP_K)
        k_mask = kk < K
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + kk, mask=k_mask, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), 0), 1e-10) / 448.0
        q = tl.clamp(x / s, -448.0, 448.0).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + row.to(tl.int64) * stride_qm + kk, q, mask=k_mask)
        tl.store(s_ptr + pid, s)


def usable(x: torch.Tensor) -> bool:
    """These kernels take ``x`` (Triton present, CUDA, a 2-D tensor with contiguous rows)."""
    return triton is not None and x.is_cuda and x.dim() == 2 and x.stride(1) == 1


def per_token_group_quant_fp8(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, scales [M, ceil(K / group)] fp32), x ~ xq * scale per group
    (SGLang's ``per_token_group_quant_fp8`` with row-major scales). One launch, no host sync."""
    M, K = x.shape
    G = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, G), dtype=torch.float32, device=x.device)
    if M:
        _per_token_group_quant_kernel[(M * G,)](x, q, s, K, G, x.stride(0), q.stride(0), GROUP_K=group)
    return q, s


def fp8_group_gemm(x: torch.Tensor, sx: Optional[torch.Tensor], wq: torch.Tensor, sw: torch.Tensor,
                   bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                   config: Optional[GemmConfig] = None) -> torch.Tensor:
    """x [M, K] @ wq [N, K].T with group scales -> [M, N] in ``out_dtype`` (+ bias); see the module
    docstring. ``sx`` None: x is in the model dtype and gets quantized per token group (inside the
    kernel or by ``per_token_group_quant_fp8``, as the config says); else x is e4m3 with scales
    sx [M, G]. ``sw`` [N, G] fp32, G = ceil(K / 128). Graph-capturable (no host sync)."""
    M, K = x.shape
    N = wq.shape[0]
    G = triton.cdiv(K, GROUP)
    cfg = config or pick_config(M)
    if sx is None and not cfg.quant_x:
        x, sx = per_token_group_quant_fp8(x)
    quant_x = sx is None
    if cfg.split_k > 1:
        y = torch.zeros((M, N), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return y.to(out_dtype)
    bm = max(cfg.block_m, 16) if cfg.use_dot else max(1, triton.next_power_of_2(min(cfg.block_m, M)))
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, cfg.block_n), cfg.split_k)
    _fp8_group_gemm_kernel[grid](
        x, sx if sx is not None else sw, wq, sw, bias if bias is not None else sw, y, M, N, K, G,
        x.stride(0), sx.stride(0) if sx is not None else 0, wq.stride(0), sw.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, QUANT_X=quant_x, USE_DOT=cfg.use_dot, SPLIT_K=cfg.split_k,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, GROUP_K=GROUP, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y if cfg.split_k == 1 else y.to(out_dtype)
