"""FP8 linears: e4m3 weights with one fp32 scale per output feature, activations quantized per token.

``quantize_linears`` turns every projection of a loaded model (q|k|v, o, gate|up, down; not the
embedding or the LM head) into this form: ``quantization="fp8"`` on a bf16 checkpoint, and fp8
checkpoints, whose weights arrive dequantized (``fp8_checkpoint``) and are quantized back per output
feature here (exact for per-channel checkpoints; per-tensor scales become per-row scales, at least as
fine; block-wise [128, 128] scales are merged to the row's largest value, which the accuracy study
bounds).

The arithmetic, on every device: the activation rows x [M, K] are scaled per token to the e4m3 range
(sx = amax(|x_row|) / 448), the weight [N, K] holds wq = round_e4m3(W / sw) with sw = amax(|W_row|) / 448,
and y = (xq @ wq.T) * sx * sw (+ bias), products summed in fp32. On CUDA the sum runs on tensor cores
through ``torch._scaled_mm`` with row-wise scales (large M) or in ``kernels.fp8_gemv`` (decode sizes);
on the CPU ``reference_matmul`` computes it in fp32 torch (the reference the GPU kernels are tested
against), so tests and notebooks run fp8 models anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from nbgen.kernels import fp8_gemv

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3fn value
_MIN_SCALE = 1e-12       # an all-zero row keeps a finite scale


@dataclass
class Fp8Weight:
    """A linear's quantized weight: ``q`` [N, K] e4m3 and ``scale`` [N] fp32 (W ~ q * scale[:, None])."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of x [R, K] -> (q [R, K] e4m3, scale [R] fp32), x ~ q * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=_MIN_SCALE) / FP8_MAX
    q = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def reference_matmul(xq: torch.Tensor, sx: torch.Tensor, w: Fp8Weight,
                     bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """(xq @ w.q.T) * sx[:, None] * w.scale[None, :] (+ bias) in fp32 torch, rounded once to ``out_dtype``."""
    y = (xq.float() @ w.q.float().t()) * sx[:, None] * w.scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _scaled_mm(xq: torch.Tensor, sx: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor],
               out_dtype: torch.dtype) -> torch.Tensor:
    # cuBLASLt row-wise scaling (sm89+): scale_a [M, 1], scale_b [1, N] fp32; b must be column-major
    # ([K, N] as the transposed view of the row-major [N, K] weight). bf16 output only for row-wise.
    y = torch._scaled_mm(xq, w.q.t(), scale_a=sx[:, None], scale_b=w.scale[None, :],
                         out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias
    return y.to(out_dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (model dtype) @ the fp8 weight -> [M, N] in x's dtype (see the module docstring)."""
    if fp8_gemv.usable(x):   # decode sizes: one launch, x quantized inside the kernel
        return fp8_gemv.fp8_gemv(x, None, w.q, w.scale, bias, x.dtype)
    xq, sx = quantize_rows(x)
    if not x.is_cuda:
        return reference_matmul(xq, sx, w, bias, x.dtype)
    if x.shape[0] == 0:
        return x.new_empty((0, w.q.shape[0]))
    if xq.shape[1] % 16 or w.q.shape[0] % 16:   # cuBLASLt fp8 needs both dims in multiples of 16
        return reference_matmul(xq, sx, w, bias, x.dtype)
    return _scaled_mm(xq, sx, w, bias, x.dtype)


QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_linears(model: nn.Module) -> int:
    """Quantize every decoder projection (``QUANTIZED_PROJECTIONS``) of a loaded model in place: each
    linear's weight parameter becomes its e4m3 copy (1 byte per value) and the linear gets ``fp8``,
    which its forward takes. Returns how many linears were quantized."""
    n = 0
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] not in QUANTIZED_PROJECTIONS or not hasattr(m, "fp8"):
            continue
        w = m.weight.data
        q, scale = quantize_rows(w)
        m.weight.data = q            # the bf16 copy is released; the parameter now reads as e4m3
        m.fp8 = Fp8Weight(q, scale)
        n += 1
    return n
