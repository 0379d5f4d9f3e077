"""Batch-1 decode's qkv projection with e4m3 weights, RoPE and the K/V write as one Triton kernel (Llama,
Mistral, Qwen2: no q/k norm).

At one row the fp8 qkv GEMV and ``qk_norm_rope``'s kernel are two launches of mostly fixed cost (a ramp and
a drain each, 32 layers a token). Rotate-half RoPE pairs element j of a head with element j + D/2, so a
program here owns rows j and j + D/2 of one head side by side (as ``fp8_row_gemv``'s SiLU variant pairs gate
and up rows), computes their products with that kernel's helpers and tiles, and does the rest of the chain
in its epilogue: (a folded input norm's row factor,) RoPE of q and k heads, q, k and v stored into the qkv
row, k and v written into their paged-cache slot (HND pages; e4m3 of value / scale for an fp8 cache).

Numerics are the two-kernel path's bit for bit: each row's fp32 sum in fp8_row_gemv's order (its helper,
its config, its contraction setting) scaled (+ bias) and rounded to the model dtype as qkv stores it; then
``qk_norm_rope``'s steps (its row factor's tiles, reduced over 8 warps like its row-scale launch; ``rnd(a *
s)``; cos/sin rounded, each product rounded). The epilogue's products are explicit ``mul.rn`` instructions,
which are never contracted into an FMA, so they round as in that kernel (compiled without contraction).
(A bf16-weight form of this kernel measured no faster than small_gemm + ``qk_norm_rope`` in
``nbgen.bench.decode_layers``, so bf16 layers keep the two launches.)
"""
from __future__ import annotations

from typing import Optional

import torch

from nbgen.kernels import fp8_row_gemv, pdl
from nbgen.kernels.kv_write import KVTarget, is_fp8_cache
from nbgen.kernels.qk_norm_rope import supports_head_dim

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

if triton is not None:
    from nbgen.kernels.fp8_row_gemv import load_early, scaled_products
    from nbgen.kernels.kv_write import head_row, to_cache
    from nbgen.kernels.triton_norm import mul_rn, rnd, row_rms_scale

    @triton.jit
    def _rope_store(ya, yb, head, j, cos, sin, slot, x_ptr, y_ptr, kc_ptr, vc_ptr, eps, k_scale, v_scale,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, ROW_SCALE: tl.constexpr,
                    HID: tl.constexpr, HBLK: tl.constexpr, FP8: tl.constexpr):
        # ya, yb: fp32 projections (+ bias) of rows j and j + D/2 of head ``head`` ([n] each; q heads, then k,
        # then v) -> the qkv row and, for k and v heads, the token's cache slot. Products by mul_rn: rounded
        # alone whether or not the kernel contracts (the model-dtype rounding after each is HF's)
        HALF: tl.constexpr = D // 2
        dt = y_ptr.dtype.element_ty
        a = rnd(ya, dt)                                          # the projection as qkv stores it
        b = rnd(yb, dt)
        if ROW_SCALE:   # folded input norm: q|k|v = the normed stream's projection, rounded
            s = row_rms_scale(x_ptr, HID, eps, HBLK, RN=True)
            a = rnd(mul_rn(a, s), dt)
            b = rnd(mul_rn(b, s), dt)
        # x * cos + rotate_half(x) * sin, each product rounded to the model dtype as in HF; v heads as they are
        is_v = head >= HQ + HKV
        ra = rnd(mul_rn(a, cos), dt) - rnd(mul_rn(b, sin), dt)
        rb = rnd(mul_rn(b, cos), dt) + rnd(mul_rn(a, sin), dt)
        oa = tl.where(is_v, a, ra).to(dt, fp_downcast_rounding="rtne")
        ob = tl.where(is_v, b, rb).to(dt, fp_downcast_rounding="rtne")
        row = head * D + j
        tl.store(y_ptr + row, oa)
        tl.store(y_ptr + row + HALF, ob)
        is_k = (head >= HQ) & (head < HQ + HKV)
        kvh = tl.where(is_v, head - HQ - HKV, tl.maximum(head - HQ, 0))
        dst = head_row(slot, kvh, HKV * D, D, P) + j             # this head's row of the token's slot
        kt = kc_ptr.dtype.element_ty
        vt = vc_ptr.dtype.element_ty
        tl.store(kc_ptr + dst, to_cache(oa, k_scale, FP8, kt), mask=is_k)
        tl.store(kc_ptr + dst + HALF, to_cache(ob, k_scale, FP8, kt), mask=is_k)
        tl.store(vc_ptr + dst, to_cache(oa, v_scale, FP8, vt), mask=is_v)
        tl.store(vc_ptr + dst + HALF, to_cache(ob, v_scale, FP8, vt), mask=is_v)

    @triton.jit
    def _qkv_rope_kernel(x_ptr, g_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, K, swn,
                         eps, k_scale, v_scale, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                         COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr,
                         HID: tl.constexpr, HBLK: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_ONCE: tl.constexpr, KP: tl.constexpr,
                         PRE: tl.constexpr):
        # fp8_row_gemv's products over BLOCK_N rows j, j + D/2, j + 1, j + 1 + D/2, ... of one head (as its SiLU
        # variant pairs gate and up rows)
        HALF: tl.constexpr = D // 2
        PAIRS: tl.constexpr = BLOCK_N // 2
        PPH: tl.constexpr = HALF // PAIRS                        # programs a head
        J: tl.constexpr = BLOCK_K // 16
        pid = tl.program_id(0)
        head = pid // PPH
        j0 = (pid % PPH) * PAIRS
        rr = tl.arange(0, BLOCK_N)
        w_row = head * D + j0 + rr // 2 + (rr % 2) * HALF
        n_mask = rr < BLOCK_N                                    # (all true: whole heads)
        col = tl.arange(0, J)[:, None] * 16 + tl.arange(0, 16)[None, :]          # [J, 16] columns of a tile
        w_rows = w_ptr + w_row.to(tl.int64)[None, :, None] * swn                  # [1, BLOCK_N, 1]
        row_mask = n_mask[None, :, None]
        j = j0 + tl.arange(0, PAIRS)
        dt = y_ptr.dtype.element_ty
        # what the kernel before does not write: positions, cos/sin, slot, scales, bias, the first PRE weight tiles
        pos = tl.load(pos_ptr).to(tl.int64)
        cos = rnd(tl.load(cs_ptr + pos * D + j), dt)
        sin = rnd(tl.load(cs_ptr + pos * D + HALF + j), dt)
        slot = tl.load(slot_ptr).to(tl.int64)
        w0, w1, w2, w3 = load_early(w_rows, row_mask, col, K, BLOCK_K, PRE)
        sw = tl.load(sw_ptr + w_row)
        if HAS_BIAS:
            bias = tl.load(b_ptr + w_row).to(tl.float32)
        y, _ss = scaled_products(x_ptr, sw_ptr, g_ptr, w0, w1, w2, w3, w_rows, row_mask, col, sw, K, False,
                                 COL_SCALE, False, BLOCK_K, X_ONCE, KP, PRE, USE_PDL)   # fp8_row_gemv's order
        if HAS_BIAS:
            y += bias
        ya, yb = tl.split(tl.reshape(y, (PAIRS, 2)))
        _rope_store(ya, yb, head, j, cos, sin, slot, x_ptr, y_ptr, kc_ptr, vc_ptr, eps, k_scale, v_scale,
                    HQ, HKV, D, P, ROW_SCALE, HID, HBLK, FP8)


