"""SiLU-and-mul of a folded norm's gate|up projection, with the norm's row scale, as one Triton kernel.

With the post-attention RMSNorm folded into gate|up (``nbgen.models.norm_fold``) the projection reads
the raw residual stream h, so gate and up still need each row's rsqrt(mean(h^2) + eps): this kernel
applies it, rounds gate and up to the model dtype (as the projection of the normed stream is
rounded) and computes silu(gate) * up. ``rms_scale`` is the same row scale in torch.

``silu_mul_scaled_quant`` is the same kernel for an fp8 down projection on cuBLAS's path: it rounds each
activation to the model dtype as above and writes it quantized per token (``kernels.fp8_quant``'s
recipe: the row's amax over the whole intermediate row -> scale, e4m3 bytes), so the activation is
never stored in the model dtype and the separate quantization launch is gone. ``silu_mul_quant`` does
the same for an unfolded layer's plain SiLU-and-mul (``kernels.triton_norm.silu_and_mul``'s values).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from nbgen.kernels import gpu_ops, pdl, triton_norm
from nbgen.kernels.fp8_quant import QuantizedRows

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the torch path
    triton = None

ONE_BLOCK_MAX = 16384    # silu_mul_scaled_quant holds a token's activation row in one program up to this


def rms_scale(h: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, 1] fp32: rsqrt(mean(h^2) + eps) per row, as RMSNorm computes it."""
    return torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)


