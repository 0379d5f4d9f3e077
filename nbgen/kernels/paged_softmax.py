"""Online-softmax pieces over paged KV, inlined by Triton into the kernels that call them.

``attend_pages``: q rows against one kv head's tokens of a span of pages, the loop of the split-KV
decode kernel (kernels/triton_decode.py), of the shared-prefix level 0 (kernels/triton_cascade.py) and of
the chunk attention's prefix keys (kernels/triton_extend.py).
``fold_shared``: the decode kernel's level-1 merge of a row's level-0 partials (a shared-prefix step).
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton never build these kernels
    triton = None

if triton is not None:
    @triton.jit
    def fold_shared(m, l, acc, c, slot, kh, HKV, rows, G: tl.constexpr, part0_ptr, ml0_ptr,
                    S0: tl.constexpr, SB0: tl.constexpr, BM0: tl.constexpr, D: tl.constexpr):
        """Merge a row's level-0 partials (its chunk ``c``'s S0 splits over the shared pages, written by
        kernels/triton_cascade.py; SB0 splits per load; the row's place ``slot`` in the chunk) into its
        softmax state (m, l, acc) of q rows ``rows`` (m finite: level 1 holds >= 1 token). Rows in no
        chunk (c = -1) load nothing and keep their state exactly."""
        i = slot * G + rows                                   # the row's q heads in the level-0 tile
        ok = (rows < G) & ((rows * 0 + c) >= 0)
        d = tl.arange(0, D)
        for j0 in tl.static_range(0, S0, SB0):
            cell = (c * HKV + kh) * S0 + j0 + tl.arange(0, SB0)                        # [SB0]
            mls = ml0_ptr + cell[:, None] * (2 * BM0) + i[None, :]
            m0 = tl.load(mls, mask=ok[None, :], other=float("-inf"))                    # [SB0, rows]
            l0 = tl.load(mls + BM0, mask=ok[None, :], other=0.0)
            a0 = tl.load(part0_ptr + cell.to(tl.int64)[:, None, None] * (BM0 * D) + i[None, :, None] * D
                         + d[None, None, :], mask=ok[None, :, None], other=0.0)         # [SB0, rows, D]
            m_new = tl.maximum(m, tl.max(m0, 0))
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(m0 - m_new[None, :])                  # empty or absent split: 0
            l = l * alpha + tl.sum(w * l0, 0)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * a0, 0)
            m = m_new
        return m, l, acc

    @triton.jit
    def widen_pairs(w, PTX: tl.constexpr):
        """e4m3 bytes in pairs (int16 [N, C]: byte 0 the even column, byte 1 the odd one) -> (even, odd)
        as fp16 [N, C], exactly. ``PTX``: one prmt and two cvt.f16x2.e4m3x2 per two pairs; else Triton
        casts (the same values; the interpreter runs no PTX)."""
        if PTX:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t;\n .reg .b16 lo, hi;\n prmt.b32 t, $2, 0, 0x3120;\n mov.b32 {lo, hi}, t;\n"
                " cvt.rn.f16x2.e4m3x2 $0, lo;\n cvt.rn.f16x2.e4m3x2 $1, hi;}",
                "=r,=r,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
        else:
            return (w.to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16),
                    (w >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16))

    @triton.jit
    def attend_pages(q, kc_ptr, vc_ptr, indices_ptr, start, lo, hi, kh, s_page, s_head, s_tok, qk_scale,
                     M: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
                     STAGES: tl.constexpr, AHEAD: tl.constexpr = False, FP8: tl.constexpr = False,
                     PTX: tl.constexpr = True, PAIRS: tl.constexpr = True):
        """Online softmax of q [M, D] against one kv head's tokens [lo, hi) of the pages listed from
        ``indices_ptr + start`` (scores in log2 units through ``qk_scale``) -> (m [M], l [M], acc [M, D]),
        not normalised. ``AHEAD``: each tile's page numbers are loaded one iteration before its K/V
        (a loop-carried value), so the software pipeliner gives the K/V loads all STAGES - 1 stages of
        distance (more tiles in flight) instead of spending one on the page-number load.

        ``FP8`` (e4m3 pages, q fp16): K tiles widen in registers; V tiles load as byte pairs (int16) split
        into the even and the odd columns (``widen_pairs``), two [M, D/2] products. A widened [N, D] V
        tile as the B operand needs each thread's values from consecutive tokens, which the compiler
        gathers with one shared-memory load per byte; a pair is a 16-bit value, which it transposes with
        ldmatrix as for bf16 tiles. ``PAIRS=False``: V tiles widen as K tiles do, one [M, D] product;
        for 64-row tiles (the shared-prefix kernel's level 0; the decode kernel above 32 q heads a kv
        head), which take wgmma on sm_90, where byte-pair V tiles are not validated inside those kernels
        (the shared-prefix kernel faulted with them)."""
        V_PAIRS: tl.constexpr = FP8 and PAIRS
        d = tl.arange(0, D)
        dh = tl.arange(0, D // 2)
        m = tl.full([M], float("-inf"), tl.float32)
        l = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        if V_PAIRS:
            acc_e = tl.zeros([M, D // 2], tl.float32)    # even / odd columns
            acc_o = tl.zeros([M, D // 2], tl.float32)
        else:
            acc_e = 0.0
            acc_o = 0.0
        if AHEAD:
            tn = lo + tl.arange(0, BLOCK_N)
            page_next = tl.load(indices_ptr + start + tn // P, mask=tn < hi, other=0)
        else:
            page_next = tl.zeros([BLOCK_N], tl.int32)
        for t0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            t = t0 + tl.arange(0, BLOCK_N)
            tm = t < hi
            if AHEAD:
                page = page_next.to(tl.int64)
                tn = t + BLOCK_N
                page_next = tl.load(indices_ptr + start + tn // P, mask=tn < hi, other=0)
            else:
                page = tl.load(indices_ptr + start + t // P, mask=tm, other=0).to(tl.int64)
            off = page * s_page + kh * s_head + (t % P) * s_tok                       # [BLOCK_N]
            # e4m3 pages widen to q's dtype (fp16) in registers (a no-op for model-dtype pages)
            k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=tm[:, None], other=0.0).to(q.dtype)
            if not V_PAIRS:
                v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=tm[:, None], other=0.0).to(q.dtype)
            sc = tl.dot(q, tl.trans(k)) * qk_scale                                     # [M, BLOCK_N], log2 units
            sc = tl.where(tm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            if V_PAIRS:     # V as [BLOCK_N, D/2] byte pairs -> even / odd columns (after the softmax:
                w = tl.load(vc_ptr.to(tl.pointer_type(tl.int16)) + (off // 2)[:, None] + dh[None, :],
                            mask=tm[:, None], other=0)               # fewer registers live across it)
                ve, vo = widen_pairs(w, PTX)
                pp = p.to(tl.float16)
                acc_e = acc_e * alpha[:, None] + tl.dot(pp, ve)                        # [M, D/2]
                acc_o = acc_o * alpha[:, None] + tl.dot(pp, vo)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)                  # [M, D]
            m = m_new
        if V_PAIRS:
            acc = tl.reshape(tl.join(acc_e, acc_o), [M, D])     # columns back in order: [M, D/2, 2] -> [M, D]
        return m, l, acc
