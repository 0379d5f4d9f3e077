"""RoPE of q and k in one Triton kernel, in place on the qkv projection: with Qwen3's per-head q/k
RMSNorm first, and with the step's K and V written into their paged-cache slots.

Unfused, a layer spends up to four launches here (Qwen3's q-norm and k-norm, RoPE, the K/V write)
plus a copy of q and k out of the strided qkv rows. At decode batch sizes each launch is a few
microseconds of mostly fixed cost, ~32 layers x 2-4 per step. One program per token does the chain
for all its q and k heads in registers (a program per (token, head) was 4x slower at 256 tokens: 6k
one-warp programs in two waves, each waiting on its own chain of loads), following HF's rounding
steps: normalise in fp32, round, scale by the weight, round (as Qwen3RMSNorm); then rotate_half RoPE
with cos/sin rounded to the model dtype and each product and the sum rounded (as HF's
apply_rotary_pos_emb in bf16/fp16). The kernel is compiled without FMA contraction, so each product
is rounded where torch rounds it: without the norm the result equals torch's evaluation of HF's
formulas bit for bit on an H100 (with contraction, 82 % of elements did). It also stores the rotated
k heads and the v heads into the cache (HND pages, flat slots ``page * page_size + offset`` as the
attention backends use). q and k stay views of qkv. Launched with PDL (kernels/pdl).

With a folded input norm (``nbgen.models.norm_fold``) qkv is the raw residual stream's projection: the
kernel then first scales q, k and v by the token's rsqrt(mean(h^2) + eps), read from ``h``, rounds
them to the model dtype (as the projection of the normed stream is rounded), and stores v back when
it does not write it into the cache.

Layers without the per-head norm launch ``kernels.qk_rope``'s kernel instead (the same values: q and k as
separate tiles, v loaded before the stores, optional head groups); this module's kernel is the norm form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nbgen.kernels.kv_write import KVTarget, is_fp8_cache
from nbgen.kernels import pdl, qk_rope

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the unfused path
    triton = None

if triton is not None:
    from nbgen.kernels.kv_write import finish_v, head_row, to_cache
    from nbgen.kernels.qk_rope import slot_and_row_scale
    from nbgen.kernels.triton_norm import rnd

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cs_ptr, row_stride, eps, kc_ptr, vc_ptr, slot_ptr,
                             h_ptr, h_stride, h_eps, k_scale, v_scale,
                             HQ: tl.constexpr, HKV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr,
                             D: tl.constexpr, P: tl.constexpr, NORM: tl.constexpr, WRITE_KV: tl.constexpr,
                             FP8: tl.constexpr, ROW_SCALE: tl.constexpr, HID: tl.constexpr, HBLK: tl.constexpr,
                             USE_PDL: tl.constexpr):
        # one program per token, all its q and k heads as one [HP, D/2] tile (HP: HQ + HKV rounded up to a
        # power of 2): a decode step is then one wave of programs, each with one chain of dependent loads
        t = tl.program_id(0)
        HALF: tl.constexpr = D // 2
        offs = tl.arange(0, HALF)
        h = tl.arange(0, HP)                                   # q heads 0..HQ-1, then k heads
        hm = (h < HQ + HKV)[:, None]
        dt = qkv_ptr.dtype.element_ty
        # inputs that the previous kernel does not write: read before waiting for it
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = rnd(tl.load(cs_ptr + pos * D + offs), dt)[None, :]
        sin = rnd(tl.load(cs_ptr + pos * D + HALF + offs), dt)[None, :]
        if NORM:
            isq = (h < HQ)[:, None]
            wa = tl.where(isq, tl.load(qw_ptr + offs)[None, :], tl.load(kw_ptr + offs)[None, :]).to(tl.float32)
            wb = tl.where(isq, tl.load(qw_ptr + HALF + offs)[None, :],
                          tl.load(kw_ptr + HALF + offs)[None, :]).to(tl.float32)
        slot, s = slot_and_row_scale(slot_ptr, t, h_ptr, h_stride, h_eps, HID, HBLK, WRITE_KV, ROW_SCALE)
        if USE_PDL:
            pdl.gdc_wait()                                     # qkv is the previous kernel's output
            pdl.gdc_launch_dependents()
        row = qkv_ptr + t.to(tl.int64) * row_stride
        ptr = row + h[:, None] * D + offs[None, :]             # [HP, HALF]: first halves of the heads
        a = tl.load(ptr, mask=hm, other=0.0).to(tl.float32)
        b = tl.load(ptr + HALF, mask=hm, other=0.0).to(tl.float32)
        if ROW_SCALE:   # folded input norm: q|k|v = the normed stream's projection, rounded
            a = rnd(a * s, dt)
            b = rnd(b * s, dt)
        if NORM:
            r = tl.math.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)[:, None]
            # Qwen3RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), in the model dtype
            a = rnd(wa * rnd(a * r, dt), dt)
            b = rnd(wb * rnd(b * r, dt), dt)
        # x * cos + rotate_half(x) * sin, each product rounded to the model dtype as in HF
        oa = (rnd(a * cos, dt) - rnd(b * sin, dt)).to(dt, fp_downcast_rounding="rtne")
        ob = (rnd(b * cos, dt) + rnd(a * sin, dt)).to(dt, fp_downcast_rounding="rtne")
        tl.store(ptr, oa, mask=hm)
        tl.store(ptr + HALF, ob, mask=hm)
        if WRITE_KV:
            isk = hm & (h >= HQ)[:, None]                      # rotated k heads into the cache
            dst = head_row(slot, h - HQ, HKV * D, D, P)[:, None] + offs[None, :]
            kt = kc_ptr.dtype.element_ty                      # an fp8 cache: e4m3 of k / k_scale
            tl.store(kc_ptr + dst, to_cache(oa, k_scale, FP8, kt), mask=isk)
            tl.store(kc_ptr + dst + HALF, to_cache(ob, k_scale, FP8, kt), mask=isk)
        if WRITE_KV or ROW_SCALE:
            hv = tl.arange(0, HVP)                             # v heads: copied (scaled when folded)
            dd = tl.arange(0, D)
            vm = (hv < HKV)[:, None]
            vptr = row + (HQ + HKV + hv)[:, None] * D + dd[None, :]
            v = tl.load(vptr, mask=vm)
            finish_v(v, vptr, vm, s, vc_ptr, slot, hv, dd, v_scale, HKV, D, P, FP8, ROW_SCALE, WRITE_KV)


def supports_head_dim(head_dim: int) -> bool:
    """Head sizes the kernel's [heads, D/2] tiles take: powers of 2 from 32."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def supported(qkv: torch.Tensor, head_dim: int) -> bool:
    """The kernel serves this tensor: CUDA, half precision, rows contiguous, head_dim a power of 2."""
    return (triton is not None and qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16)
            and qkv.stride(-1) == 1 and supports_head_dim(head_dim))


