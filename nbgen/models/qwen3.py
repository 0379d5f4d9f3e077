"""Qwen3 (Qwen3ForCausalLM): the Llama decoder plus an RMSNorm over each q and k head before RoPE.

Qwen3 configs carry an explicit ``head_dim`` (128 for 0.6B, where hidden / heads would be 64).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from nbgen.models.layers import RMSNorm
from nbgen.models.llama import LlamaForCausalLM, LlamaModel
from nbgen.models.llama_layer import LlamaAttention, LlamaDecoderLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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

    def qk_norm_weights(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
