"""A lean decoder layer for CPU decode steps (the batch-1 playground / streamed-cell case, and batched decode).

At batch 1 the embedded model's arithmetic per layer is ~120 us of int4 matmuls; the module path around it
(a dozen ``nn.Module`` calls, the GPU / CPU / LoRA / fp8 / tensor-parallel checks of each linear and norm)
cost about as much again in Python. ``CpuDecodePlan`` runs the same kernels in the same order (nbgen's C
add+RMSNorm, RoPE, SiLU-and-mul and paged attention with the K/V write; each linear's int4 copy at steps of
up to ``cpu_int4.MAX_ROWS`` rows and its oneDNN-packed bf16 weight otherwise, as ``LinearBase`` picks them), so
its outputs equal the module path's bit for bit; it only skips the dispatch. It applies to a step when every
layer is a plain Llama-shaped layer on the CPU whose linears are all packed (``prepack_cpu``), all the
step's rows are decodes through the C attention kernel, and no LoRA adapter, q/k norm, folded norm,
offloaded layer, fp8 weight or tensor parallelism is involved; otherwise the model runs its modules.

At steps of up to ``cpu_int4.MAX_ROWS`` rows, when every linear is 4-bit in nbgen's layout (``q4_gemv``), none
has a bias and the KV cache is bf16, the whole stack runs in one C call (``kernels/cpu_q4.py``: the same
kernels in the same order, so again the same bits) instead of ~10 Python-side kernel calls a layer.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from nbgen.kernels import cpu_ops
from nbgen.kernels.cpu_q4 import MAX_K, LayerShape, LayerTensors, Q4DecodeLayers
from nbgen.models import cpu_int4
from nbgen.models.layers import RotaryEmbedding
from nbgen.models.linear import get_tp, packed_linear


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    a, m = layer.self_attn, layer.mlp
    return a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj


def _mm(x: torch.Tensor, lin: nn.Module, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``lin``'s CPU matmul as ``LinearBase._mm`` chooses it: the int4 copy at a few rows, else the packed weight."""
    if cpu_int4.use_int4(x, lin.int4):
        return cpu_int4.int4_linear(x, lin.int4, bias)
    return packed_linear(x, lin.packed, bias)


