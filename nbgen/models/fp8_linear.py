"""FP8 linears: the two weight forms and ``quantize_linears``, which turns every projection of a loaded
model (q|k|v, o, gate|up, down; not the embedding or the LM head) into one of them:
- one scale per output feature (``models/fp8_scaled.py``, cuBLAS's fp8 GEMM): ``quantization="fp8"``
  on a bf16 checkpoint (searched per-feature scales), and fp8 checkpoints scaled per tensor or per
  channel (fused q|k|v and gate|up parts stack their scales row by row).
- 1x128 groups (this module, ``kernels/fp8_gemm.py``): checkpoints with ``weight_block_size`` blocks,
  whose scales vary along the input columns (a per-feature GEMM scale cannot apply them).
Either way a checkpoint's scales (expanded onto 1x128 groups by ``fp8_checkpoint``) round its
dequantized values back to the stored e4m3 bytes: they are kept as they are, not requantized.

The group form follows.

Why 1x128: fused projections (q|k|v, gate|up) stack checkpoints' rows at any offset and tensor
parallelism splits rows anywhere, which row-wise groups survive and 128x128 blocks do not; SGLang's
block-fp8 activations and DeepSeek-style 128x128 checkpoints share its 128-column groups; the scales
add 1/32 of a byte per weight byte read; and ``torch._scaled_mm`` knows the recipe ("1x128 x 1x128").

The weight scales are the checkpoint's, expanded per 128 columns. Activations, quantized at run time by
the kernels, use amax: sx[m, g] = max(amax(|x[m, g*128:(g+1)*128]|), 1e-10) / 448 and xq = round_e4m3(x / sx).
Then y = sum_g (xq_g @ wq_g.T) * sx_g * sw_g (+ bias) in fp32, rounded once to the output dtype. On CUDA
``kernels.fp8_gemm`` computes it; on the CPU ``reference_matmul`` does in fp32 torch (the reference the
GPU kernels are tested against), so tests and notebooks run fp8 models anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from nbgen.kernels import fp8_gemm
from nbgen.models.fp8_scaled import Activation, Fp8ScaledWeight, QuantizedRows, quantize_weight, scaled_linear

FP8 = torch.float8_e4m3fn
FP8_MAX = fp8_gemm.FP8_MAX
GROUP = fp8_gemm.GROUP


@dataclass
class Fp8Weight:
    """A linear's quantized weight: ``q`` [N, K] e4m3 and ``scale`` [N, ceil(K / 128)] fp32
    (W[n, k] ~ q[n, k] * scale[n, k // 128])."""

    q: torch.Tensor
    scale: torch.Tensor


def expand_groups(scale: torch.Tensor, k: int) -> torch.Tensor:
    """Group scales [R, G] -> one value per column [R, k] (the dequantization's multiplier)."""
    return scale.repeat_interleave(GROUP, dim=1)[:, :k]


def quantize_groups(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (q [R, K] e4m3, scale [R, ceil(K / 128)] fp32), x ~ q * scale per 1x128 group.
    ``scale`` given: round with those scales (a checkpoint's), else amax / 448 per group."""
    xf = x.float()
    if scale is None:
        pad = (-xf.shape[1]) % GROUP
        groups = nn.functional.pad(xf, (0, pad)).view(xf.shape[0], -1, GROUP)
        scale = groups.abs().amax(dim=-1).clamp(min=fp8_gemm.MIN_AMAX) / FP8_MAX
    q = (xf / expand_groups(scale, xf.shape[1])).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.float().contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of group-quantized q [R, K] (scale [R, G])."""
    return q.float() * expand_groups(scale, q.shape[1])


def reference_matmul(xq: torch.Tensor, sx: torch.Tensor, w: Fp8Weight,
                     bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """The module docstring's y in fp32 torch (xq [M, K] e4m3, sx [M, G]), rounded once to ``out_dtype``."""
    y = dequantize(xq, sx) @ dequantize(w.q, w.scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear(x: Activation, w: Union[Fp8Weight, Fp8ScaledWeight],
               bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (model dtype; quantized rows for the per-feature form only) @ the fp8 weight (either
    form) -> [M, N] in x's dtype (into ``out``)."""
    if isinstance(w, Fp8ScaledWeight):
        return scaled_linear(x, w, bias, out=out)
    if isinstance(x, QuantizedRows):
        raise ValueError("x: quantized rows need a per-feature fp8 weight (Fp8ScaledWeight)")
    if fp8_gemm.usable(x):
        y = fp8_gemm.fp8_group_gemm(x, None, w.q, w.scale, bias, x.dtype)
    else:
        xq, sx = quantize_groups(x)
        y = reference_matmul(xq, sx, w, bias, x.dtype)
    return y if out is None else out.copy_(y)


def scale_bytes(w: Union[Fp8Weight, Fp8ScaledWeight]) -> int:
    """Bytes of a weight's scales a GEMM reads (the bandwidth floor counts them)."""
    s = w.scale_row if isinstance(w, Fp8ScaledWeight) else w.scale
    return s.numel() * s.element_size()


QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_linears(model: nn.Module, scales: Optional[dict[str, torch.Tensor]] = None) -> int:
    """Quantize every decoder projection (``QUANTIZED_PROJECTIONS``) of a loaded model in place: each
    linear's weight parameter becomes its e4m3 copy (1 byte per value) and the linear gets ``fp8``,
    which its forward takes. ``scales``: module name -> [N, G] group scales an fp8 checkpoint gave
    (its weights, loaded as values, are rounded back with them: the checkpoint's own e4m3 values);
    the same scale on every group of a row gives the per-feature form, else the group form.
    Returns how many linears were quantized."""
    n = 0
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] not in QUANTIZED_PROJECTIONS or not hasattr(m, "fp8"):
            continue
        w = m.weight.data
        given = (scales or {}).get(name)
        if given is None or bool((given == given[:, :1]).all()):
            fp8 = quantize_weight(w, given[:, 0] if given is not None else None)
        else:
            fp8 = Fp8Weight(*quantize_groups(w, given.to(w.device)))
        m.weight.data = fp8.q        # the bf16 copy is released; the parameter now reads as e4m3
        m.fp8 = fp8
        n += 1
    return n
