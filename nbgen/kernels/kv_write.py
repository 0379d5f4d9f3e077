"""One Triton kernel that writes a step's new K and V rows into their paged-cache slots.

Replaces two ``index_copy_`` launches per layer (one for K, one for V). The paged cache is HND:
cache [num_pages, Hkv, page_size, D], each head's tokens of a page contiguous (the layout the decode
kernels read fastest). Slots are flat token slots ``page * page_size + offset`` (the backend's slot
mapping).

An fp8 cache (``kv_cache_dtype="fp8_e4m3"``) is written as e4m3: each value divided by the layer's
K (or V) scale in fp32 (correctly rounded division), clamped to +-448 and rounded to nearest even,
which is ``attention/kv_quant.store`` bit for bit.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

FP8_MAX = 448.0      # the largest finite e4m3 value; stores saturate there


class KVTarget(NamedTuple):
    """Where a fused kernel writes a layer's new K/V: HND page caches, slots [T] long, and the
    per-tensor scales the values are divided by when the caches are fp8 (ignored otherwise)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton never reach this module's kernel
    triton = None

if triton is not None:
    @triton.jit
    def head_row(slot, h, HD: tl.constexpr, D: tl.constexpr, P: tl.constexpr):
        """Offset of kv head ``h``'s D-element row for token ``slot`` in an HND paged cache
        [pages, Hkv, P, D] (HD = Hkv * D; also used by the fused RoPE kernel)."""
        return (slot // P) * (HD * P) + h * (P * D) + (slot % P) * D

    @triton.jit
    def div_rcp(x, s, r):
        """x / s as ``tl.div_rn`` rounds it, from r = tl.div_rn(1.0, s) (one division for a shared divisor
        instead of one a value): q = x * r, then one correction by the exact residual (Markstein's
        theorem: r correctly rounded, q within an ulp). The residual is negated so that -0 keeps its sign.
        Exact for |x| >= 2^-100 (the residual does not underflow) and a quotient in fp32's normal range;
        a smaller x over any scale above 2^-90, or a smaller quotient, is 0 as e4m3 either way (the e4m3
        stores are its only users)."""
        q = x * r
        # e = -(x - s * q), exact; negations as products by -1 (Triton's -x is 0 - x, which loses -0's sign)
        e = tl.fma(s, q, x * -1.0)
        return tl.fma(e * -1.0, r, q)

    @triton.jit
    def to_e4m3(v, s):
        # fp32 values v over their scale s (a row's or a tensor's, shared by many v: one division for all,
        # div_rcp), clamped to the e4m3 range and rounded to nearest even e4m3
        return tl.clamp(div_rcp(v, s, tl.div_rn(1.0, s)), -448.0, 448.0).to(tl.float8e4nv)

    @triton.jit
    def to_cache(x, scale, FP8: tl.constexpr, dt: tl.constexpr):
        """Values as the cache's element type ``dt``: an fp8 (e4m3) cache stores x / scale (fp32, correctly
        rounded) clamped to +-448 and rounded to nearest even (``kv_quant.store``, ``to_e4m3``); else a
        plain cast."""
        if FP8:
            return to_e4m3(x.to(tl.float32), scale)
        return x.to(dt)

    @triton.jit
    def finish_v(v, vptr, vm, s, vc_ptr, slot, hv, dd, v_scale, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                 FP8: tl.constexpr, ROW_SCALE: tl.constexpr, WRITE_KV: tl.constexpr):
        # one token's v heads [H, D] (loaded from ``vptr`` under ``vm``), as the fused RoPE kernels finish them:
        # scaled by a folded norm's row factor s and rounded to the model dtype (ROW_SCALE), stored back into
        # qkv where attention reads it from there, and written into the paged cache (WRITE_KV; heads ``hv``)
        if ROW_SCALE:
            v = (v.to(tl.float32) * s).to(vptr.dtype.element_ty, fp_downcast_rounding="rtne")
            if not WRITE_KV:   # attention reads v from qkv only when it is not in the cache
                tl.store(vptr, v, mask=vm)
        if WRITE_KV:
            tl.store(vc_ptr + head_row(slot, hv, HKV * D, D, P)[:, None] + dd[None, :],
                     to_cache(v, v_scale, FP8, vc_ptr.dtype.element_ty), mask=vm)

    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_row, v_row, k_scale, v_scale,
                         HD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
                         FP8: tl.constexpr):
        t = tl.program_id(0)                               # one program per new token
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < HD
        dst = head_row(slot, offs // D, HD, D, P) + offs % D
        row = t.to(tl.int64)
        k = tl.load(k_ptr + row * k_row + offs, mask=mask)
        v = tl.load(v_ptr + row * v_row + offs, mask=mask)
        tl.store(kc_ptr + dst, to_cache(k, k_scale, FP8, kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, to_cache(v, v_scale, FP8, vc_ptr.dtype.element_ty), mask=mask)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """The cache stores e4m3 (writes quantize with a scale)."""
    return cache.dtype == torch.float8_e4m3fn


def quantize_torch(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' store in torch: x / scale clamped and rounded to e4m3 for an fp8 ``dtype``, else a cast."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, Hkv*D] (rows may be strided, each row contiguous); HND caches; slots [T] long;
    ``k_scale`` / ``v_scale``: an fp8 cache's per-tensor scales."""
    T = k.shape[0]
    if T == 0:
        return
    _, H, P, D = k_cache.shape
    if triton is None:    # a CUDA install without triton: the same write in torch
        page, off = slots // P, slots % P
        kc, vc = (c.view(torch.uint8) if is_fp8_cache(c) else c for c in (k_cache, v_cache))
        kq = quantize_torch(k.reshape(T, H, D), k_scale, k_cache.dtype)
        vq = quantize_torch(v.reshape(T, H, D), v_scale, v_cache.dtype)
        kc[page, :, off] = kq.view(kc.dtype)      # fp8 rows through byte views (no fp8 index_put on every build)
        vc[page, :, off] = vq.view(vc.dtype)
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    HD = H * D
    _kv_write_kernel[(T,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), float(k_scale), float(v_scale),
                           HD=HD, D=D, P=P, BLOCK=triton.next_power_of_2(HD), FP8=is_fp8_cache(k_cache),
                           num_warps=4 if HD >= 512 else 2)
