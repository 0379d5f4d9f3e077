"""The one-row fp8 GEMV (batch-1 decode): y[n] = sum_k xq[k] * wq[n, k] * sa * sw[n], e4m3 weights streamed
with the warps side by side along K.

A program owns BLOCK_N weight rows and walks K in tiles of BLOCK_K columns: thread t of warp w holds the
16 contiguous bytes (one 16-byte load) at columns 16 * (32 w + t) + BLOCK_K j of every one of its rows,
so a tile is one load per row a thread, and the activation's quantization (its amax and one IEEE
division per element) is done once a program per column instead of once per warp. Products are summed
over those 16 columns inside the thread each tile ([BLOCK_N, BLOCK_K / 16] fp32 partial sums, BLOCK_N
registers a thread), reduced across threads once at the end; so a tile of 2048-4096 columns (the bytes
in flight of a bf16 tile of half the columns) costs no more accumulator registers than one of 512.
Launched as a programmatic dependent launch, a program loads its first 1-4 weight tiles (``early_tiles``)
before it waits for the kernel before: after a latency-bound kernel (batch-1 decode attention before
o_proj) HBM streams them meanwhile; the tiles are summed in the same order, so the bits do not change.

The recipe is ``nbgen.models.fp8_scaled``'s (as in ``kernels.fp8_small_gemm``, whose multi-row kernel
shares it): sa = max(amax(|x (* g)|), 1e-10) / 448, xq = e4m3(clamp(x (* g) / sa, +-448)) with IEEE
divisions, y = (acc * sa) * sw[n] (+ bias[n]) rounded once (or added into the residual stream); results
equal ``reference_matmul`` up to fp32 summation order.
"""
from __future__ import annotations

from typing import Optional

import torch

from nbgen.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

VEC = 16     # e4m3 columns a thread loads at once (16 bytes)
# weight tiles a program loads before its PDL wait when the kernel before is batch-1 decode attention
# (latency-bound, HBM mostly idle): the o_proj, whose weights then stream while attention runs
EARLY_TILES_AFTER_ATTENTION = 4


