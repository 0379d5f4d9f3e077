"""4-bit weights on the CPU for decode steps of a few rows: weights that lie on a 4-bit grid (groups
of 32 along the input, each with a scale and a minimum, as GGUF Q4_1 / Q4_0 store them) keep a
packed int4 copy, read by nbgen's VNNI kernel (``cpu_q4.q4_gemv``: activations quantized to int16 per
group of 32, integer dot products) where the CPU has AVX512-VNNI, else by
torch's ``_weight_int4pack_mm_for_cpu`` (which widens every nibble to fp32: compute-bound at one row,
and ~10-20 % slower than the VNNI kernel on one core of a Zen 4 VM).

A batch-1 decode step reads every weight once and does little arithmetic with it, so its time is the
weight bytes over the memory bandwidth: 4.5 bits a weight instead of 16 (measured on a 2-core AVX-512
machine, 30 rotating copies so nothing stays cached: 3072 x 576 in 54 us against 170 us for the
oneDNN bf16 matmul, the 30 layers of SmolLM2-135M in ~3.5 ms against ~9.5 ms). At 8 rows and more the
int4 kernel loses (it dequantises per row block), so bigger steps keep the bf16 path: ``use_int4``.

Detection instead of a GGUF reader (``cpu_ops.q4_grid``, one pass in C): a GGUF loads dequantized (``gguf_convert``), and a weight whose
every group of 32 is ``lo + d * q`` with integer q in [0, 15] (its minimum at q = 0, its maximum at
15: how the Q4_1 quantizer sets them) gives back the same q, d and lo from its values. A weight that
does not reconstruct within bf16 rounding stays bf16 only. torch's format is ``(q - 8) * s + z``
per group: s = d, z = lo + 8 d, kept in the activations' dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nbgen.kernels import cpu_ops, cpu_q4

GROUP = 32
MAX_ROWS = 4          # steps of more rows use the bf16 matmul (see the module docstring)
# a reconstruction error below this share of the group's range is bf16 rounding, not an off-grid weight
_TOL = 2.0 ** -7


@dataclass
class Int4Weight:
    """A packed int4 copy of a [N, K] weight: nbgen's nibble layout (``nib``, ``d``, ``m``) or torch's int4
    layout (``packed``, ``scale_zeros``); the other pair is None."""
    dtype: torch.dtype                          # the activations' dtype it serves
    nib: Optional[torch.Tensor] = None          # [N, K / 2] uint8 (cpu_q4.q4_gemv's layout)
    d: Optional[torch.Tensor] = None            # [N, K / GROUP] fp16 scale per group
    m: Optional[torch.Tensor] = None            # [N, K / GROUP] fp16 minimum per group
    packed: Optional[torch.Tensor] = None       # _convert_weight_to_int4pack_for_cpu output
    scale_zeros: Optional[torch.Tensor] = None  # [K / GROUP, N, 2]: (scale, zero) per group, activations' dtype


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int32 in [0, 15] -> [N, K / 2] uint8: per group of 32, byte i = q[i] | q[i + 16] << 4."""
    n, k = q.shape
    q4 = q.view(n, k // GROUP, 2, GROUP // 2).to(torch.uint8)
    return (q4[:, :, 0] | (q4[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def available() -> bool:
    """torch has the CPU int4 kernels and nbgen's C kernels (the grid detection) are built."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch, "_convert_weight_to_int4pack_for_cpu") and cpu_ops.available()


@torch.no_grad()
def from_grid(w: torch.Tensor) -> Optional[Int4Weight]:
    """The int4 copy of a bf16 CPU weight [N, K] whose groups of 32 lie on a 4-bit grid, else None."""
    if not available() or w.dim() != 2 or w.dtype != torch.bfloat16 or w.shape[1] % GROUP:
        return None
    found = cpu_ops.q4_grid(w, _TOL)
    if found is None:
        return None
    q, sz = found                                               # w = (q - 8) * s + z per group
    if cpu_q4.q4_vnni() and w.shape[1] % (2 * GROUP) == 0 and w.shape[1] <= cpu_q4.MAX_K:
        s, z = sz[..., 0].t(), sz[..., 1].t()                   # [N, K / GROUP]
        nib, d, m = _nibbles(q), s.half().contiguous(), (z - 8 * s).half().contiguous()
        cpu_q4.check_weight(nib, d, m)
        return Int4Weight(w.dtype, nib=nib, d=d, m=m)
    return Int4Weight(w.dtype, packed=torch._convert_weight_to_int4pack_for_cpu(q, 2), scale_zeros=sz.to(w.dtype))


def use_int4(x: torch.Tensor, q: Optional[Int4Weight]) -> bool:
    """This matmul takes the int4 path: a copy exists and the step has at most MAX_ROWS rows."""
    return q is not None and x.shape[0] <= MAX_ROWS and x.dtype == q.dtype


def int4_linear(x: torch.Tensor, q: Int4Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ W.T (+ b) from the int4 copy -> [M, N]."""
    if q.nib is not None:
        x = x if x.stride(-1) == 1 else x.contiguous()
        if x.shape[0] <= cpu_q4.MAX_ROWS:
            y = cpu_q4.q4_gemv(x, q.nib, q.d, q.m)
        else:                                                   # MAX_ROWS rows a call
            y = torch.cat([cpu_q4.q4_gemv(x[i:i + cpu_q4.MAX_ROWS], q.nib, q.d, q.m)
                           for i in range(0, x.shape[0], cpu_q4.MAX_ROWS)])
    else:
        y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), q.packed, GROUP, q.scale_zeros)
    return y + bias if bias is not None else y
