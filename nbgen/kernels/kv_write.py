"""One Triton kernel that writes a step's new K and V rows into their paged-cache slots.

Replaces two ``index_copy_`` launches per layer (one for K, one for V) and handles both flashinfer KV
layouts, so the flashinfer backend can pick the layout its decode kernel reads fastest:
  NHD: cache [num_pages, page_size, Hkv, D]  -> a token's heads are one contiguous row;
  HND: cache [num_pages, Hkv, page_size, D]  -> each head's tokens of a page are contiguous.
Slots are flat token slots ``page * page_size + offset`` (the backend's slot mapping).
"""
from __future__ import annotations

import torch

# (k_cache, v_cache, slots [T] long, layout): where a fused kernel writes a layer's new K/V
KVTarget = tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton never reach this module's kernel
    triton = None

if triton is not None:
    @triton.jit
    def head_row(slot, h, HD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, HND: tl.constexpr):
        """Offset of kv head ``h``'s D-element row for token ``slot`` in a paged cache (also used by
        the fused RoPE kernel): HND [pages, Hkv, P, D] or NHD [pages, P, Hkv, D] (HD = Hkv * D)."""
        if HND:
            return (slot // P) * (HD * P) + h * (P * D) + (slot % P) * D
        return slot * HD + h * D

    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_row, v_row,
                         HD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, HND: tl.constexpr,
                         BLOCK: tl.constexpr):
        t = tl.program_id(0)                               # one program per new token
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < HD
        dst = head_row(slot, offs // D, HD, D, P, HND) + offs % D
        row = t.to(tl.int64)
        k = tl.load(k_ptr + row * k_row + offs, mask=mask)
        v = tl.load(v_ptr + row * v_row + offs, mask=mask)
        tl.store(kc_ptr + dst, k, mask=mask)
        tl.store(vc_ptr + dst, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, layout: str) -> None:
    """k, v: [T, Hkv*D] (rows may be strided, each row contiguous); caches in ``layout``; slots [T] long."""
    T = k.shape[0]
    if T == 0:
        return
    if triton is None:    # a CUDA install without triton: the two-op torch write
        write_kv_reference(k, v, k_cache, v_cache, slots, layout)
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if layout == "HND":
        _, H, P, D = k_cache.shape
    else:
        _, P, H, D = k_cache.shape
    HD = H * D
    _kv_write_kernel[(T,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0),
                           HD=HD, D=D, P=P, HND=layout == "HND", BLOCK=triton.next_power_of_2(HD),
                           num_warps=4 if HD >= 512 else 2)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, layout: str) -> None:
    """The same write in plain torch (tests; any device)."""
    T = k.shape[0]
    if layout == "HND":
        _, H, P, D = k_cache.shape
        page, off = slots // P, slots % P
        k_cache[page, :, off] = k.reshape(T, H, D)
        v_cache[page, :, off] = v.reshape(T, H, D)
    else:
        _, P, H, D = k_cache.shape
        k_cache.view(-1, H, D).index_copy_(0, slots, k.reshape(T, H, D))
        v_cache.view(-1, H, D).index_copy_(0, slots, v.reshape(T, H, D))
