"""The RoPE kernel of ``kernels.qk_norm_rope`` for layers without a per-head q/k norm (Llama, Mistral, Qwen2),
in place on the qkv rows: a folded norm's row scale, RoPE with HF's rounding, and the K/V write into the
paged cache (model dtype or e4m3). ``qk_norm_rope.qk_norm_rope_`` launches it; Qwen3's norm form keeps its
own kernel there.

The q heads and the k heads are two tiles ([heads, D/2] each, powers of 2: no lanes spent on masked heads
where the counts are powers of 2, as Llama-3.1-8B's 32 and 8), and v is loaded with them, before any store.
A launch may split a token's heads into groups (grid (T, groups)), each computing the row scale itself.
Compiled without FMA contraction, as the norm form: each product rounds where torch rounds it.
"""
from __future__ import annotations

from typing import Any

from nbgen.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton never launch it
    triton = None

if triton is not None:
    from nbgen.kernels.kv_write import finish_v, head_row, to_cache
    from nbgen.kernels.triton_norm import rnd, row_rms_scale

    @triton.jit
    def _rope_tile(a, b, cos, sin, s, dt: tl.constexpr, ROW_SCALE: tl.constexpr):
        # heads [N, D/2] x 2 (first and second halves, fp32) -> rotated halves in dt
        if ROW_SCALE:   # folded input norm: q|k|v = the normed stream's projection, rounded
            a = rnd(a * s, dt)
            b = rnd(b * s, dt)
        # x * cos + rotate_half(x) * sin, each product rounded to the model dtype as in HF
        oa = (rnd(a * cos, dt) - rnd(b * sin, dt)).to(dt, fp_downcast_rounding="rtne")
        ob = (rnd(b * cos, dt) + rnd(a * sin, dt)).to(dt, fp_downcast_rounding="rtne")
        return oa, ob

    @triton.jit
    def _head_mask(N: tl.constexpr, NP: tl.constexpr, W: tl.constexpr):
        # [NP, W] rows < N; a constant-true mask when N = NP (the loads and stores compile unmasked)
        if N == NP:
            return tl.full((NP, W), 1, tl.int1)
        return (tl.arange(0, NP) < N)[:, None] & (tl.arange(0, W) < W)[None, :]

    @triton.jit
    def slot_and_row_scale(slot_ptr, t, h_ptr, h_stride, h_eps, HID: tl.constexpr, HBLK: tl.constexpr,
                           WRITE_KV: tl.constexpr, ROW_SCALE: tl.constexpr):
        # token t's cache slot (WRITE_KV, else 0: unused) and a folded norm's row factor (ROW_SCALE, else 1.0):
        # inputs the previous kernel does not write, so the RoPE kernels read them before waiting for it (h, the
        # stream, was written before the qkv projection before them started, and that kernel only lets them
        # launch once it runs)
        if WRITE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
        else:
            slot = 0
        if ROW_SCALE:
            s = row_rms_scale(h_ptr + t.to(tl.int64) * h_stride, HID, h_eps, HBLK)
        else:
            s = 1.0
        return slot, s

    @triton.jit
    def _qk_rope_kernel(qkv_ptr, pos_ptr, cs_ptr, row_stride, kc_ptr, vc_ptr, slot_ptr,
                        h_ptr, h_stride, h_eps, k_scale, v_scale,
                        HQ: tl.constexpr, HKV: tl.constexpr, QG: tl.constexpr, QGP: tl.constexpr,
                        KG: tl.constexpr, KGP: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                        WRITE_KV: tl.constexpr, FP8: tl.constexpr, ROW_SCALE: tl.constexpr, HID: tl.constexpr,
                        HBLK: tl.constexpr, USE_PDL: tl.constexpr):
        # program (token t, group g): the group's QG q heads and KG k (and v) heads (G = HKV / KG groups a
        # token; one group: a decode step is one wave of programs), q and k as separate [heads, D/2] tiles
        # (QGP, KGP: powers of 2; no masked lanes where QG, KG are), every load issued before the first store
        t = tl.program_id(0)
        g = tl.program_id(1)
        HALF: tl.constexpr = D // 2
        offs = tl.arange(0, HALF)
        dt = qkv_ptr.dtype.element_ty
        # inputs that the previous kernel does not write: read before waiting for it
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = rnd(tl.load(cs_ptr + pos * D + offs), dt)[None, :]
        sin = rnd(tl.load(cs_ptr + pos * D + HALF + offs), dt)[None, :]
        slot, s = slot_and_row_scale(slot_ptr, t, h_ptr, h_stride, h_eps, HID, HBLK, WRITE_KV, ROW_SCALE)
        if USE_PDL:
            pdl.gdc_wait()                                     # qkv is the previous kernel's output
            pdl.gdc_launch_dependents()
        row = qkv_ptr + t.to(tl.int64) * row_stride
        hq = g * QG + tl.arange(0, QGP)                        # the group's q heads
        hk = g * KG + tl.arange(0, KGP)                        # its kv heads
        qm = _head_mask(QG, QGP, HALF)
        km = _head_mask(KG, KGP, HALF)
        qptr = row + hq[:, None] * D + offs[None, :]           # [QGP, HALF]: first halves of the q heads
        kptr = row + (HQ + hk)[:, None] * D + offs[None, :]
        qa = tl.load(qptr, mask=qm, other=0.0).to(tl.float32)
        qb = tl.load(qptr + HALF, mask=qm, other=0.0).to(tl.float32)
        ka = tl.load(kptr, mask=km, other=0.0).to(tl.float32)
        kb = tl.load(kptr + HALF, mask=km, other=0.0).to(tl.float32)
        if WRITE_KV or ROW_SCALE:                              # v heads: copied (scaled when folded)
            dd = tl.arange(0, D)
            vm = _head_mask(KG, KGP, D)
            vptr = row + (HQ + HKV + hk)[:, None] * D + dd[None, :]
            v = tl.load(vptr, mask=vm)
        oa, ob = _rope_tile(qa, qb, cos, sin, s, dt, ROW_SCALE)
        tl.store(qptr, oa, mask=qm)
        tl.store(qptr + HALF, ob, mask=qm)
        oa, ob = _rope_tile(ka, kb, cos, sin, s, dt, ROW_SCALE)
        tl.store(kptr, oa, mask=km)
        tl.store(kptr + HALF, ob, mask=km)
        if WRITE_KV:                                           # rotated k heads into the cache
            dst = head_row(slot, hk, HKV * D, D, P)[:, None] + offs[None, :]
            kt = kc_ptr.dtype.element_ty                      # an fp8 cache: e4m3 of k / k_scale
            tl.store(kc_ptr + dst, to_cache(oa, k_scale, FP8, kt), mask=km)
            tl.store(kc_ptr + dst + HALF, to_cache(ob, k_scale, FP8, kt), mask=km)
        if WRITE_KV or ROW_SCALE:
            finish_v(v, vptr, vm, s, vc_ptr, slot, hk, dd, v_scale, HKV, D, P, FP8, ROW_SCALE, WRITE_KV)


def launch(args: tuple, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, groups: int,
           kw: dict[str, Any]) -> None:
    """Launch ``_qk_rope_kernel`` over ``args`` (qkv, positions, cos_sin_cache, qkv's row stride, k / v caches,
    slots, h, h's row stride, its eps, k / v scales; ``qk_norm_rope.qk_norm_rope_`` builds them) in ``groups``
    programs a token (the caller checks they divide both head counts); ``kw``: the shared constexprs and launch
    options (WRITE_KV, FP8, ROW_SCALE, HID, HBLK, num_warps, enable_fp_fusion)."""
    qg, kg = num_q_heads // groups, num_kv_heads // groups
    pdl.launch(_qk_rope_kernel, (args[0].shape[0], groups), args, args[0].device,
               HQ=num_q_heads, HKV=num_kv_heads, QG=qg, QGP=triton.next_power_of_2(qg), KG=kg,
               KGP=triton.next_power_of_2(kg), D=head_dim, P=page_size, **kw)
