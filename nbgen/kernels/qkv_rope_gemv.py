"""Batch-1 decode's qkv projection, RoPE and K/V write as one Triton kernel (Llama, Mistral, Qwen2: no q/k
norm), for bf16 / fp16 weights and for e4m3 weights with per-row scales.

At one row the qkv GEMV and ``qk_norm_rope``'s kernel are two launches of mostly fixed cost (a ramp and a
drain each, ~32 layers a token). Rotate-half RoPE pairs element j of a head with element j + D/2, so here a
program owns output rows j and j + D/2 of one head (bf16: two accumulations of ``small_gemm``'s one-row
GEMV, as its SiLU variant owns gate and up rows; e4m3: ``fp8_row_gemv``'s products over rows in pairs, as
its SiLU variant pairs them) and does the rest of the chain in its epilogue: (a folded input norm's row
factor,) RoPE of q and k heads, q, k and v stored into the qkv row, k and v written into their paged-cache
slot (HND pages; e4m3 of value / scale for an fp8 cache).

Numerics are the two-kernel path's bit for bit: each row's fp32 sum in the GEMV's order (its helpers, its
tiles reduced across the same lanes and warps) plus bias, rounded to the model dtype as qkv stores it; then
``qk_norm_rope``'s steps (its row factor's tiles, reduced over 8 warps as its row-scale launch does;
``rnd(a * s)``; cos/sin rounded, each product rounded). Each kernel keeps its GEMV's contraction setting (the bf16 one is
compiled without, its FMAs explicit in ``small_gemm.one_row``; the e4m3 one with, as ``fp8_row_gemv``);
the epilogue's products are explicit ``mul.rn`` instructions, which are never contracted, so they round
as in torch either way.
"""
from __future__ import annotations

from typing import Optional

import torch

from nbgen.kernels import fp8_row_gemv, pdl, small_gemm
from nbgen.kernels.kv_write import KVTarget, is_fp8_cache
from nbgen.kernels.qk_norm_rope import supports_head_dim

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

