"""Folded RMSNorms: a Llama-family decoder layer without its two norm launches (CUDA, bf16).

At decode sizes a layer's add+RMSNorm kernels are mostly fixed cost (~2.7 us each at 128 rows on an
H100, 56 launches a step for Qwen3-0.6B, ~150 us of a ~4.5 ms step). Row by row,

    RMSNorm(h) @ W.T = (h @ (W * g).T) * rsqrt(mean(h^2) + eps)        (g: the norm weight)

so with g folded into the columns of the projection after the norm (once, after loading), that
projection reads the raw residual stream h, and the row scale is applied by the kernel that follows
it anyway: the q/k norm + RoPE kernel scales q, k, v (``qk_norm_rope_(row_scale=)``), and the
SiLU-and-mul here scales gate and up. The residual adds move into the projections before them:
o_proj and down_proj accumulate into h (cuBLAS ``addmm_`` with beta = 1, or the streaming kernel's
epilogue at a few rows). A layer then runs qkv, RoPE, attention, o_proj, gate|up, SiLU, down.

Numerics: g * W is rounded to the model dtype once; q/k/v and gate/up are the raw projections rounded,
scaled in fp32 and rounded again; each residual add rounds once instead of twice. Results stay within
bf16 noise of the unfolded layer (tests/test_norm_fold.py, GPU parity in tests/test_gpu.py), not bit
identical. Only bf16 weights are folded (fp16's range is too narrow for the raw stream's
projections), and only layers without biases, at tp_size 1. ``NBGEN_FOLD_NORM=0`` keeps the norms.
"""
from __future__ import annotations

import os
import torch
import torch.nn.functional as F

from nbgen.models.linear import get_tp
from nbgen.kernels import pdl

FOLD = os.environ.get("NBGEN_FOLD_NORM", "1") != "0"

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the torch path
    triton = None


def rms_scale(h: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, 1] fp32: rsqrt(mean(h^2) + eps) per row, as RMSNorm computes it."""
    return torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)


def foldable(model: torch.nn.Module) -> bool:
    """The model's layers can run folded: Llama-family decoder layers (``folded`` attribute), bf16 or
    fp32 weights, no q/k/v, o, gate|up or down biases, one tensor-parallel rank."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or get_tp()[0] != 1:
        return False
    for layer in layers:
        if not hasattr(layer, "folded"):
            return False
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(m.bias is not None for m in linears) or \
                attn.qkv_proj.weight.dtype not in (torch.bfloat16, torch.float32):
            return False
    return True


@torch.no_grad()
def fold_norms(model: torch.nn.Module) -> bool:
    """Fold each layer's input and post-attention norm weights into qkv / gate|up and mark the layers
    folded (in place, once); False (nothing changed) when ``foldable`` says no."""
    if not foldable(model):
        return False
    for layer in model.model.layers:
        if layer.folded:
            continue
        _scale_columns(layer.self_attn.qkv_proj.weight, layer.input_layernorm.weight)
        _scale_columns(layer.mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight)
        layer.folded = True
    return True


def _scale_columns(w: torch.Tensor, g: torch.Tensor, rows: int = 2048) -> None:
    # W[n, k] *= g[k] in fp32, rounded once; a block of rows at a time so the fp32 temporary stays small
    gf = g.float()[None, :]
    for r0 in range(0, w.shape[0], rows):
        blk = w[r0:r0 + rows]
        blk.copy_(blk.float() * gf)


def should_fold(model: torch.nn.Module, device: torch.device) -> bool:
    """The runner's policy: fold on CUDA with bf16 weights where the fused kernels serve the layers
    (the switch on, Triton present, a head size the RoPE kernel takes: elsewhere the row scale would
    cost torch launches of its own), unless ``NBGEN_FOLD_NORM=0``."""
    from nbgen.models import llama
    from nbgen.kernels.qk_norm_rope import supports_head_dim
    from nbgen.kernels.gpu_ops import fused_enabled

    w = model.lm_head.weight if hasattr(model, "lm_head") else None
    return (FOLD and triton is not None and device.type == "cuda" and llama.FUSED_ROPE and w is not None
            and w.dtype == torch.bfloat16 and fused_enabled(w) and foldable(model)
            and all(supports_head_dim(m.self_attn.head_dim) for m in model.model.layers))


if triton is not None:
    from nbgen.kernels.qk_norm_rope import _rnd, row_rms_scale

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
            g = _rnd(g * s, dt)
            u = _rnd(u * s, dt)
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
