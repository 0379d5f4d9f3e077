"""The Qwen2(.5)-VL vision tower's elementwise ops: one Triton kernel each on CUDA, torch elsewhere.

- ``rope_2d_``: the tower's 2-D rotary (NeoX halves, per-patch cos/sin of its row and column) applied in
  place to the q and k heads of the fused qkv projection, in fp32 and rounded once to the model dtype,
  as HF computes it (torch: several full fp32 passes over q and k per layer).
- ``silu_and_mul``: silu(gate) * up of a fused gate|up projection [N, 2I] with HF's rounding (the SiLU
  rounded to the model dtype before the product), for any I (flashinfer's vector loads need I % 8 == 0;
  Qwen2.5-VL's tower has I = 3420).

The ``*_triton`` launchers take any tensors Triton can address (CPU ones under ``TRITON_INTERPRET=1``, as
the tests run them); the dispatchers use them for CUDA tensors only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the torch path
    triton = None


def rope_2d_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by cos, sin [N, D/2] fp32 (NeoX halves), fp32 math, result in x.dtype (HF's)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> [N, I]: silu(gate) * up, each op rounded to x.dtype as HF's two torch ops are."""
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


if triton is not None:
    @triton.jit
    def _rope_2d_kernel(x_ptr, cos_ptr, sin_ptr, sx, sc, NH, HALF, BH: tl.constexpr, BD: tl.constexpr):
        # program t: token t's NH heads (q then k, adjacent in the qkv row) as one [BH, BD] tile per half
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)[:, None]
        d = tl.arange(0, BD)[None, :]
        dm = d < HALF
        m = (h < NH) & dm
        c = tl.load(cos_ptr + t * sc + d, mask=dm, other=0.0)
        s = tl.load(sin_ptr + t * sc + d, mask=dm, other=0.0)
        p = x_ptr + t * sx + h * (2 * HALF) + d
        x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
        dt = x_ptr.dtype.element_ty
        tl.store(p, (x1 * c - x2 * s).to(dt), mask=m)
        tl.store(p + HALF, (x2 * c + x1 * s).to(dt), mask=m)

    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, I, sx, sy, BLOCK: tl.constexpr):
        # program (t, j): columns [j * BLOCK, (j + 1) * BLOCK) of token t
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < I
        dt = y_ptr.dtype.element_ty
        g = tl.load(x_ptr + t * sx + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * sx + I + offs, mask=m, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)          # F.silu's result in the model dtype
        tl.store(y_ptr + t * sy + offs, (a * u).to(dt), mask=m)


def rope_2d_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """In place on qkv [N, 3 * heads * head_dim] (q | k | v): q and k rotated by cos, sin [N, D/2] fp32."""
    N = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and cos.stride(0) == sin.stride(0) and cos.dtype == torch.float32
    if N == 0:
        return
    half = head_dim // 2
    _rope_2d_kernel[(N,)](qkv, cos, sin, qkv.stride(0), cos.stride(0), 2 * heads, half,
                          BH=triton.next_power_of_2(2 * heads), BD=triton.next_power_of_2(half))


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> [N, I] (one kernel)."""
    N, I2 = x.shape
    I = I2 // 2
    assert x.stride(1) == 1
    y = torch.empty((N, I), dtype=x.dtype, device=x.device)
    if N:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(N, triton.cdiv(I, block))](x, y, I, x.stride(0), y.stride(0), BLOCK=block)
    return y


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def rope_2d_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """In place on the q and k heads of qkv [N, 3 * heads * head_dim]; cos, sin [N, head_dim / 2] fp32."""
    if _use_triton(qkv) and qkv.stride(1) == 1:
        rope_2d_triton(qkv, cos, sin, heads, head_dim)
        return
    qk = qkv.view(qkv.shape[0], 3, heads, head_dim)[:, :2].flatten(1, 2)     # [N, 2H, D] view
    qk.copy_(rope_2d_ref(qk, cos, sin))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> [N, I] = silu(gate) * up."""
    if _use_triton(x) and x.stride(1) == 1:
        return silu_mul_triton(x)
    return silu_and_mul_ref(x)
