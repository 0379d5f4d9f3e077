"""FP8 linears with an e4m3 weight and one fp32 scale per output feature (``quantization="fp8"`` on a
bf16 checkpoint; per-channel fp8 checkpoints) or per tensor (per-tensor fp8 checkpoints whose fused
parts share one scale), activations quantized at run time.

Weight: w ~ wq * sw[n]. Searched scales (``search_channel_scales``): e4m3 is a floating-point grid, so
where its points fall matters more than amax; of SCALE_STEPS scales spanning one octave above
amax / 448 (none clips), each output feature keeps the one with the least squared rounding error.
Activation: sa = max(amax(|x|), 1e-10) / 448 per token (IEEE divisions), xq = e4m3(clamp(x / sa, ±448)).
Then y = (xq @ wq.T in fp32) * sa[m] * sw[n] (+ bias), one rounding to the output dtype.

On CUDA (compute capability 8.9+), per step size and weight form:
- up to ``kernels.fp8_small_gemm.MAX_ROWS`` rows (decode), bf16 or fp16 activations: nbgen's streaming
  fp8 kernel (``kernels/fp8_small_gemm.py``, one row ``kernels/fp8_row_gemv.py``), which quantizes x
  itself with this recipe and applies both scales and the bias: one launch instead of cuBLAS's quantize +
  GEMM (+ scaling) launches; a folded gate|up at one row also applies SiLU-and-mul (``scaled_silu_mul``), and
  a qkv projection at one row runs with RoPE and the K/V write (``qkv_rope_usable``, ``kernels/fp8_qkv_rope.py``).
Otherwise with bf16 activations (``fp8_gemm_usable``), first ``kernels.fp8_quant.quant_rowwise`` (a folded
norm's column scale applied inside it), then cuBLAS (``torch._scaled_mm``):
- one weight scale, one row (batch-1 decode): the tensorwise GEMM with both 0-dim scales (bias in its
  epilogue): two launches, no epilogue kernel.
- up to ``TENSORWISE_MAX_ROWS`` rows, and every residual add into the stream (``scaled_accumulate``: a
  folded layer's o_proj / down_proj): the tensorwise GEMM with unit scales into fp32, then
  ``scale_output`` (sa[m] * sw[n] + bias, added into the stream in the same launch): three launches.
  cuBLAS's row-wise GEMM would take the scales itself but is slower than bf16 at a few rows and than
  this trio up to 64 rows, and with the residual add after it at every size (``nbgen.bench.fp8_kernels``).
- more rows otherwise: the row-wise GEMM (scale_a [M, 1], scale_b [1, N]), into the caller's buffer.
On this path a product may take its input already quantized (``kernels.fp8_quant.QuantizedRows``, where
``quantized_input_usable``), from the launch that made it: a folded layer's o_proj residual add quantizes
the updated stream for gate|up and its down_proj residual add for the next layer's qkv
(``scaled_accumulate_quantized``), its SiLU-and-mul writes down_proj's input as e4m3
(``kernels.silu_scaled.silu_mul_scaled_quant``), each the bytes the quantizer would give.
Elsewhere ``reference_matmul`` computes the same in fp32 torch (the reference the GPU tests compare
with), so tests and notebooks run these models anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import torch

from nbgen.kernels import fp8_qkv_rope, fp8_quant, fp8_row_gemv, fp8_small_gemm
from nbgen.kernels.fp8_quant import QuantizedRows
from nbgen.kernels.fp8_gemm import FP8_MAX, MIN_AMAX, usable as kernels_usable

FP8 = torch.float8_e4m3fn
SCALE_STEPS = 16            # candidate weight scales per octave (search_channel_scales)
TENSORWISE_MAX_ROWS = 64    # steps up to this many rows take the tensorwise GEMM (else the row-wise one)
Activation = Union[torch.Tensor, QuantizedRows]    # a product's input: rows, or rows already quantized


@dataclass
class Fp8ScaledWeight:
    """A linear's fp8 weight for cuBLAS: ``q`` [N, K] e4m3; ``scale_row`` [1, N] fp32 (W[n] ~ q[n] *
    scale_row[0, n]); ``scale`` the 0-dim scale when every feature has the same one, else None;
    ``unit`` a 0-dim 1.0 on the weight's device (the unit-scale GEMM's scales); ``col_scale`` [K] a
    folded norm's weight g (``models/norm_fold``): the linear's input is then x * g (the raw residual
    stream times g, in fp32), the norm's row factor applied after it."""

    q: torch.Tensor
    scale_row: torch.Tensor
    scale: Optional[torch.Tensor]
    unit: torch.Tensor
    col_scale: Optional[torch.Tensor] = None


