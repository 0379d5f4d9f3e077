"""Batch-1 decode's qkv projection, RoPE and K/V write as one Triton kernel (Llama, Mistral, Qwen2: no q/k
norm).

At one row the qkv GEMV and ``qk_norm_rope``'s kernel are two launches of mostly fixed cost (a ramp and a
drain each, ~32 layers a token). Rotate-half RoPE pairs element j of a head with element j + D/2, so here a
program owns BLOCK_N output rows {r} and {r + D/2} of one head (two accumulations of ``small_gemm``'s
one-row GEMV, as its SiLU variant owns gate and up rows) and does the rest of the chain in its epilogue:
(a folded input norm's row factor,) RoPE of q and k heads, q (and k, v) stored into the qkv row, k and v
written into their paged-cache slot (HND pages; e4m3 of value / scale for an fp8 cache).

Numerics are the two-kernel path's bit for bit: each row's fp32 sum in small_gemm's order and layout (its
config for this shape, its one-row helper) plus bias, rounded to the model dtype as qkv stores it; then
``qk_norm_rope``'s steps (its row factor helper; ``rnd(a * s)``; cos/sin rounded, each product rounded).
The row factor's sum of squares is reduced in the same order where both kernels run 8 warps (K <= 4096:
small_gemm's one-row config); above, 4 warps reduce it in another order (the last fp32 bit may differ).
The kernel is compiled without FMA contraction like that kernel (so no product is fused across a
rounding); the GEMV's FMAs are explicit in ``small_gemm.one_row``, so they stay FMAs.
"""
from __future__ import annotations

from typing import Optional

import torch

from nbgen.kernels import pdl, small_gemm
from nbgen.kernels.kv_write import KVTarget, is_fp8_cache
from nbgen.kernels.qk_norm_rope import supports_head_dim

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

if triton is not None:
    from nbgen.kernels.kv_write import head_row, to_cache
    from nbgen.kernels.qk_norm_rope import rnd, row_rms_scale
    from nbgen.kernels.small_gemm import one_row, row_tile

    @triton.jit
    def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, y_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, K, swn, eps,
                         k_scale, v_scale, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                         HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, HID: tl.constexpr, HBLK: tl.constexpr,
                         FP8: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        HALF: tl.constexpr = D // 2
        PPH: tl.constexpr = HALF // BLOCK_N                      # programs a head
        pid = tl.program_id(0)
        head = pid // PPH                                        # q heads, then k heads, then v heads
        j = (pid % PPH) * BLOCK_N + tl.arange(0, BLOCK_N)       # [BN] offsets in the head's first half
        ra = head * D + j                                        # output rows j and j + D/2
        rb = ra + HALF
        n_mask = j < HALF                                        # (all true: whole heads)
        a_rows = w_ptr + ra.to(tl.int64)[:, None] * swn
        b_rows = w_ptr + rb.to(tl.int64)[:, None] * swn
        dt = y_ptr.dtype.element_ty
        # what the kernel before does not write: positions, cos/sin, slot, bias, the first weight tiles
        pos = tl.load(pos_ptr).to(tl.int64)
        cos = rnd(tl.load(cs_ptr + pos * D + j), dt)
        sin = rnd(tl.load(cs_ptr + pos * D + HALF + j), dt)
        slot = tl.load(slot_ptr).to(tl.int64)
        if HAS_BIAS:
            bias_a = tl.load(b_ptr + ra).to(tl.float32)
            bias_b = tl.load(b_ptr + rb).to(tl.float32)
        wa0, _kk, _km = row_tile(a_rows, 0, K, n_mask, BLOCK_K)
        wb0, _kk, _km = row_tile(b_rows, 0, K, n_mask, BLOCK_K)
        if USE_PDL:   # launched early (programmatic dependent launch): wait for x to be written
            pdl.gdc_wait()
        ya, _ss = one_row(x_ptr, a_rows, wa0, K, n_mask, BLOCK_K, False)
        yb, _ss = one_row(x_ptr, b_rows, wb0, K, n_mask, BLOCK_K, False)
        if USE_PDL:   # the next kernel may start launching (it waits for our writes itself)
            pdl.gdc_launch_dependents()
        ya = tl.reshape(ya, (BLOCK_N,))
        yb = tl.reshape(yb, (BLOCK_N,))
        if HAS_BIAS:
            ya += bias_a
            yb += bias_b
        a = rnd(ya, dt)                                          # the projection as qkv stores it
        b = rnd(yb, dt)
        if ROW_SCALE:   # folded input norm: q|k|v = the normed stream's projection, rounded
            s = row_rms_scale(x_ptr, HID, eps, HBLK)
            a = rnd(a * s, dt)
            b = rnd(b * s, dt)
        # x * cos + rotate_half(x) * sin, each product rounded to the model dtype as in HF; v heads as they are
        is_v = head >= HQ + HKV
        oa = tl.where(is_v, a, rnd(a * cos, dt) - rnd(b * sin, dt)).to(dt, fp_downcast_rounding="rtne")
        ob = tl.where(is_v, b, rnd(b * cos, dt) + rnd(a * sin, dt)).to(dt, fp_downcast_rounding="rtne")
        tl.store(y_ptr + ra, oa)
        tl.store(y_ptr + rb, ob)
        is_k = (head >= HQ) & (head < HQ + HKV)
        kvh = tl.where(is_v, head - HQ - HKV, tl.maximum(head - HQ, 0))
        dst = head_row(slot, kvh, HKV * D, D, P) + j             # this head's row of the token's slot
        kt = kc_ptr.dtype.element_ty
        vt = vc_ptr.dtype.element_ty
        tl.store(kc_ptr + dst, to_cache(oa, k_scale, FP8, kt), mask=n_mask & is_k)
        tl.store(kc_ptr + dst + HALF, to_cache(ob, k_scale, FP8, kt), mask=n_mask & is_k)
        tl.store(vc_ptr + dst, to_cache(oa, v_scale, FP8, vt), mask=n_mask & is_v)
        tl.store(vc_ptr + dst + HALF, to_cache(ob, v_scale, FP8, vt), mask=n_mask & is_v)