if triton is not None:
    from nbgen.kernels.fp8_row_gemv import w_tile as fp8_w_tile
    from nbgen.kernels.fp8_row_gemv import row_products
    from nbgen.kernels.kv_write import head_row, to_cache
    from nbgen.kernels.qk_norm_rope import rnd
    from nbgen.kernels.small_gemm import one_row, row_tile

    @triton.jit
    def _mul_rn(a, b):
        # a * b in fp32 rounded to nearest even on its own: PTX never contracts an explicit mul.rn into an
        # FMA, and it keeps subnormals (libdevice's mul_rn is the .ftz form in Triton's build)
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _row_factor(x_ptr, HID: tl.constexpr, eps, HBLK: tl.constexpr):
        # rsqrt(mean(x^2) + eps) of the row summed as qk_norm_rope's row_rms_scale sums it (HBLK-column tiles,
        # each square rounded on its own, never contracted into an FMA)
        ss = tl.zeros((HBLK,), tl.float32)
        for k0 in tl.static_range(0, HID, HBLK):
            kk = k0 + tl.arange(0, HBLK)
            x = tl.load(x_ptr + kk, mask=kk < HID, other=0.0).to(tl.float32)
            ss += _mul_rn(x, x)
        return tl.math.rsqrt(tl.sum(ss, 0) / HID + eps)

    @triton.jit
    def _rope_store(ya, yb, head, j, cos, sin, slot, x_ptr, y_ptr, kc_ptr, vc_ptr, eps, k_scale, v_scale,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, ROW_SCALE: tl.constexpr,
                    HID: tl.constexpr, HBLK: tl.constexpr, FP8: tl.constexpr):
        # ya, yb: fp32 projections (+ bias) of rows j and j + D/2 of head ``head`` ([n] each; q heads, then k,
        # then v) -> the qkv row and, for k and v heads, the token's cache slot. Products by _mul_rn: rounded
        # alone whether or not the kernel contracts (the model-dtype rounding after each is HF's)
        HALF: tl.constexpr = D // 2
        dt = y_ptr.dtype.element_ty
        a = rnd(ya, dt)                                          # the projection as qkv stores it
        b = rnd(yb, dt)
        if ROW_SCALE:   # folded input norm: q|k|v = the normed stream's projection, rounded
            s = _row_factor(x_ptr, HID, eps, HBLK)
            a = rnd(_mul_rn(a, s), dt)
            b = rnd(_mul_rn(b, s), dt)
        # x * cos + rotate_half(x) * sin, each product rounded to the model dtype as in HF; v heads as they are
        is_v = head >= HQ + HKV
        ra = rnd(_mul_rn(a, cos), dt) - rnd(_mul_rn(b, sin), dt)
        rb = rnd(_mul_rn(b, cos), dt) + rnd(_mul_rn(a, sin), dt)
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
    def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, y_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, K, swn, eps,
                         k_scale, v_scale, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                         HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, HID: tl.constexpr, HBLK: tl.constexpr,
                         FP8: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # bf16 / fp16 weights: two [BLOCK_N, BLOCK_K] one_row accumulations, rows j and j + D/2
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
        _rope_store(ya, yb, head, j, cos, sin, slot, x_ptr, y_ptr, kc_ptr, vc_ptr, eps, k_scale, v_scale,
                    HQ, HKV, D, P, ROW_SCALE, HID, HBLK, FP8)

    @triton.jit
    def _fp8_qkv_rope_kernel(x_ptr, g_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr,
                             K, swn, eps, k_scale, v_scale, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                             P: tl.constexpr, COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                             ROW_SCALE: tl.constexpr, HID: tl.constexpr, HBLK: tl.constexpr, FP8: tl.constexpr,
                             USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             X_ONCE: tl.constexpr, KP: tl.constexpr):
        # e4m3 weights: fp8_row_gemv's products over BLOCK_N rows j, j + D/2, j + 1, j + 1 + D/2, ... (as its
        # SiLU variant pairs gate and up rows)
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
        # what the kernel before does not write: positions, cos/sin, slot, scales, bias, the first weight tile
        pos = tl.load(pos_ptr).to(tl.int64)
        cos = rnd(tl.load(cs_ptr + pos * D + j), dt)
        sin = rnd(tl.load(cs_ptr + pos * D + HALF + j), dt)
        slot = tl.load(slot_ptr).to(tl.int64)
        w = fp8_w_tile(w_rows, row_mask, col, 0, K)
        sw = tl.load(sw_ptr + w_row)
        if HAS_BIAS:
            bias = tl.load(b_ptr + w_row).to(tl.float32)
        if USE_PDL:   # launched early (programmatic dependent launch): wait for x to be written
            pdl.gdc_wait()
        acc, sa, _ss = row_products(x_ptr, sw_ptr, g_ptr, w, w_rows, row_mask, col, K, False, COL_SCALE, False,
                                    BLOCK_K, X_ONCE, KP)
        if USE_PDL:   # the next kernel may start launching (it waits for our writes itself)
            pdl.gdc_launch_dependents()
        y = tl.sum(acc, 0) * sa * sw               # fp8_row_gemv's order: (acc * sa) * sw
        if HAS_BIAS:
            y += bias
        ya, yb = tl.split(tl.reshape(y, (PAIRS, 2)))
        _rope_store(ya, yb, head, j, cos, sin, slot, x_ptr, y_ptr, kc_ptr, vc_ptr, eps, k_scale, v_scale,
                    HQ, HKV, D, P, ROW_SCALE, HID, HBLK, FP8)