def usable(x: torch.Tensor, wq: torch.Tensor, head_dim: int) -> bool:
    """The kernel takes this projection: one bf16 / fp16 row against an e4m3 weight (the caller checks that
    the one-row fp8 kernel serves it), whole heads of a power-of-2 size whose halves split into its row
    pairs."""
    if x.shape[0] != 1 or wq.dtype != torch.float8_e4m3fn or wq.stride(1) != 1 or x.stride(1) != 1:
        return False
    pairs = fp8_row_gemv.pick_config(*wq.shape)[0] // 2
    return supports_head_dim(head_dim) and wq.shape[0] % head_dim == 0 and (head_dim // 2) % pairs == 0


def qkv_rope(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
             col_scale: Optional[torch.Tensor], positions: torch.Tensor, cos_sin_cache: torch.Tensor,
             num_q_heads: int, num_kv_heads: int, head_dim: int, kv: KVTarget,
             row_scale_eps: Optional[float] = None, early_tiles: int = 1) -> torch.Tensor:
    """x [1, K] @ (wq [(Hq + 2 Hkv) * D, K] e4m3 * sw[n]).T (+ bias) as ``fp8_row_gemv`` computes it (x (*
    col_scale, a folded norm's weight) quantized per token; sw [1, N] fp32) -> qkv [1, (Hq + 2 Hkv) * D] with q
    and k rotated (RoPE at positions [1], cos_sin_cache [max_pos, D] fp32 cos | sin), and k, v written into
    ``kv``'s caches at its slot (the values qkv holds). ``row_scale_eps``: x is the raw residual stream
    (the input norm folded): q, k and v are first scaled by rsqrt(mean(x^2) + eps). ``early_tiles`` (1-4):
    weight tiles a program loads before its PDL wait (as ``fp8_row_gemv``'s; the same result bits)."""
    if not 1 <= early_tiles <= 4:
        raise ValueError(f"early_tiles must be 1-4, got {early_tiles}")
    K = x.shape[1]
    N = wq.shape[0]
    assert N == (num_q_heads + 2 * num_kv_heads) * head_dim, "weight rows are the q, k and v heads"
    kc, vc, slots, ks, vs = KVTarget(*kv)       # a plain (k_cache, v_cache, slots) tuple: scales 1.0
    hid = K if row_scale_eps is not None else 1
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, x_once = fp8_row_gemv.pick_config(N, K)      # fp8_row_gemv's tiles: its summation order
    args = (x, col_scale if col_scale is not None else sw, wq, sw, bias if bias is not None else sw, y, positions,
            cos_sin_cache, kc, vc, slots, K, wq.stride(0), 0.0 if row_scale_eps is None else float(row_scale_eps),
            float(ks), float(vs))
    pdl.launch(_qkv_rope_kernel, (N // bn,), args, x.device, HQ=num_q_heads, HKV=num_kv_heads, D=head_dim,
               P=kc.shape[2], COL_SCALE=col_scale is not None, HAS_BIAS=bias is not None,
               ROW_SCALE=row_scale_eps is not None, HID=hid, HBLK=min(1024, triton.next_power_of_2(hid)),
               FP8=is_fp8_cache(kc), BLOCK_N=bn, BLOCK_K=bk, X_ONCE=bool(x_once),
               KP=triton.next_power_of_2(K) if x_once else 16, PRE=fp8_row_gemv.early_inside(early_tiles, K, bk),
               num_warps=warps, num_stages=1)
    return y