def search_channel_scales(w: torch.Tensor) -> torch.Tensor:
    """Per output feature of w [N, K], the scale among amax / 448 * 2^(i / SCALE_STEPS), i < SCALE_STEPS,
    whose e4m3 rounding has the least squared error -> [N] fp32 (see the module docstring)."""
    wf = w.float()
    base = wf.abs().amax(dim=1).clamp(min=MIN_AMAX) / FP8_MAX
    best, best_err = base, None
    for i in range(SCALE_STEPS):
        s = base * 2 ** (i / SCALE_STEPS)
        err = ((wf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s[:, None] - wf).square().sum(1)
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


def quantize_weight(w: torch.Tensor, scale: Optional[torch.Tensor] = None) -> Fp8ScaledWeight:
    """w [N, K] -> its fp8 form. ``scale``: a checkpoint's (one value, or one per feature [N] / [N, 1]),
    with which its dequantized values round back to the stored e4m3 bytes; else searched per feature."""
    n = w.shape[0]
    s = search_channel_scales(w) if scale is None else scale.to(device=w.device, dtype=torch.float32)
    s = s.reshape(-1).expand(n).contiguous() if s.numel() == 1 else s.reshape(n).contiguous()
    q = (w.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    uniform = bool((s == s[0]).all()) if n else True
    return Fp8ScaledWeight(q, s.reshape(1, n), s[0].clone() if uniform and n else None,
                           torch.ones((), dtype=torch.float32, device=w.device))


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, sa [M, 1] fp32), in torch. Both divisions are tensor by tensor: torch
    divides by a Python number as a multiplication by its reciprocal, which the kernels do not."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX)
    sa = amax / torch.full_like(amax, FP8_MAX)
    return (xf / sa).clamp(-FP8_MAX, FP8_MAX).to(FP8), sa


def reference_matmul(xq: torch.Tensor, sa: torch.Tensor, w: Fp8ScaledWeight,
                     bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """The module docstring's y in fp32 torch (sa [M, 1]), rounded once to ``out_dtype``."""
    y = (xq.float() @ w.q.float().t()) * sa * w.scale_row
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@lru_cache(maxsize=None)
def _fp8_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_gemm_usable(x: torch.Tensor, w: Fp8ScaledWeight) -> bool:
    """cuBLAS's fp8 GEMM takes this product: the Triton quantizers run, compute capability 8.9+, a bf16
    activation (the row-wise GEMM writes bf16 only), K and N multiples of 16."""
    return _cublas_takes(x, w) and x.shape[1] % 16 == 0


def _cublas_takes(x: torch.Tensor, w: Fp8ScaledWeight) -> bool:
    # fp8_gemm_usable for x's rows (their device, dtype, layout), K checked on the weight
    return (kernels_usable(x) and x.dtype == torch.bfloat16 and _fp8_capable(x.device.index or 0)
            and w.q.shape[1] % 16 == 0 and w.q.shape[0] % 16 == 0)


def small_gemm_usable(x: torch.Tensor, w: Fp8ScaledWeight) -> bool:
    """The streaming fp8 kernel takes this product (a decode step's few rows on an fp8-capable GPU)."""
    return fp8_small_gemm.usable(x, w.q) and _fp8_capable(x.device.index or 0)


def quantized_input_usable(x: torch.Tensor, w: object) -> bool:
    """A product of rows like x's (their count, device, dtype, unit column stride; x may be any tensor of
    them) with ``w`` quantizes them in a launch of its own before cuBLAS, so it may take them as
    ``QuantizedRows`` instead (quantized for w: of x * w.col_scale where w has one)."""
    return (isinstance(w, Fp8ScaledWeight) and x.dim() == 2 and x.shape[0] > 0 and not small_gemm_usable(x, w)
            and _cublas_takes(x, w))


def scaled_accumulate(x: Activation, w: object, into: torch.Tensor, early_tiles: int = 1) -> bool:
    """into += x @ the fp8 weight (no bias), in place (the residual add of a folded layer's o_proj /
    down_proj): the streaming kernel's epilogue at a few rows, the GEMM's above -> True; False where
    neither takes it (never for ``QuantizedRows``, which only ``quantized_input_usable`` products get).
    ``early_tiles``: the one-row kernel's weight tiles before its PDL wait (``fp8_row_gemv``)."""
    if isinstance(x, QuantizedRows):
        if not isinstance(w, Fp8ScaledWeight) or into.dtype != x.dtype or not into.is_contiguous():
            raise ValueError("x: quantized rows need an fp8 weight and a contiguous stream of their dtype")
        _gemm(x.q, x.scale, w, None, x.dtype, out=into, accumulate=True)
        return True
    if not isinstance(w, Fp8ScaledWeight) or into.dtype != x.dtype or not into.is_contiguous():
        return False
    if small_gemm_usable(x, w):
        fp8_small_gemm.fp8_small_gemm(x, w.q, w.scale_row, col_scale=w.col_scale, accumulate=into,
                                      early_tiles=early_tiles)
        return True
    if not fp8_gemm_usable(x, w):
        return False
    xq, sa = fp8_quant.quant_rowwise(x, w.col_scale)
    _gemm(xq, sa, w, None, x.dtype, out=into, accumulate=True)
    return True


def scaled_accumulate_quantized(x: Activation, w: object, into: torch.Tensor,
                                then: object) -> Optional[QuantizedRows]:
    """``scaled_accumulate(x, w, into)`` whose residual-add launch also quantizes the updated rows of
    ``into`` for the product with ``then`` (a folded norm's linear: of into * then.col_scale) -> those
    rows, the bytes ``quant_rowwise`` would give; None where this fused path does not apply (nothing
    done: the caller adds and quantizes its own way). ``x`` may be rows quantized for w already."""
    quantized = isinstance(x, QuantizedRows)    # made for w's product (its maker checked it takes them)
    takes = isinstance(w, Fp8ScaledWeight) if quantized else quantized_input_usable(x, w) and x.shape[1] % 16 == 0
    if not (takes and quantized_input_usable(into, then) and then.col_scale is not None
            and into.dtype == x.dtype and into.is_contiguous() and into.shape[1] <= fp8_quant.ADD_QUANT_MAX_COLS):
        return None
    xq, sa = (x.q, x.scale) if quantized else fp8_quant.quant_rowwise(x, w.col_scale)
    acc = torch._scaled_mm(xq, w.q.t(), scale_a=w.unit, scale_b=w.unit, out_dtype=torch.float32)
    return fp8_quant.scale_add_quant(acc, sa, w.scale_row, into, then.col_scale)


def scaled_silu_mul(h: torch.Tensor, w: object, eps: float) -> Optional[torch.Tensor]:
    """A folded layer's gate|up at one row: silu(gate * r) * (up * r) [1, I] (r: the norm's row factor of
    h) from one launch of the one-row kernel (SiLU-and-mul in its epilogue), where it takes the product;
    None otherwise (the caller projects, then runs ``silu_mul_scaled``)."""
    if not isinstance(w, Fp8ScaledWeight) or w.col_scale is None or h.shape[0] != 1 or not small_gemm_usable(h, w):
        return None
    y = h.new_empty((1, w.q.shape[0] // 2))
    return fp8_row_gemv.fp8_row_gemv(h, w.q, w.scale_row, y, col_scale=w.col_scale, silu_eps=eps)


def qkv_rope_usable(x: torch.Tensor, w: object, head_dim: int) -> bool:
    """A qkv projection of one row with this weight may take the fused qkv + RoPE kernel
    (``kernels/fp8_qkv_rope.py``): the per-feature form where the one-row kernel serves it, whole heads."""
    return (isinstance(w, Fp8ScaledWeight) and x.shape[0] == 1 and small_gemm_usable(x, w)
            and fp8_qkv_rope.usable(x, w.q, head_dim))


def scaled_linear(x: Activation, w: Fp8ScaledWeight, bias: Optional[torch.Tensor] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (model dtype, or ``QuantizedRows`` for w) @ the fp8 weight -> [M, N] in x's dtype (see
    the module docstring), into ``out`` when given. Graph-capturable: every scale stays on the device."""
    if isinstance(x, QuantizedRows):
        return _gemm(x.q, x.scale, w, bias.to(x.dtype) if bias is not None else None, x.dtype, out=out)
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, w.q.shape[0])) if out is None else out
    if small_gemm_usable(x, w):
        y = fp8_small_gemm.fp8_small_gemm(x, w.q, w.scale_row, bias, col_scale=w.col_scale)
    elif not fp8_gemm_usable(x, w):
        xs = x if w.col_scale is None else x.float() * w.col_scale.float()     # a folded norm's weight
        xq, sa = quantize_activation(xs)
        y = reference_matmul(xq, sa, w, bias, x.dtype)
    else:
        xq, sa = fp8_quant.quant_rowwise(x, w.col_scale)
        return _gemm(xq, sa, w, bias.to(x.dtype) if bias is not None else None, x.dtype, out=out)
    return y if out is None else out.copy_(y)


def _gemm(xq: torch.Tensor, sa: torch.Tensor, w: Fp8ScaledWeight, bias: Optional[torch.Tensor],
          dtype: torch.dtype, out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """y = xq @ w scaled (+ bias) in ``dtype`` through cuBLAS (see the module docstring), into ``out`` when
    given (added into it with ``accumulate``, which needs unit column stride)."""
    m = xq.shape[0]
    if m == 1 and w.scale is not None and not accumulate:     # both scales 0-dim: no epilogue launch
        return _into(torch._scaled_mm(xq, w.q.t(), scale_a=sa.reshape(()), scale_b=w.scale, bias=bias,
                                      out_dtype=dtype), out)
    if accumulate or m <= TENSORWISE_MAX_ROWS:
        acc = torch._scaled_mm(xq, w.q.t(), scale_a=w.unit, scale_b=w.unit, out_dtype=torch.float32)
        direct = out if out is not None and out.stride(1) == 1 else None     # accumulate: always direct
        y = fp8_quant.scale_output(acc, sa, w.scale_row, bias, dtype, out=direct, accumulate=accumulate)
        return y if direct is not None else _into(y, out)
    if out is not None and bias is None and out.is_contiguous():
        return torch._scaled_mm(xq, w.q.t(), scale_a=sa, scale_b=w.scale_row, out_dtype=dtype, out=out)
    y = torch._scaled_mm(xq, w.q.t(), scale_a=sa, scale_b=w.scale_row, out_dtype=dtype)
    return _into(y if bias is None else y.add_(bias), out)


def _into(y: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    return y if out is None else out.copy_(y)