if triton is not None:
    from nbgen.kernels.triton_norm import rnd, row_rms_scale
    from nbgen.kernels.fp8_quant import e4m3_scale, to_e4m3
    from nbgen.kernels.triton_norm import silu_mul_block

    @triton.jit
    def _silu_scaled_kernel(x_ptr, h_ptr, y_ptr, I, sx, sh, sy, eps, HID: tl.constexpr, HBLK: tl.constexpr,
                            BLOCK: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr):
        # program (token t, j): blocks j, j + P, ... of I (P programs a token): silu(gate * s) * (up * s),
        # s = the token's rms scale of h (one program a token at prefill sizes reads h once)
        t = tl.program_id(0).to(tl.int64)
        # h was written before the gate|up projection that precedes this kernel started (that kernel
        # only lets this one launch once it runs), so it is read before the wait
        s = row_rms_scale(h_ptr + t * sh, HID, eps, HBLK)
        if USE_PDL:
            pdl.gdc_wait()                                     # gate|up is the previous kernel's output
            pdl.gdc_launch_dependents()
        dt = y_ptr.dtype.element_ty
        for c in range(tl.program_id(1) * BLOCK, I, tl.num_programs(1) * BLOCK):
            offs = c + tl.arange(0, BLOCK)
            m = offs < I
            tl.store(y_ptr + t * sy + offs, _silu_block(x_ptr + t * sx, offs, m, I, s, dt, True, PTX, False), mask=m)

    @triton.jit
    def _silu_block(x_row, offs, m, I, s, dt: tl.constexpr, ROW_SCALE: tl.constexpr, PTX: tl.constexpr,
                    F32: tl.constexpr):
        # one block of a token's activation in dt (F32: its values as fp32). ROW_SCALE: gate and up scaled by s
        # and rounded to the model dtype (the normed stream's projection), then SiLU-and-mul rounded once;
        # else the plain SiLU-and-mul of an unfolded layer (triton_norm's)
        if ROW_SCALE:
            g = _rnd(tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32) * s, dt, PTX)
            u = _rnd(tl.load(x_row + I + offs, mask=m, other=0.0).to(tl.float32) * s, dt, PTX)
            y = g / one_plus_exp_neg(g, PTX) * u
            if F32:
                y = _rnd(y, dt, PTX)
            else:
                y = y.to(dt)
        else:
            y = silu_mul_block(x_row, offs, m, I, dt)
            if F32:
                y = y.to(tl.float32)
        return y

    @triton.jit
    def _rnd(x, dt: tl.constexpr, PTX: tl.constexpr):
        # rnd(x, dt): fp32 x rounded to dt, as fp32. bf16 on CUDA: two values a cvt.rn.bf16x2 (one F2FP for
        # two where rnd spends an F2F each), unpacked by a shift and a mask
        if PTX and dt == tl.bfloat16:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 p;\n cvt.rn.bf16x2.f32 p, $3, $2;\n shl.b32 $0, p, 16;\n and.b32 $1, p, 0xffff0000; }",
                "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
        return rnd(x, dt)

    @triton.jit
    def one_plus_exp_neg(g, PTX: tl.constexpr):
        """1 + exp(-g) (fp32), the value of ``1.0 + tl.exp(-g)``: Triton's exp is ex2.approx.f32 of
        g * -log2(e), whose fix-up for arguments below -126 only changes results under 2^-126, which the
        1 + rounds away. ``PTX``: the bare ex2.approx.ftz (one MUFU op, 2 of the 6 instructions); else
        tl.exp (the interpreter runs no PTX)."""
        if PTX:
            e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [g * -1.4426950216293334961],
                                          dtype=tl.float32, is_pure=True, pack=1)
        else:
            e = tl.exp(-g)
        return 1.0 + e

    @triton.jit
    def _silu_piece(x_row, OFF: tl.constexpr, B: tl.constexpr, I, s, dt: tl.constexpr, ROW_SCALE: tl.constexpr,
                    MASK: tl.constexpr, PTX: tl.constexpr):
        # columns OFF .. OFF + B of a token's activation, fp32 (values of dt); MASK: the piece runs past I
        offs = OFF + tl.arange(0, B)
        if MASK:
            m = offs < I
        else:
            m = tl.full((B,), 1, tl.int1)                  # constant true: the loads compile unmasked
        return _silu_block(x_row, offs, m, I, s, dt, ROW_SCALE, PTX, True)

    @triton.jit
    def _quant_piece(q_row, v, OFF: tl.constexpr, B: tl.constexpr, I, qs, MASK: tl.constexpr):
        offs = OFF + tl.arange(0, B)
        if MASK:
            tl.store(q_row + offs, to_e4m3(v, qs), mask=offs < I)
        else:
            tl.store(q_row + offs, to_e4m3(v, qs))

    @triton.jit
    def _silu_scaled_quant_kernel(x_ptr, h_ptr, q_ptr, qs_ptr, I, sx, sh, sq, eps, HID: tl.constexpr,
                                  HBLK: tl.constexpr, BLOCK: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                                  B2: tl.constexpr, MASK: tl.constexpr, ROW_SCALE: tl.constexpr,
                                  PTX: tl.constexpr, USE_PDL: tl.constexpr):
        # program (token t, j) of P a token. B0 > 0: one program a token holds its whole activation row as up
        # to three power-of-2 pieces B0 + B1 + B2 (B1, B2 may be 0; only the last piece may run past I, then
        # MASK), all loaded at once, no lanes spent on masked columns when I is their sum (Llama-3.1-8B:
        # 14 336 = 8 192 + 4 096 + 2 048). B0 = 0: the row's amax block by block (each program of the token
        # alike; masked columns are 0), then blocks j, j + P, ... of BLOCK recomputed and quantized with that
        # scale. ROW_SCALE: the folded layer's activation (h's row scale), else the plain one (h unused)
        t = tl.program_id(0).to(tl.int64)
        if ROW_SCALE:
            s = row_rms_scale(h_ptr + t * sh, HID, eps, HBLK)  # h: written before gate|up started
        else:
            s = 1.0
        if USE_PDL:
            pdl.gdc_wait()                                     # gate|up is the previous kernel's output
            pdl.gdc_launch_dependents()
        dt = x_ptr.dtype.element_ty
        x_row = x_ptr + t * sx
        q_row = q_ptr + t * sq
        if B0 > 0:
            v0 = _silu_piece(x_row, 0, B0, I, s, dt, ROW_SCALE, MASK and B1 == 0, PTX)
            amax = tl.max(tl.abs(v0), 0)
            if B1 > 0:
                v1 = _silu_piece(x_row, B0, B1, I, s, dt, ROW_SCALE, MASK and B2 == 0, PTX)
                amax = tl.maximum(amax, tl.max(tl.abs(v1), 0))
            if B2 > 0:
                v2 = _silu_piece(x_row, B0 + B1, B2, I, s, dt, ROW_SCALE, MASK, PTX)
                amax = tl.maximum(amax, tl.max(tl.abs(v2), 0))
            qs = e4m3_scale(amax)
            _quant_piece(q_row, v0, 0, B0, I, qs, MASK and B1 == 0)
            if B1 > 0:
                _quant_piece(q_row, v1, B0, B1, I, qs, MASK and B2 == 0)
            if B2 > 0:
                _quant_piece(q_row, v2, B0 + B1, B2, I, qs, MASK)
        else:
            amax = tl.zeros((BLOCK,), tl.float32)
            for c in range(0, I, BLOCK):
                offs = c + tl.arange(0, BLOCK)
                v = _silu_block(x_row, offs, offs < I, I, s, dt, ROW_SCALE, PTX, True)
                amax = tl.maximum(amax, tl.abs(v))
            qs = e4m3_scale(tl.max(amax, 0))
            for c in range(tl.program_id(1) * BLOCK, I, tl.num_programs(1) * BLOCK):
                offs = c + tl.arange(0, BLOCK)
                m = offs < I
                v = _silu_block(x_row, offs, m, I, s, dt, ROW_SCALE, PTX, True)
                tl.store(q_row + offs, to_e4m3(v, qs), mask=m)
        if tl.program_id(1) == 0:
            tl.store(qs_ptr + t, qs)


