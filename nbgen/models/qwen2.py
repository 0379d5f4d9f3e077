"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): the Llama decoder with a q/k/v bias and no o_proj bias.

Tied embeddings (the small Qwen2.5 models) are handled by the shared LM head.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nbgen.models.llama import LlamaForCausalLM, LlamaModel
from nbgen.models.llama_layer import LlamaAttention, LlamaDecoderLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2Attention(LlamaAttention):
    def biases(self, config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model