def _heads_fit(n: int, head_dim: int, rows: int) -> bool:
    """Whole heads of a power-of-2 size whose halves split into blocks of ``rows`` output rows."""
    return supports_head_dim(head_dim) and n % head_dim == 0 and (head_dim // 2) % rows == 0


def _bf16_config(N: int, K: int, row_scale: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the bf16 kernel: small_gemm's one-row launch for programs that
    stream two rows a feature (gate|up's). Its [BLOCK_N, 1024] tiles reduce a row over 4 warps x 32 lanes
    x 8 columns at 4 or 8 warps alike (the warps beyond 4 split the rows), small_gemm's order; with a row
    factor 8 warps, so that its [1024] tiles reduce as qk_norm_rope's 8-warp launch does."""
    bn, bk, warps, stages = small_gemm.pick_config(1, N, K, silu_mul=True)
    return bn, bk, 8 if row_scale else warps, stages


def usable(x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
    """The bf16 / fp16 kernel takes this projection: one row that small_gemm would stream, whole heads whose
    halves split into the kernel's row blocks."""
    if x.shape[0] != 1 or not small_gemm.usable(x, weight):
        return False
    return _heads_fit(weight.shape[0], head_dim, _bf16_config(weight.shape[0], x.shape[1], False)[0])


def fp8_usable(x: torch.Tensor, wq: torch.Tensor, head_dim: int) -> bool:
    """The e4m3 kernel takes this projection: one bf16 / fp16 row against an e4m3 weight (the caller checks
    that the one-row fp8 kernel serves it), whole heads whose halves split into its row pairs."""
    if x.shape[0] != 1 or wq.dtype != torch.float8_e4m3fn or wq.stride(1) != 1 or x.stride(1) != 1:
        return False
    return _heads_fit(wq.shape[0], head_dim, fp8_row_gemv.pick_config(*wq.shape)[0] // 2)


def _rope_args(positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv: KVTarget, eps: Optional[float],
               hid: int) -> tuple[tuple, tuple, dict]:
    """The epilogue's arguments: (tensors after the weights', scalars after the weight stride, constexprs)."""
    kc, vc, slots, ks, vs = KVTarget(*kv)       # a plain (k_cache, v_cache, slots) tuple: scales 1.0
    hid = hid if eps is not None else 1
    args = (positions, cos_sin_cache, kc, vc, slots)
    scal = (0.0 if eps is None else float(eps), float(ks), float(vs))
    kw = dict(P=kc.shape[2], ROW_SCALE=eps is not None, HID=hid, HBLK=min(1024, triton.next_power_of_2(hid)),
              FP8=is_fp8_cache(kc))
    return args, scal, kw


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
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = _bf16_config(N, K, row_scale_eps is not None)
    rope, scal, kw = _rope_args(positions, cos_sin_cache, kv, row_scale_eps, K)
    pdl.launch(_qkv_rope_kernel, (N // (2 * bn),),
               (x, weight, bias if bias is not None else weight, y, *rope, K, weight.stride(0), *scal), x.device,
               HQ=num_q_heads, HKV=num_kv_heads, D=head_dim, HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk,
               num_warps=warps, num_stages=stages, **kw,
               enable_fp_fusion=False)    # as qk_norm_rope (one_row's FMAs are explicit)
    return y


def fp8_qkv_rope(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
                 col_scale: Optional[torch.Tensor], positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, kv: KVTarget,
                 row_scale_eps: Optional[float] = None) -> torch.Tensor:
    """``qkv_rope`` with an e4m3 weight wq [N, K] and its scales sw [1, N] (per output row): the projection
    is ``fp8_row_gemv``'s (x (* col_scale) quantized per token; ``col_scale``: a folded norm's weight)."""
    K = x.shape[1]
    N = wq.shape[0]
    assert N == (num_q_heads + 2 * num_kv_heads) * head_dim, "weight rows are the q, k and v heads"
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, x_once = fp8_row_gemv.pick_config(N, K)      # fp8_row_gemv's tiles: its summation order
    rope, scal, kw = _rope_args(positions, cos_sin_cache, kv, row_scale_eps, K)
    pdl.launch(_fp8_qkv_rope_kernel, (N // bn,),
               (x, col_scale if col_scale is not None else sw, wq, sw, bias if bias is not None else sw, y, *rope, K,
                wq.stride(0), *scal), x.device,
               HQ=num_q_heads, HKV=num_kv_heads, D=head_dim, COL_SCALE=col_scale is not None, HAS_BIAS=bias is not None,
               BLOCK_N=bn, BLOCK_K=bk, X_ONCE=bool(x_once), KP=triton.next_power_of_2(K) if x_once else 16,
               num_warps=warps, num_stages=1, **kw)
    return y