def silu_mul_scaled(gate_up: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """gate_up [T, 2I] projected from the un-normed stream h [T, H] -> [T, I] = silu(gate * s) * (up * s),
    s = rms_scale(h, eps) (one Triton kernel on CUDA, torch elsewhere)."""
    if triton is None or not gate_up.is_cuda or gate_up.stride(1) != 1 or h.stride(1) != 1:
        s = rms_scale(h, eps)
        gate, up = (gate_up.float() * s).to(gate_up.dtype).chunk(2, dim=-1)
        return F.silu(gate) * up
    return silu_mul_scaled_kernel(gate_up, h, eps)


def silu_mul_scaled_kernel(gate_up: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """``silu_mul_scaled`` through its Triton kernel (the caller checks Triton and unit column strides)."""
    T, I2 = gate_up.shape
    I = I2 // 2
    y = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return y
    block = _block(I)
    # decode sizes: a program per block (a short kernel); from 1 024 tokens on, one program a token
    # loops over the blocks and reads its row of h once (prefill: ~1/3 less traffic for Qwen3-0.6B)
    pdl.launch(_silu_scaled_kernel, (T, triton.cdiv(I, block) if T < 1024 else 1),
               (gate_up, h, y, I, gate_up.stride(0), h.stride(0), y.stride(0), float(eps)), gate_up.device,
               HID=h.shape[1], HBLK=min(1024, triton.next_power_of_2(h.shape[1])), BLOCK=block,
               PTX=gate_up.is_cuda, num_warps=4 if block <= 1024 else 8)
    return y


def silu_mul_scaled_quant(gate_up: torch.Tensor, h: torch.Tensor, eps: float,
                          launch: Optional[SiluQuantLaunch] = None) -> QuantizedRows:
    """``silu_mul_scaled``'s activation [T, I] (the kernel's, rounded to gate_up's dtype) quantized per
    token for an fp8 GEMM -> QuantizedRows (q [T, I] e4m3, scale [T, 1]): the bytes and scales that
    ``kernels.fp8_quant.quant_rowwise`` gives for that activation, in one launch. Triton kernel only (the
    caller checks Triton and unit column strides). ``launch``: the sweep bench's explicit launch, else
    ``quant_launch``'s by shape."""
    return _quant_launch(gate_up, h, eps, launch)


def silu_mul_quant(gate_up: torch.Tensor, launch: Optional[SiluQuantLaunch] = None) -> QuantizedRows:
    """``kernels.triton_norm.silu_and_mul``'s activation [T, I] quantized per token for an fp8 GEMM, as
    ``silu_mul_scaled_quant`` (an unfolded layer's down_proj input), in one launch. Triton kernel only."""
    return _quant_launch(gate_up, None, 0.0, launch)


def silu_mul_quant_usable(gate_up: torch.Tensor) -> bool:
    """An unfolded layer's SiLU-and-mul of ``gate_up`` runs ``triton_norm``'s kernel (fused kernels on,
    a row it serves), so ``silu_mul_quant`` quantizes the very values it would give."""
    return triton is not None and gpu_ops.fused_enabled(gate_up) and gate_up.dim() == 2 and triton_norm.supported(gate_up)


@dataclass(frozen=True)
class SiluQuantLaunch:
    """How ``silu_mul_scaled_quant`` / ``silu_mul_quant`` launch: ``pieces`` (B0, B1, B2) the power-of-2
    pieces one program a token holds its activation row in (B0 = 0: programs loop over blocks of
    ``block`` columns, ``per_token`` of them a token), ``num_warps`` a program."""

    pieces: tuple[int, int, int]
    block: int
    per_token: int
    num_warps: int


def quant_launch(T: int, I: int) -> SiluQuantLaunch:
    """The launch by shape: up to ONE_BLOCK_MAX columns one program a token holding its row as power-of-2
    pieces with no masked lanes where I is a sum of up to three. Llama-3.1-8B: 8 warps, 56 values a thread;
    with Triton 3.6 for sm_90a 79 registers (3 programs an SM) and 13.7k warp-instructions a token (16
    warps: 49 registers, 2 programs, 16.4k; a masked 16 384-column block with an IEEE division a value:
    25.5k).
    Wider: a program per block at a few rows, each reducing the whole row first (from the L2 cache); from
    64 rows on, one program a token."""
    pieces = row_pieces(I)
    if sum(pieces) <= ONE_BLOCK_MAX:
        return SiluQuantLaunch(pieces, 0, 1, max(4, min(8, pieces[0] // 1024)))
    block = _block(I)
    return SiluQuantLaunch((0, 0, 0), block, 1 if T >= 64 else triton.cdiv(I, block), 8)


def row_pieces(I: int) -> tuple[int, int, int]:
    """I columns as up to three power-of-2 pieces, largest first: the two largest powers of 2 that fit
    (from 256 on), the rest rounded up to a power of 2 (only that last piece runs past I)."""
    pieces, rest = [], I
    while rest >= 256 and len(pieces) < 2:
        pieces.append(1 << (rest.bit_length() - 1))
        rest -= pieces[-1]
    if rest:
        pieces.append(triton.next_power_of_2(rest))
    return tuple(pieces + [0] * (3 - len(pieces)))


def _quant_launch(gate_up: torch.Tensor, h: Optional[torch.Tensor], eps: float,
                  launch: Optional[SiluQuantLaunch]) -> QuantizedRows:
    T, I2 = gate_up.shape
    I = I2 // 2
    q = torch.empty((T, I), dtype=torch.float8_e4m3fn, device=gate_up.device)
    qs = torch.empty((T, 1), dtype=torch.float32, device=gate_up.device)
    if T:
        lc = launch or quant_launch(T, I)
        _check_pieces(lc.pieces, I)
        hid = 1 if h is None else h.shape[1]
        pdl.launch(_silu_scaled_quant_kernel, (T, 1 if lc.pieces[0] else lc.per_token),
                   (gate_up, gate_up if h is None else h, q, qs, I, gate_up.stride(0),   # h None: not read
                    0 if h is None else h.stride(0), q.stride(0), float(eps)), gate_up.device,
                   HID=hid, HBLK=min(1024, triton.next_power_of_2(hid)), BLOCK=max(lc.block, 1),
                   B0=lc.pieces[0], B1=lc.pieces[1], B2=lc.pieces[2], MASK=sum(lc.pieces) != I,
                   ROW_SCALE=h is not None, PTX=gate_up.is_cuda, num_warps=lc.num_warps)
    return QuantizedRows(q, qs, gate_up.dtype)


def _check_pieces(pieces: tuple[int, int, int], I: int) -> None:
    # pieces cover the row, and only the last one may run past it (the others load unmasked)
    used = [b for b in pieces if b]
    bad = sum(used) < I or sum(used[:-1]) > I or any(b & (b - 1) for b in used)
    if used and (bad or pieces[len(used):] != (0,) * (3 - len(used))):
        raise ValueError(f"launch.pieces must be powers of 2 covering I = {I} (only the last past it), got {pieces}")


def _block(I: int) -> int:
    block = min(2048, triton.next_power_of_2(I))
    while block > 256 and I % block:    # no half-empty last block (Qwen3-0.6B: I = 3 x 1024)
        block //= 2
    return block
