"""Folded RMSNorms: a Llama-family decoder layer without its two norm launches (CUDA, bf16).

At decode sizes a layer's add+RMSNorm kernels are mostly fixed cost (~2.7 us each at 128 rows on an
H100, 56 launches a step for Qwen3-0.6B, ~150 us of a ~4.5 ms step). Row by row,

    RMSNorm(h) @ W.T = (h @ (W * g).T) * rsqrt(mean(h^2) + eps)        (g: the norm weight)

so with g folded into the columns of the projection after the norm (once, after loading), that
projection reads the raw residual stream h, and the row scale is applied by the kernel that follows
it anyway: the q/k norm + RoPE kernel scales q, k, v (``qk_norm_rope_(row_scale=)``), and the
scaled SiLU-and-mul (``nbgen.kernels.silu_scaled``) scales gate and up. The residual adds move into
the projections before them: o_proj and down_proj accumulate into h (cuBLAS ``addmm_`` with beta = 1, or the streaming kernel's
epilogue at a few rows; fp8 above that, the launch that scales cuBLAS's fp8 output). A layer then runs qkv, RoPE, attention, o_proj, gate|up, SiLU, down.

Numerics: g * W is rounded to the model dtype once; q/k/v and gate/up are the raw projections rounded,
scaled in fp32 and rounded again; each residual add rounds once instead of twice. Results stay within
bf16 noise of the unfolded layer (tests/test_norm_fold.py, GPU parity in tests/test_gpu.py), not bit
identical. Only bf16 weights are folded (fp16's range is too narrow for the raw stream's
projections), and only layers without biases.

Tensor parallelism: qkv and gate|up are column-parallel (each rank's rows over the whole hidden
size), so the fold is the same on every rank; o_proj and down_proj sum their partial products over
the ranks straight into the stream (``RowParallelLinear.accumulate``: the peer all-reduce adds into
it in its epilogue), so each all-reduce is one launch with no add+RMSNorm after it.

FP8 linears with one scale per output feature (``models/fp8_scaled.py``) keep their e4m3 bytes: the norm
weight becomes their ``col_scale``, which the fp8 kernels (the streaming kernel, above 16 rows the
activation quantizer) multiply into the activation's columns before quantizing it per token (the norm's row factor cancels in that scale), and the rest of the folded layer
is the same. ``fold_map`` lists no fp8 projection (their weights hold no norm); ``col_scale`` is the norm
parameter itself, so a weight update of the norm reaches it in place.

Weight updates (``runtime/weights.py``) keep the fold: rows loaded into a folded projection are folded
with ``fold_rows``, a new norm weight rescales its projection by new / old (``refold``), and reads
divide the norm out again (``unfolded``).
"""
from __future__ import annotations

import torch

from nbgen.kernels import gpu_ops, qk_norm_rope
from nbgen.models.fp8_scaled import Fp8ScaledWeight


def foldable(model: torch.nn.Module) -> bool:
    """The model's layers can run folded: Llama-family decoder layers (``folded`` attribute), bf16 or
    fp32 weights or per-feature fp8 ones, no q/k/v, o, gate|up or down biases."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    for layer in layers:
        if not hasattr(layer, "folded"):
            return False
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(m.bias is not None for m in linears):
            return False
        fp8 = [isinstance(m.fp8, Fp8ScaledWeight) for m in linears]
        if any(fp8) and not all(fp8):
            return False
        if not fp8[0] and (attn.qkv_proj.fp8 is not None or
                           attn.qkv_proj.weight.dtype not in (torch.bfloat16, torch.float32)):
            return False
    return True


@torch.no_grad()
def fold_norms(model: torch.nn.Module) -> bool:
    """Fold each layer's input and post-attention norm weights into qkv / gate|up and mark the layers
    folded (in place, once); False (nothing changed) when ``foldable`` says no."""
    if not foldable(model):
        return False
    layers = model.model.layers
    for layer, nxt in zip(layers, [*layers[1:], None]):
        if layer.folded:
            continue
        layer.next_qkv = () if nxt is None else (nxt.self_attn.qkv_proj,)
        qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        if _is_fp8(layer):   # the kernel scales the activation: the e4m3 bytes stay
            qkv.fp8.col_scale = layer.input_layernorm.weight.data
            gate_up.fp8.col_scale = layer.post_attention_layernorm.weight.data
        else:
            _scale_columns(qkv.weight, layer.input_layernorm.weight)
            _scale_columns(gate_up.weight, layer.post_attention_layernorm.weight)
        layer.folded = True
    return True


def _scale_columns(w: torch.Tensor, g: torch.Tensor, rows: int = 2048) -> None:
    """W[n, k] *= g[k] in fp32, rounded once; a block of rows at a time so the fp32 temporary stays small."""
    gf = g.float()[None, :]
    for r0 in range(0, w.shape[0], rows):
        blk = w[r0:r0 + rows]
        blk.copy_(blk.float() * gf)


def _is_fp8(layer: torch.nn.Module) -> bool:
    return isinstance(layer.self_attn.qkv_proj.fp8, Fp8ScaledWeight)


def fold_map(model: torch.nn.Module) -> dict[str, str]:
    """Folded layers' parameters: qkv / gate|up weight name -> the norm weight folded into its columns
    (empty when nothing is folded; fp8 layers hold the norm as the kernel's column scale instead)."""
    out: dict[str, str] = {}
    for i, layer in enumerate(getattr(getattr(model, "model", None), "layers", None) or []):
        if getattr(layer, "folded", False) and not _is_fp8(layer):
            p = f"model.layers.{i}."
            out[p + "self_attn.qkv_proj.weight"] = p + "input_layernorm.weight"
            out[p + "mlp.gate_up_proj.weight"] = p + "post_attention_layernorm.weight"
    return out


@torch.no_grad()
def fold_rows(w: torch.Tensor, g: torch.Tensor) -> None:
    """Fold norm weight ``g`` into rows just loaded unfolded (a weight update of a folded layer)."""
    _scale_columns(w, g)


@torch.no_grad()
def refold(w: torch.Tensor, g_old: torch.Tensor, g_new: torch.Tensor) -> None:
    """A folded norm's weight changes from g_old to g_new: W[:, k] *= g_new[k] / g_old[k] (fp32, rounded
    once; columns where g_old is 0 hold no information and become 0)."""
    old = g_old.float()
    _scale_columns(w, torch.where(old != 0, g_new.float() / old, torch.zeros_like(old)))


def unfolded(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The checkpoint's values of folded rows, in fp32: W[:, k] / g[k] (within a rounding of the model
    dtype of what was loaded)."""
    return w.float() / g.float()[None, :]


def should_fold(model: torch.nn.Module, device: torch.device) -> bool:
    """The setup's policy: fold on CUDA with bf16 weights where the fused kernels serve the layers
    (the fused GPU ops on, Triton present, a head size the RoPE kernel takes: elsewhere the row
    scale would cost torch launches of its own)."""
    w = model.lm_head.weight if hasattr(model, "lm_head") else None
    return (device.type == "cuda" and w is not None and w.dtype == torch.bfloat16
            and gpu_ops.fused_enabled(w) and foldable(model)
            and all(qk_norm_rope.available(m.self_attn.head_dim) for m in model.model.layers))
