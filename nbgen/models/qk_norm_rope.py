"""Qwen3's per-head q/k RMSNorm and RoPE in one Triton kernel, in place on the qkv projection.

Unfused, a Qwen3 layer spends three launches here (flashinfer q-norm, k-norm, RoPE) plus a copy of
q and k out of the strided qkv rows. At decode batch sizes each launch is a few microseconds of
mostly fixed cost, ~28 layers x 3 per step. One program per (token, head) does the whole chain in
registers, following HF's rounding steps: normalise in fp32, round, scale by the weight, round (as
Qwen3RMSNorm); then rotate_half RoPE with cos/sin rounded to the model dtype and each product and
the sum rounded (as HF's apply_rotary_pos_emb in bf16/fp16). On an H100 the result equals torch's
evaluation of HF's formulas bit for bit in ~82 % of elements and within two bf16 ulp elsewhere
(tests/test_gpu.py); the flashinfer kernels it replaces round once per op and are further off.
q and k stay views of qkv.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the unfused path
    triton = None

if triton is not None:
    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cs_ptr, row_stride, eps,
                             HQ: tl.constexpr, D: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)                                   # q heads 0..HQ-1, then k heads
        HALF: tl.constexpr = D // 2
        offs = tl.arange(0, HALF)
        base = qkv_ptr + t.to(tl.int64) * row_stride + h * D
        a = tl.load(base + offs)
        b = tl.load(base + HALF + offs)
        dt = a.dtype
        a32, b32 = a.to(tl.float32), b.to(tl.float32)
        r = tl.math.rsqrt((tl.sum(a32 * a32, 0) + tl.sum(b32 * b32, 0)) / D + eps)
        if h < HQ:
            wa, wb = tl.load(qw_ptr + offs), tl.load(qw_ptr + HALF + offs)
        else:
            wa, wb = tl.load(kw_ptr + offs), tl.load(kw_ptr + HALF + offs)
        # Qwen3RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), in the model dtype
        na = (wa.to(tl.float32) * (a32 * r).to(dt, fp_downcast_rounding="rtne").to(tl.float32))
        nb = (wb.to(tl.float32) * (b32 * r).to(dt, fp_downcast_rounding="rtne").to(tl.float32))
        na = na.to(dt, fp_downcast_rounding="rtne").to(tl.float32)
        nb = nb.to(dt, fp_downcast_rounding="rtne").to(tl.float32)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cs_ptr + pos * D + offs).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
        sin = tl.load(cs_ptr + pos * D + HALF + offs).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded to the model dtype as in HF
        oa = ((na * cos).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
              - (nb * sin).to(dt, fp_downcast_rounding="rtne").to(tl.float32))
        ob = ((nb * cos).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
              + (na * sin).to(dt, fp_downcast_rounding="rtne").to(tl.float32))
        tl.store(base + offs, oa.to(dt, fp_downcast_rounding="rtne"))
        tl.store(base + HALF + offs, ob.to(dt, fp_downcast_rounding="rtne"))


def supported(qkv: torch.Tensor, head_dim: int) -> bool:
    """The kernel serves this tensor: CUDA, half precision, rows contiguous, head_dim a power of 2."""
    return (triton is not None and qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16)
            and qkv.stride(-1) == 1 and head_dim >= 32 and head_dim & (head_dim - 1) == 0)


def qk_norm_rope_(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                  head_dim: int) -> None:
    """In place on qkv [T, (Hq + 2 Hkv) * D]: RMSNorm + RoPE of the q and k heads (v untouched).

    positions [T] (any int dtype); weights [D]; cos_sin_cache [max_pos, D] fp32 (cos | sin halves).
    """
    T = qkv.shape[0]
    if T == 0:
        return
    _qk_norm_rope_kernel[(T, num_q_heads + num_kv_heads)](
        qkv, positions, q_weight, k_weight, cos_sin_cache, qkv.stride(0), eps,
        HQ=num_q_heads, D=head_dim, num_warps=1 if head_dim <= 128 else 2)
