"""Llama family (LlamaForCausalLM, MistralForCausalLM) over a flat token stream: the model (embedding,
decoder layers of ``models/llama_layer.py``, final norm), the LM head and checkpoint loading.

This is also the model that Qwen2 and Qwen3 specialise: they override the class attributes below
instead of copying it.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
from torch import nn

from nbgen.models.cpu_decode import CpuDecodePlan
from nbgen.models.layers import (
    ParallelLMHead,
    RMSNorm,
    VocabParallelEmbedding,
    default_weight_loader,
    get_rope,
    rope_settings,
)
from nbgen.models.llama_layer import LayerOut, LlamaDecoderLayer, head_dim_of, in_hand

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # EAGLE3 (runtime/spec_eagle.py): the residual stream at the input of these layers, per eager forward
    capture_layers: tuple[int, ...] = ()
    # CPU decode steps of a few rows without the modules' dispatch (set at load: models/cpu_decode.py)
    cpu_decode: Optional[CpuDecodePlan] = None

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        theta, scaling = rope_settings(config)
        rope = get_rope(head_dim_of(config), config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(self.layer_cls(config, i, rope) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.captured: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                input_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """-> final-normed hidden states [T, H]; ``input_embeds`` [T, H] (vision-language models: image
        features in their slots) replaces the token lookup."""
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds      # [T, H]
        residual = None
        if self.capture_layers:
            self.captured = []
        plan = self.cpu_decode
        if plan is not None and not self.capture_layers and plan.applies(x, meta):
            return self.final_norm(*plan.run(positions, x, meta))
        for i, layer in enumerate(self.layers):
            if i in self.capture_layers:      # a copy: the next add+norm updates the stream in place
                h = x.clone() if residual is None else (x + residual if in_hand(x) else residual.clone())
                self.captured.extend([h] * self.capture_layers.count(i))
            x, residual = layer(positions, x, residual, meta)
        return self.final_norm(x, residual)

    def final_norm(self, x: LayerOut, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output (None when folded layers left it in the stream) + residual -> normed."""
        return self.norm(x, residual)[0] if in_hand(x) else self.norm(residual)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM: ``forward`` -> final hidden states [T, H]; ``compute_logits`` -> logits."""

    model_cls: type[LlamaModel] = LlamaModel
    # (fused parameter, HF checkpoint name, shard id)
    stacked_params = [
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        """input_ids, positions: [T] (all sequences of the step, concatenated) -> hidden [T, H]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] in the model dtype (the sampler widens them to fp32
        only when it processes them or reports logprobs)."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], require_head: bool = True) -> set[str]:
        """Load HF-named tensors (any order, one at a time); raise if a parameter stays unset.

        Checkpoints saved as the base model (``LlamaModel`` etc.: no ``model.`` prefix, no lm_head,
        as embedding models ship) load too; with ``require_head=False`` a missing lm_head is tied to
        the embedding (an embedding engine never computes logits)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name:
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue   # tied: the embedding already is the output matrix
            if name.startswith(("layers.", "embed_tokens.", "norm.")):
                name = "model." + name   # a base-model checkpoint
            target, shard = name, None
            for fused, part, shard_id in self.stacked_params:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                loader(param, tensor, shard) if shard is not None else loader(param, tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        if not require_head and "lm_head.weight" in params and "lm_head.weight" not in loaded:
            self.lm_head.weight = self.model.embed_tokens.weight    # frees the unread head
            params = dict(self.named_parameters())
        self._check_complete(params, loaded)
        return loaded

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            fused = [s for f, _, s in self.stacked_params if f".{f}." in name]
            want = [f"{name}#{s}" for s in fused] if fused else [name]
            missing += [w for w in want if w not in loaded]
        if missing == ["lm_head.weight"]:
            raise ValueError("checkpoint has no lm_head.weight (a base model, e.g. an embedding model): "
                             "pass is_embedding=True to embed with it; generation needs the LM head")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) of {type(self).__name__}, "
                             f"e.g. {missing[:5]}")


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral checkpoints are Llama-shaped; sliding-window attention is not applied (full attention),
    which is exact for contexts up to ``sliding_window`` tokens."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        window = getattr(config, "sliding_window", None)
        if window and window < config.max_position_embeddings:
            logger.warning("nbgen: sliding_window=%d is not applied; outputs differ from the reference "
                           "beyond %d tokens of context", window, window)
