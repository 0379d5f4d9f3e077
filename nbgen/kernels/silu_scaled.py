"""SiLU-and-mul of a folded norm's gate|up projection, with the norm's row scale, as one Triton kernel.

With the post-attention RMSNorm folded into gate|up (``nbgen.models.norm_fold``) the projection reads
the raw residual stream h, so gate and up still need each row's rsqrt(mean(h^2) + eps): this kernel
applies it, rounds gate and up to the model dtype (as the projection of the normed stream is
rounded) and computes silu(gate) * up. ``rms_scale`` is the same row scale in torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nbgen.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the torch path
    triton = None


def rms_scale(h: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, 1] fp32: rsqrt(mean(h^2) + eps) per row, as RMSNorm computes it."""
    return torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)


if triton is not None:
    from nbgen.kernels.qk_norm_rope import rnd, row_rms_scale

    @triton.jit
    def _silu_scaled_kernel(x_ptr, h_ptr, y_ptr, I, sx, sh, sy, eps, HID: tl.constexpr, HBLK: tl.constexpr,
                            BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
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
            g = tl.load(x_ptr + t * sx + offs, mask=m, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + t * sx + I + offs, mask=m, other=0.0).to(tl.float32)
            # gate and up rounded to the model dtype (the normed stream's projection), then SiLU-and-mul
            g = rnd(g * s, dt)
            u = rnd(u * s, dt)
            tl.store(y_ptr + t * sy + offs, (g / (1.0 + tl.exp(-g)) * u).to(dt), mask=m)


def silu_mul_scaled(gate_up: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """gate_up [T, 2I] projected from the un-normed stream h [T, H] -> [T, I] = silu(gate * s) * (up * s),
    s = rms_scale(h, eps) (one Triton kernel on CUDA, torch elsewhere)."""
    T, I2 = gate_up.shape
    I = I2 // 2
    if triton is None or not gate_up.is_cuda or gate_up.stride(1) != 1 or h.stride(1) != 1:
        s = rms_scale(h, eps)
        gate, up = (gate_up.float() * s).to(gate_up.dtype).chunk(2, dim=-1)
        return F.silu(gate) * up
    y = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return y
    block = min(2048, triton.next_power_of_2(I))
    while block > 256 and I % block:    # no half-empty last block (Qwen3-0.6B: I = 3 x 1024)
        block //= 2
    hid = h.shape[1]
    # decode sizes: a program per block (a short kernel); from 1 024 tokens on, one program a token
    # loops over the blocks and reads its row of h once (prefill: ~1/3 less traffic for Qwen3-0.6B)
    pdl.launch(_silu_scaled_kernel, (T, triton.cdiv(I, block) if T < 1024 else 1),
               (gate_up, h, y, I, gate_up.stride(0), h.stride(0), y.stride(0), float(eps)), gate_up.device,
               HID=hid, HBLK=min(1024, triton.next_power_of_2(hid)), BLOCK=block,
               num_warps=4 if block <= 1024 else 8)
    return y