if triton is not None:
    from nbgen.kernels.fp8_quant import e4m3_scale, to_e4m3
    from nbgen.kernels.triton_norm import rnd

    @triton.jit
    def _xq_tile(x_ptr, g_ptr, kk, K, sa, PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr):
        # x[kk] (* g[kk]) / sa rounded to e4m3 (loaded as such with PREQUANT), any shape of column indices kk
        if PREQUANT:
            return tl.load(x_ptr + kk, mask=kk < K, other=0.0)
        v = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        if COL_SCALE:
            v = v * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        return to_e4m3(v, sa)

    @triton.jit
    def w_tile(w_rows, row_mask, col, k0, K):
        # e4m3 weight columns k0 + col of the program's rows -> [J, BLOCK_N, 16] (zeros past K); read once
        kk = k0 + col
        return tl.load(w_rows + kk[:, None, :], mask=row_mask & (kk < K)[:, None, :], other=0.0,
                       eviction_policy="evict_first")

    @triton.jit
    def load_early(w_rows, row_mask, col, K, BLOCK_K: tl.constexpr, PRE: tl.constexpr):
        # the program's first PRE (1-4) weight tiles, loaded before the PDL wait (the weights do not depend
        # on the kernel before) -> (w0, w1, w2, w3), the tiles past PRE being w0 as placeholders
        w0 = w_tile(w_rows, row_mask, col, 0, K)
        w1, w2, w3 = w0, w0, w0
        if PRE > 1:
            w1 = w_tile(w_rows, row_mask, col, BLOCK_K, K)
        if PRE > 2:
            w2 = w_tile(w_rows, row_mask, col, 2 * BLOCK_K, K)
        if PRE > 3:
            w3 = w_tile(w_rows, row_mask, col, 3 * BLOCK_K, K)
        return w0, w1, w2, w3

    @triton.jit
    def tile_products(x_ptr, g_ptr, w, kk, K, sa, PREQUANT: tl.constexpr, COL_SCALE: tl.constexpr):
        # the loaded tile w [J, BLOCK_N, 16] at columns kk [J, 16] times x there quantized, summed over each
        # thread's 16 columns -> [J, BLOCK_N]
        xq = _xq_tile(x_ptr, g_ptr, kk, K, sa, PREQUANT, COL_SCALE)
        return tl.sum(w.to(tl.float32) * xq.to(tl.float32)[:, None, :], 2)

    @triton.jit
    def row_products(x_ptr, s_ptr, g_ptr, w0, w1, w2, w3, w_rows, row_mask, col, K, PREQUANT: tl.constexpr,
                     COL_SCALE: tl.constexpr, SUMSQ: tl.constexpr, BLOCK_K: tl.constexpr, X_ONCE: tl.constexpr,
                     KP: tl.constexpr, PRE: tl.constexpr):
        # after x is written: its scale sa (x (* g) quantized with it), and the products with the program's
        # rows over all of K, whose first PRE tiles w0..w3 are loaded (``load_early``; tiles inside K) ->
        # ([J, BLOCK_N] fp32 partial sums, sa, sum of x^2 when SUMSQ); the tiles are summed in column
        # order whatever PRE is, so the result bits do not depend on it
        J: tl.constexpr = BLOCK_K // 16
        ss = 0.0
        if PREQUANT:   # x given as e4m3 with its scale (kernels.fp8_quant.quant_rowwise)
            sa = tl.load(s_ptr)
        elif X_ONCE:
            kx = tl.arange(0, KP)
            v = tl.load(x_ptr + kx, mask=kx < K, other=0.0).to(tl.float32)
            if SUMSQ:
                ss = tl.sum(v * v, 0)
            if COL_SCALE:
                v = v * tl.load(g_ptr + kx, mask=kx < K, other=0.0).to(tl.float32)
            sa = e4m3_scale(tl.max(tl.abs(v), 0))
        else:
            amax = tl.zeros((J, 16), tl.float32)
            sq = tl.zeros((J, 16), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + col
                v = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                if SUMSQ:
                    sq += v * v
                if COL_SCALE:
                    v = v * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
            sa = e4m3_scale(tl.max(tl.max(amax, 1), 0))
            if SUMSQ:
                ss = tl.sum(tl.sum(sq, 1), 0)
        # products summed over each thread's 16 columns: [J, BLOCK_N] partial sums
        acc = tile_products(x_ptr, g_ptr, w0, col, K, sa, PREQUANT, COL_SCALE)
        if PRE > 1:
            acc += tile_products(x_ptr, g_ptr, w1, BLOCK_K + col, K, sa, PREQUANT, COL_SCALE)
        if PRE > 2:
            acc += tile_products(x_ptr, g_ptr, w2, 2 * BLOCK_K + col, K, sa, PREQUANT, COL_SCALE)
        if PRE > 3:
            acc += tile_products(x_ptr, g_ptr, w3, 3 * BLOCK_K + col, K, sa, PREQUANT, COL_SCALE)
        for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
            w = w_tile(w_rows, row_mask, col, k0, K)
            acc += tile_products(x_ptr, g_ptr, w, k0 + col, K, sa, PREQUANT, COL_SCALE)
        return acc, sa, ss

    @triton.jit
    def scaled_products(x_ptr, s_ptr, g_ptr, w0, w1, w2, w3, w_rows, row_mask, col, sw, K, PREQUANT: tl.constexpr,
                        COL_SCALE: tl.constexpr, SUMSQ: tl.constexpr, BLOCK_K: tl.constexpr, X_ONCE: tl.constexpr,
                        KP: tl.constexpr, PRE: tl.constexpr, USE_PDL: tl.constexpr):
        # once the loads that do not depend on the kernel before are issued (the first PRE weight tiles w0..w3
        # among them, ``load_early``): wait for x (PDL), row_products, let the next kernel launch -> (y
        # [BLOCK_N] fp32 = (acc * sa) * sw, the reference's order; sum of x^2 when SUMSQ)
        if USE_PDL:   # launched early (programmatic dependent launch): wait for x to be written
            pdl.gdc_wait()
        acc, sa, ss = row_products(x_ptr, s_ptr, g_ptr, w0, w1, w2, w3, w_rows, row_mask, col, K, PREQUANT,
                                   COL_SCALE, SUMSQ, BLOCK_K, X_ONCE, KP, PRE)
        if USE_PDL:   # the next kernel may start launching (it waits for our writes itself)
            pdl.gdc_launch_dependents()
        return tl.sum(acc, 0) * sa * sw, ss

    @triton.jit
    def _fp8_row_kernel(x_ptr, s_ptr, g_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, N, K, swn, eps, PREQUANT: tl.constexpr,
                        COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUM: tl.constexpr, SILU: tl.constexpr,
                        USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        X_ONCE: tl.constexpr, KP: tl.constexpr, PRE: tl.constexpr):
        # BLOCK_N weight rows a program, its first PRE (1-4) weight tiles loaded before the PDL wait; SILU: rows
        # n and HALF + n (gate and up of output n) side by side, BLOCK_N / 2 outputs silu(rnd(rnd(gate) * r)) *
        # rnd(rnd(up) * r), r = rsqrt(mean(x^2) + eps) (the folded norm's row factor). X_ONCE: the amax pass
        # loads all of x at once (KP: K rounded up to a power of two), one round trip instead of one a tile.
        J: tl.constexpr = BLOCK_K // 16
        rr = tl.arange(0, BLOCK_N)
        if SILU:
            out_n = N // 2
            rn = tl.program_id(0) * (BLOCK_N // 2) + rr // 2           # the output feature of each row
            n_mask = rn < out_n
            w_row = rn + (rr % 2) * out_n                               # gate, up, gate, up, ...
        else:
            out_n = N
            rn = tl.program_id(0) * BLOCK_N + rr
            n_mask = rn < N
            w_row = rn
        col = tl.arange(0, J)[:, None] * 16 + tl.arange(0, 16)[None, :]          # [J, 16] columns of a tile
        w_rows = w_ptr + w_row.to(tl.int64)[None, :, None] * swn                  # [1, BLOCK_N, 1]
        row_mask = n_mask[None, :, None]
        w0, w1, w2, w3 = load_early(w_rows, row_mask, col, K, BLOCK_K, PRE)
        sw = tl.load(sw_ptr + w_row, mask=n_mask, other=0.0)
        y, ss = scaled_products(x_ptr, s_ptr, g_ptr, w0, w1, w2, w3, w_rows, row_mask, col, sw, K, PREQUANT,
                                COL_SCALE, SILU, BLOCK_K, X_ONCE, KP, PRE, USE_PDL)
        if HAS_BIAS:
            y += tl.load(b_ptr + w_row, mask=n_mask, other=0.0).to(tl.float32)
        dt = y_ptr.dtype.element_ty
        if SILU:   # as silu_scaled: the projection rounded, scaled by r, rounded, then SiLU-and-mul
            r = tl.math.rsqrt(ss / K + eps)
            gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
            gate = rnd(rnd(gate, dt) * r, dt)
            up = rnd(rnd(up, dt) * r, dt)
            o = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(y_ptr + o, (gate / (1.0 + tl.exp(-gate)) * up).to(dt), mask=o < out_n)
        else:
            if ACCUM:   # the residual add, one rounding
                y += tl.load(y_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + rn, y.to(dt), mask=n_mask)


def pick_config(N: int, K: int) -> tuple[int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, num_warps, x_once) for one row against an [N, K] weight: 16 rows a program,
    8 warps and the amax pass in one load (``nbgen.bench.fp8_gemv --sweep`` at each Llama-3.1-8B shape:
    2-7 % ahead of 8 rows and 4 warps, the one-load amax pass another 2-6 %; persistent programs, 16
    warps or 32 rows a program slower); 1024 columns a step up to K = 4096 and 2048 above, from the
    layer as a decode step runs it (``nbgen.bench.decode_layers --dtype fp8 --sweep``: o_proj and
    gate|up ~3 and ~6 µs a layer faster at 1024 on an H200; the whole layer 93.5 -> 92.4 µs on an H100)."""
    return 16, (1024 if K <= 4096 else 2048), 8, K <= 16384      # (all of a longer x at once would spill registers)


def early_inside(early_tiles: int, K: int, block_k: int) -> int:
    """The early tiles a launch loads: at most the tiles K has (none past it)."""
    return min(early_tiles, triton.cdiv(K, block_k))


def fp8_row_gemv(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, y: torch.Tensor,
                 bias: Optional[torch.Tensor] = None, col_scale: Optional[torch.Tensor] = None,
                 accumulate: bool = False, config: Optional[tuple] = None,
                 x_scale: Optional[torch.Tensor] = None, silu_eps: Optional[float] = None,
                 early_tiles: int = 1) -> torch.Tensor:
    """x [1, K] (bf16 / fp16) @ (wq [N, K] e4m3 * sw[n]).T (+ bias) into y [1, N] (y's dtype; added into
    it with ``accumulate``) -> y. ``col_scale`` [K]: x * g is what is quantized (a folded norm).
    ``x_scale``: x is already e4m3 and this its scale sa (one fp32 value). ``silu_eps``: a folded
    gate|up projection: y [1, N / 2] = silu(gate * r) * (up * r), r = rsqrt(mean(x^2) + eps), as
    ``kernels.silu_scaled.silu_mul_scaled`` computes from the projection (BLOCK_N / 2 outputs a program).
    ``config``: (BLOCK_N weight rows, BLOCK_K, warps, x_once) (``pick_config``'s by default).
    ``early_tiles`` (1-4): the BLOCK_K tiles of its weight rows a program loads before it waits for the
    kernel before (``EARLY_TILES_AFTER_ATTENTION`` after attention); the same result bits."""
    if not 1 <= early_tiles <= 4:
        raise ValueError(f"early_tiles must be 1-4, got {early_tiles}")
    N, K = wq.shape
    bn, bk, warps, x_once = (tuple(config) + (False,))[:4] if config else pick_config(N, K)
    assert bk % (VEC * 32) == 0, "BLOCK_K: whole 16-byte columns for every thread of a warp"
    prequant = x_scale is not None
    assert not (prequant and (col_scale is not None or silu_eps is not None)), "x * g and x^2 need x itself"
    silu = silu_eps is not None
    assert not silu or bn % 2 == 0, "SiLU: gate and up rows in pairs"
    args = (x, x_scale if prequant else sw, col_scale if col_scale is not None else sw, wq, sw,
            bias if bias is not None else sw, y, N, K, wq.stride(0), float(silu_eps or 0.0))
    pdl.launch(_fp8_row_kernel, (triton.cdiv(N, bn),), args, x.device, PREQUANT=prequant,
               COL_SCALE=col_scale is not None, HAS_BIAS=bias is not None, ACCUM=accumulate, SILU=silu,
               BLOCK_N=bn, BLOCK_K=bk, X_ONCE=bool(x_once), KP=triton.next_power_of_2(K) if x_once else 16,
               PRE=early_inside(early_tiles, K, bk), num_warps=warps, num_stages=1)
    return y