def usable(x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
    """The fused kernel takes this projection: one row that small_gemm would stream, whole heads of a
    power-of-2 size whose halves split into small_gemm's row blocks."""
    if x.shape[0] != 1 or not small_gemm.usable(x, weight) or not supports_head_dim(head_dim):
        return False
    bn = small_gemm.pick_config(1, weight.shape[0], x.shape[1])[0]
    return weight.shape[0] % head_dim == 0 and (head_dim // 2) % bn == 0


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], positions: torch.Tensor,
             cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, kv: KVTarget,
             row_scale_eps: Optional[float] = None) -> torch.Tensor:
    """x [1, K] @ weight[(Hq + 2 Hkv) * D, K].T (+ bias) -> qkv [1, (Hq + 2 Hkv) * D] with q and k rotated
    (RoPE at positions [1], cos_sin_cache [max_pos, D] fp32 cos | sin), and k, v written into ``kv``'s caches
    at its slot (the same values qkv holds). ``row_scale_eps``: x is the raw residual stream and the input
    norm's weight is in ``weight``: q, k and v are first scaled by rsqrt(mean(x^2) + eps)."""
    K = x.shape[1]
    N = weight.shape[0]
    assert N == (num_q_heads + 2 * num_kv_heads) * head_dim, "weight rows are the q, k and v heads"
    kc, vc, slots, ks, vs = KVTarget(*kv)
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = small_gemm.pick_config(1, N, K)     # small_gemm's tiles: its summation order
    hid = K if row_scale_eps is not None else 1
    args = (x, weight, bias if bias is not None else weight, y, positions, cos_sin_cache, kc, vc, slots, K,
            weight.stride(0), 0.0 if row_scale_eps is None else float(row_scale_eps), float(ks), float(vs))
    pdl.launch(_qkv_rope_kernel, (N // (2 * bn),), args, x.device, HQ=num_q_heads, HKV=num_kv_heads, D=head_dim,
               P=kc.shape[2], HAS_BIAS=bias is not None, ROW_SCALE=row_scale_eps is not None, HID=hid,
               HBLK=min(1024, triton.next_power_of_2(hid)), FP8=is_fp8_cache(kc), BLOCK_N=bn, BLOCK_K=bk,
               num_warps=warps, num_stages=stages,
               enable_fp_fusion=False)    # no FMA contraction: each product rounds as in torch
    return y
