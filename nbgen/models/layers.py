"""Building blocks shared by the model families: RMSNorm, SiLU-and-mul, rotary embedding.

Each op that a fused GPU kernel may replace (add+RMSNorm, SiLU-and-mul, RoPE) is one module call,
so a GPU backend can swap a kernel in at a single place. The parallel linears and embeddings live
in ``nbgen.models.linear`` and are re-exported here.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from nbgen.kernels import cpu_ops  # nbgen's C kernels on the CPU (when a compiler built them)
from nbgen.kernels import gpu_ops  # fused flashinfer kernels on CUDA (switched on by the runner)
from nbgen.models.linear import (  # noqa: F401  (re-exported: one import site for model files)
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from nbgen.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding  # noqa: F401  (re-exported)


def fused_ops(x: torch.Tensor) -> Any:
    """The fused-kernel module serving ``x`` (flashinfer's on CUDA, nbgen's C kernels on the CPU),
    or None for plain torch. Both offer rmsnorm, add_rmsnorm, silu_and_mul and rope_inplace."""
    if gpu_ops.fused_enabled(x):
        return gpu_ops
    if cpu_ops.fused_enabled(x):
        return cpu_ops
    return None


class RMSNorm(nn.Module):
    """RMSNorm with HF numerics (normalise in fp32, cast back, then scale); optional fused residual add.

    ``forward(x)`` -> normed; ``forward(x, residual)`` -> (norm(x + residual), x + residual).
    The add happens in the input dtype, exactly as HF decoder layers add their residuals.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or x.device.type == "cpu":
            # one fused kernel (fp32 math inside); in fp32 it equals HF's formula below
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        ops = fused_ops(x)
        if ops is not None:  # one kernel (in place on x and residual)
            if residual is None:
                return ops.rmsnorm(x, self.weight, self.eps)
            return ops.add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SiluAndMul(nn.Module):
    """[T, 2*I] (gate | up) -> [T, I]: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x)
        if ops is not None:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_settings(config: Any) -> tuple[float, Optional[dict]]:
    """(rope_theta, scaling dict or None) from an HF config, old style (rope_theta + rope_scaling)
    or transformers-5 style (rope_parameters with rope_theta inside)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        params = {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    theta = 10000.0 if theta is None else float(theta)
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = None if kind in (None, "default") else {**params, "rope_type": kind}
    return theta, scaling


def _inv_freq(head_dim: int, base: float, scaling: Optional[dict]) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, following HF's rope init functions."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Applies RoPE (HF rotate_half convention) to flat q [T, Hq*D] and k [T, Hkv*D] at `positions` [T]."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: Optional[dict]) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv = _inv_freq(head_dim, base, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
        # [max_position, D] = cos of the D/2 frequencies | sin of them, fp32 like HF computes them
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)
        self._last: Optional[tuple] = None   # ((positions, dtype), (cos, sin)) of the current step

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        x = x.view(T, -1, self.head_dim)                      # [T, H, D]
        x1, x2 = x.chunk(2, dim=-1)                           # [T, H, D/2] each
        # == x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), in x's dtype as HF does it
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.view(T, -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = fused_ops(q)
        if ops is not None:  # in place, cos/sin read from the same fp32 cache
            return ops.rope_inplace(positions, q, k, self.head_dim, self.cos_sin_cache)
        cos, sin = self._cos_sin(positions, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] at positions; all layers of a step share one positions tensor, so the
        lookup is done once per step (kept only for that tensor object)."""
        key = (positions, dtype)
        if self._last is None or self._last[0][0] is not positions or self._last[0][1] != dtype:
            cs = self.cos_sin_cache.index_select(0, positions).to(dtype)    # [T, D]
            half = self.head_dim // 2
            self._last = (key, (cs[:, None, :half], cs[:, None, half:]))
        return self._last[1]


def get_rope(head_dim: int, max_position: int, base: float,
             rope_scaling: Optional[dict] = None) -> RotaryEmbedding:
    """A rotary embedding for `head_dim`, cached for positions [0, max_position)."""
    return RotaryEmbedding(head_dim, max_position, base, rope_scaling)
