"""One Triton kernel that writes a step's new K and V rows into their paged-cache slots.

Replaces two ``index_copy_`` launches per layer (one for K, one for V). The paged cache is HND:
cache [num_pages, Hkv, page_size, D], each head's tokens of a page contiguous (the layout the decode
kernels read fastest). Slots are flat token slots ``page * page_size + offset`` (the backend's slot
mapping).
"""
from __future__ import annotations

import torch

# (k_cache, v_cache, slots [T] long): where a fused kernel writes a layer's new K/V (HND pages)
KVTarget = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

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
    def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_row, v_row,
                         HD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)                               # one program per new token
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < HD
        dst = head_row(slot, offs // D, HD, D, P) + offs % D
        row = t.to(tl.int64)
        k = tl.load(k_ptr + row * k_row + offs, mask=mask)
        v = tl.load(v_ptr + row * v_row + offs, mask=mask)
        tl.store(kc_ptr + dst, k, mask=mask)
        tl.store(vc_ptr + dst, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v: [T, Hkv*D] (rows may be strided, each row contiguous); HND caches; slots [T] long."""
    T = k.shape[0]
    if T == 0:
        return
    _, H, P, D = k_cache.shape
    if triton is None:    # a CUDA install without triton: the same write in torch
        page, off = slots // P, slots % P
        k_cache[page, :, off] = k.reshape(T, H, D)
        v_cache[page, :, off] = v.reshape(T, H, D)
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    HD = H * D
    _kv_write_kernel[(T,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0),
                           HD=HD, D=D, P=P, BLOCK=triton.next_power_of_2(HD),
                           num_warps=4 if HD >= 512 else 2)
