"""The fp8 KV cache's arithmetic: e4m3 pages with one fp32 scale per tensor (K and V each).

``kv_cache_dtype="fp8_e4m3"`` stores k / k_scale rounded to e4m3 (saturating at +-448) and reads
back e4m3 * k_scale in the model dtype; the same for V. Scales are the checkpoint's per layer where it
has them (``models/kv_scales.py``), else 1.0: attention K/V of the supported models sit well inside
e4m3's range (the accuracy study, ``nbgen.bench.fp8_accuracy``, measures the effect). Half the bytes
of a bf16 page, so the pool holds twice the tokens. This is the reference the CUDA kernels are tested
against: the K/V writes (``kernels/kv_write.py``, ``kernels/qk_norm_rope.py``) store exactly these
bytes, and the attention kernels read e4m3 * scale.
"""
from __future__ import annotations

import torch

from nbgen.kernels.kv_write import quantize_torch

FP8 = torch.float8_e4m3fn


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for an EngineConfig ``kv_cache_dtype`` ("auto": the model dtype)."""
    if kv_cache_dtype == "fp8_e4m3":
        return FP8
    if kv_cache_dtype == "auto":
        return model_dtype
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {kv_cache_dtype!r}")


def is_fp8(dtype: torch.dtype) -> bool:
    """The pool stores e4m3 (needs ``store`` / ``load`` with a scale)."""
    return dtype == FP8


def store(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x (model dtype) as the pool's ``dtype``: divided by ``scale`` and rounded to e4m3 when fp8."""
    return quantize_torch(x, scale, dtype)     # the GPU K/V write kernels' arithmetic (kernels/kv_write.py)


def load(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Pool values as ``dtype`` (the model's): times ``scale`` when the pool is fp8."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """cache [H, slots, D][:, slots] = store(x [H, T, D]) (an fp8 pool is written through a byte view:
    torch's CPU index_copy_ has no float8 kernel)."""
    stored = store(x, scale, cache.dtype)
    if is_fp8(cache.dtype):
        cache.view(torch.uint8).index_copy_(1, slots, stored.view(torch.uint8))
    else:
        cache.index_copy_(1, slots, stored)
