"""Qwen3 (Qwen3ForCausalLM): the Llama decoder plus an RMSNorm over each q and k head before RoPE.

Qwen3 configs carry an explicit ``head_dim`` (128 for 0.6B, where hidden / heads would be 64).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from nbgen.models import qk_norm_rope as fused_qk
from nbgen.models.layers import RMSNorm
from nbgen.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from nbgen.runtime.gpu_ops import fused_enabled

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# NBGEN_FUSED_QK=0: q/k norm and RoPE as three flashinfer launches instead of one Triton kernel
FUSED_QK = os.environ.get("NBGEN_FUSED_QK", "1") != "0"


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary_emb: nn.Module) -> None:
        super().__init__(config, layer_id, rotary_emb)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, D = q.shape[0], self.head_dim
        # per head: [T, H*D] -> [T, H, D], normalise over D, back to flat
        q = self.q_norm(q.reshape(T, -1, D)).view(T, -1)
        k = self.k_norm(k.reshape(T, -1, D)).view(T, -1)
        return q, k

    def norm_rope(self, positions: torch.Tensor, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        if FUSED_QK and fused_enabled(qkv) and fused_qk.supported(qkv, self.head_dim):
            # one kernel, in place on qkv: q and k stay its (strided) views
            fused_qk.qk_norm_rope_(qkv, positions, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                   self.rotary_emb.cos_sin_cache, self.qkv_proj.num_heads,
                                   self.qkv_proj.num_kv_heads, self.head_dim)
            return q, k
        return super().norm_rope(positions, qkv, q, k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