def available(head_dim: int) -> bool:
    """Triton is installed and the kernel takes this head size (the fold policy's capability check)."""
    return triton is not None and supports_head_dim(head_dim)


def qk_norm_rope_(qkv: torch.Tensor, positions: torch.Tensor, q_weight: Optional[torch.Tensor],
                  k_weight: Optional[torch.Tensor], eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int,
                  num_kv_heads: int, head_dim: int, kv: Optional[KVTarget] = None,
                  row_scale: Optional[tuple[torch.Tensor, float]] = None, launch: Optional[RopeLaunch] = None) -> None:
    """In place on qkv [T, (Hq + 2 Hkv) * D]: (RMSNorm +) RoPE of the q and k heads (v untouched unless
    ``row_scale``).

    positions [T] (any int dtype); q/k weights [D] or None (no norm, Llama / Qwen2); cos_sin_cache
    [max_pos, D] fp32 (cos | sin halves); ``kv`` = (k_cache, v_cache, slots [T] long; HND pages
    [pages, Hkv, P, D]; fp8 caches store e4m3 of k / k_scale and v / v_scale, as ``kv_write``): also
    write the rotated k and v of every token into its slot. ``row_scale`` = (h [T, hidden],
    eps): qkv was projected from the un-normed stream h (norm weight folded into the projection), so
    q, k and v are first scaled by each row's rsqrt(mean(h^2) + eps) (v in place too unless ``kv`` is
    given: attention then reads it from the cache). ``launch``: the sweep bench's explicit launch, else
    ``rope_launch``'s by shape.
    """
    T = qkv.shape[0]
    if T == 0:
        return
    norm = q_weight is not None
    if kv is not None:
        kc, vc, slots, ks, vs = KVTarget(*kv)       # a plain (k_cache, v_cache, slots) tuple: scales 1.0
        P = kc.shape[2]
    else:
        kc = vc = slots = qkv
        P, ks, vs = 1, 1.0, 1.0
    h, h_eps = row_scale if row_scale is not None else (qkv, 0.0)
    hid = h.shape[1] if row_scale is not None else 1
    lc = launch or rope_launch(T, num_q_heads, num_kv_heads, row_scale is not None)
    if norm and lc.groups != 1:
        raise ValueError(f"launch.groups must be 1 for the per-head norm form, got {lc.groups}")
    if num_kv_heads % lc.groups or num_q_heads % lc.groups:
        raise ValueError(f"launch.groups must divide the q and kv head counts ({num_q_heads}, {num_kv_heads}), "
                         f"got {lc.groups}")
    kw = dict(WRITE_KV=kv is not None, FP8=kv is not None and is_fp8_cache(kc), ROW_SCALE=row_scale is not None,
              HID=hid, HBLK=min(1024, triton.next_power_of_2(hid)), num_warps=lc.num_warps,
              enable_fp_fusion=False)    # no FMA contraction: each product rounds as in torch
    if norm:
        pdl.launch(_qk_norm_rope_kernel, (T,),
                   (qkv, positions, q_weight, k_weight, cos_sin_cache, qkv.stride(0), eps, kc, vc, slots, h,
                    h.stride(0), h_eps, float(ks), float(vs)), qkv.device,
                   HQ=num_q_heads, HKV=num_kv_heads, HP=triton.next_power_of_2(num_q_heads + num_kv_heads),
                   HVP=triton.next_power_of_2(num_kv_heads), D=head_dim, P=P, NORM=True, **kw)
        return
    qk_rope.launch((qkv, positions, cos_sin_cache, qkv.stride(0), kc, vc, slots, h, h.stride(0), h_eps, float(ks),
                    float(vs)), num_q_heads, num_kv_heads, head_dim, P, lc.groups, kw)


@dataclass(frozen=True)
class RopeLaunch:
    """How ``qk_norm_rope_`` launches: ``groups`` programs a token (each a 1/groups share of the q and kv
    heads, each computing the row scale itself; 1 for the per-head norm form), ``num_warps`` a program."""

    groups: int
    num_warps: int


def rope_launch(T: int, num_q_heads: int, num_kv_heads: int, row_scale: bool) -> RopeLaunch:
    """The launch by shape: one program a token (a decode step is one wave; the fewest instructions a token:
    Llama-3.1-8B with the e4m3 K/V write, Triton 3.6 for sm_90a, 512 a thread of 8 warps against 2 x 424
    in 2 groups); with a row scale 8 warps (its reduction over the stream measured faster: Qwen3-0.6B, bs
    32 / 128 / 256: 2.42 / 1.60 / 2.80 against 2.73 / 2.60 / 2.89 us a launch with 4), else 4."""
    return RopeLaunch(1, 8 if row_scale else 4)
