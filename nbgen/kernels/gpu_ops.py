"""Fused GPU kernels for the model's hot ops, behind one switch.

``nbgen.models.layers`` calls ``fused_enabled(x)`` at its existing call sites (RMSNorm, add+RMSNorm,
SiLU-and-mul, RoPE): on CUDA tensors with the switch on, a fused kernel runs — nbgen's Triton norms and
SiLU-and-mul (``triton_norm``: they compile in under a second, where flashinfer's JIT modules for them
take 5-35 s on a host with an empty cache), flashinfer's RoPE; otherwise the torch code runs (CPU,
reference).

The switch belongs to the calling thread. An engine's loop thread builds, captures and runs its model, and
the engine's setup sets that thread's switch with its attention backend (on with flashinfer, off with the
torch backend on CUDA), so engines of one process do not change each other's kernels: a torch-backend
engine started beside a bf16 flashinfer engine leaves the latter's fused ops on.
"""
from __future__ import annotations

import threading

import torch

from nbgen.kernels import triton_norm

_fi_norm = _fi_act = _fi_rope = None


class _Switch(threading.local):
    on = False      # a thread that never set it: off


_SWITCH = _Switch()


def enable_fused(on: bool = True) -> bool:
    """Turn the fused kernels on (if flashinfer imports) or off for the calling thread; returns the
    resulting state."""
    global _fi_norm, _fi_act, _fi_rope
    if on and _fi_norm is None:
        try:
            import flashinfer.activation as act
            import flashinfer.norm as norm
            import flashinfer.rope as rope
        except ImportError:
            on = False
        else:
            _fi_norm, _fi_act, _fi_rope = norm, act, rope
    _SWITCH.on = bool(on)
    return _SWITCH.on


HALF = (torch.bfloat16, torch.float16)


def fused_enabled(x: torch.Tensor) -> bool:
    """True when ``x`` should go through a fused kernel: a half-precision CUDA tensor, the calling thread's
    switch on (the kernels take bf16 / fp16 only, so an fp32 model on the same thread stays on torch)."""
    return _SWITCH.on and x.is_cuda and x.dtype in HALF


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape) -> same shape."""
    if triton_norm.supported(x) and x.dim() in (2, 3):
        return triton_norm.rms_norm(x, weight, eps)
    if x.dim() == 3 and x.stride(-1) == 1:
        # per-head norm (Qwen3 q/k norm) on a strided [T, H, D] view of the qkv projection: flashinfer's
        # QK-RMSNorm takes both strides, so no copy to contiguous first; the output is contiguous
        return _fi_norm.rmsnorm(x, weight, eps)
    shape = x.shape
    out = _fi_norm.rmsnorm(x.reshape(-1, shape[-1]).contiguous(), weight, eps)
    return out.view(shape)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), computed in place in one kernel (x and residual are scratch)."""
    if not (x.is_contiguous() and residual.is_contiguous()):
        x, residual = x.contiguous(), residual.contiguous()
    if triton_norm.supported(x) and x.dim() == 2:
        triton_norm.add_rms_norm_(x, residual, weight, eps)
        return x, residual
    _fi_norm.fused_add_rmsnorm(x, residual, weight, eps)
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up in one kernel."""
    x = x.contiguous()
    if triton_norm.supported(x) and x.dim() == 2:
        return triton_norm.silu_and_mul(x)
    return _fi_act.silu_and_mul(x)


def rope_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style RoPE (HF rotate_half) on q [T, Hq*D], k [T, Hkv*D] from a [max_pos, D] fp32 cos|sin cache."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    _fi_rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, cos_sin_cache, is_neox=True)
    return q, k