class CpuDecodePlan:
    """The decoder layers of one model, run without their module dispatch at CPU decode steps."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = list(layers)
        self.linears = [lin for layer in self.layers for lin in _linears(layer)]
        self._fused: Optional[Q4DecodeLayers] = None
        self._fused_key: list[Any] = []         # the int4 copies the fused call was built from
        self._fused_kv: list[int] = []          # and the KV caches' addresses

    @staticmethod
    def build(layers: nn.ModuleList) -> Optional["CpuDecodePlan"]:
        """A plan when every layer has the plain Llama structure on the CPU in bf16 with packed linears
        (checked again per step: weight updates unpack them), else None."""
        if get_tp()[0] != 1:
            return None
        for layer in layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or getattr(layer, "mlp", None) is None or layer.folded or layer.stage_in is not None \
                    or type(attn.rotary_emb) is not RotaryEmbedding or attn.qk_norm_weights()[0] is not None:
                return None
            if any(lin.packed is None or lin.fp8 is not None for lin in _linears(layer)):
                return None
        return CpuDecodePlan(layers)

    def applies(self, x: torch.Tensor, meta: Any) -> bool:
        """This step runs through the plan: bf16 rows, all decodes through the C attention kernel, every
        linear packed and without a LoRA hook."""
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" \
            and getattr(meta, "decode_table", None) is not None and not meta.prefill \
            and all(lin.packed is not None and lin.lora is None for lin in self.linears)

    def run(self, positions: torch.Tensor, x: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers of a step the plan applies to: x [T, H] embeddings -> (last output, residual)."""
        fused = self._fused_for(meta.backend) if x.shape[0] <= cpu_int4.MAX_ROWS else None
        if fused is not None:
            layer0 = self.layers[0].self_attn
            return fused.run(x.contiguous(), positions, layer0.rotary_emb.cos_sin_cache, meta.decode_table,
                             meta.decode_lens, meta.backend.spec.page_size, meta.slot_mapping, meta.backend.scale)
        residual = None
        for i in range(len(self.layers)):
            x, residual = self.layer(i, positions, x, residual, meta)
        return x, residual

    def _fused_for(self, backend: Any) -> Optional[Q4DecodeLayers]:
        """The one-call driver for the current int4 copies and KV caches (rebuilt when a weight update
        replaced them), or None when some layer does not qualify."""
        # the KV pool's addresses: resume_memory_occupation reallocates its storage (same tensor objects)
        kv = [t.data_ptr() for t in backend.k_cache + backend.v_cache] if hasattr(backend, "k_cache") else []
        int4 = [lin.int4 for lin in self.linears]
        if kv != self._fused_kv or len(int4) != len(self._fused_key) \
                or any(a is not b for a, b in zip(int4, self._fused_key)):
            self._fused, self._fused_key, self._fused_kv = self._build_fused(backend), int4, kv
        return self._fused

    def _build_fused(self, backend: Any) -> Optional[Q4DecodeLayers]:
        attn0 = self.layers[0].self_attn
        if not hasattr(backend, "k_cache") or backend.k_cache[0].dtype != torch.bfloat16 \
                or attn0.rotary_emb.cos_sin_cache.dtype != torch.float32:
            return None
        tensors, eps = [], self.layers[0].input_layernorm.eps
        for layer in self.layers:
            attn, lins = layer.self_attn, _linears(layer)
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(lin.int4 is None or lin.int4.nib is None or lin.bias is not None for lin in lins) \
                    or attn.rotary_emb.cos_sin_cache is not attn0.rotary_emb.cos_sin_cache \
                    or any(n.weight.dtype != torch.bfloat16 or n.eps != eps for n in norms) \
                    or max(lin.int4.nib.shape[1] * 2 for lin in lins) > MAX_K:
                return None
            qs = [(lin.int4.nib, lin.int4.d, lin.int4.m) for lin in lins]
            lid = attn.attn.layer_id
            tensors.append(LayerTensors(norms[0].weight.data, qs[0], qs[1], norms[1].weight.data, qs[2], qs[3],
                                        backend.k_cache[lid], backend.v_cache[lid]))
        m = self.layers[0].mlp
        shape = LayerShape(len(self.layers), self.layers[0].input_layernorm.weight.shape[0],
                           m.down_proj.int4.nib.shape[1] * 2, attn0.q_size // attn0.head_dim,
                           attn0.kv_size // attn0.head_dim, attn0.head_dim, eps)
        return Q4DecodeLayers(shape, tensors)

    def layer(self, i: int, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
              meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i as ``LlamaDecoderLayer.forward``: x [T, H] (not yet in the residual stream) -> (out, residual)."""
        layer = self.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        if residual is None:
            residual, x = x, cpu_ops.rmsnorm(x, norm.weight, norm.eps)
        else:
            cpu_ops.add_rmsnorm(x, residual, norm.weight, norm.eps)        # in place: x normed, residual summed
        qkv_proj = attn.qkv_proj
        qkv = _mm(x, qkv_proj, qkv_proj.bias)                               # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        cpu_ops.rope_inplace(positions, q, k, attn.head_dim, attn.rotary_emb.cos_sin_cache)
        o = meta.backend.forward(attn.attn.layer_id, q, k, v, meta)         # [T, Hq D], K/V written
        o_proj = attn.o_proj
        h = _mm(o, o_proj, None)               # row-parallel linears add their bias after the matmul
        if o_proj.bias is not None:
            h = h + o_proj.bias
        norm = layer.post_attention_layernorm
        cpu_ops.add_rmsnorm(h, residual, norm.weight, norm.eps)
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        act = cpu_ops.silu_and_mul(_mm(h, gate_up, gate_up.bias))          # [T, I]
        out = _mm(act, down, None)
        return (out + down.bias if down.bias is not None else out), residual


def attach(model: nn.Module) -> bool:
    """Give a loaded CPU model's decoder (``model.model``, a LlamaModel or a subclass) its plan when it
    qualifies (after ``prepack_cpu_linears`` made the int4 copies); True when it got one."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "cpu_decode") or not hasattr(inner, "layers"):
        return False
    inner.cpu_decode = CpuDecodePlan.build(inner.layers)
    return inner.cpu_decode is not None
