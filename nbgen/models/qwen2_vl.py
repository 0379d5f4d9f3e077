"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``):
the Qwen2 decoder with M-RoPE (``models/mrope.py``) plus the vision tower (``models/qwen2_vl_vision.py``).

``forward(input_ids, positions, meta, input_embeds=None)``: positions [T] (text: plain RoPE) or [3, T]
(prompts with images); ``input_embeds`` [T, H] replaces the token lookup where the runner merged image
embeddings in. ``encode_images(pixel_values, grids)`` runs the tower. Checkpoint names: transformers 5
(``model.language_model.*``, ``model.visual.*``) and the older layout (``model.*``, ``visual.*``).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from nbgen.kernels import qk_norm_rope as fused_rope
from nbgen.kernels.gpu_ops import fused_enabled
from nbgen.kernels.fp8_quant import QuantizedRows
from nbgen.models.layers import RMSNorm, VocabParallelEmbedding, rope_settings
from nbgen.models.vision_weights import DirectWeights
from nbgen.models.llama_layer import head_dim_of
from nbgen.models.model_config import ModelConfig
from nbgen.models.mrope import MRotaryEmbedding
from nbgen.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2Model
from nbgen.models.qwen2_vl_vision import Grid, VisionTower

VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def flatten_vl_config(hf: Any) -> ModelConfig:
    """A transformers Qwen2(.5)-VL config -> one flat ModelConfig: the text config's keys (what the
    runner and KV sizing read) plus ``vision_config``, the vision token ids and ``architectures``."""
    text = hf.text_config.to_dict() if getattr(hf, "text_config", None) is not None else hf.to_dict()
    d = {k: v for k, v in text.items() if k not in ("vision_config", "text_config")}
    d["model_type"] = hf.model_type
    d["architectures"] = list(getattr(hf, "architectures", None) or [])
    d["vision_config"] = hf.vision_config
    d["tie_word_embeddings"] = bool(getattr(hf, "tie_word_embeddings", False) or text.get("tie_word_embeddings"))
    for k in _TOKEN_KEYS:
        d[k] = getattr(hf, k, None)
    d["rope_scaling"] = d.get("rope_parameters")
    return ModelConfig(d)


class Qwen2VLAttention(Qwen2Attention):
    def project(self, positions: torch.Tensor, x: torch.Tensor, meta: Any,
                qkv_out: Optional[torch.Tensor] = None, fold_eps: Optional[float] = None,
                xq: Optional[QuantizedRows] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """1-D positions: the Llama path; 3-D [3, T]: the same fused RoPE (+ K/V write) kernel reading
        the step's M-RoPE table at rows 0..T-1 on CUDA, M-RoPE in torch elsewhere."""
        if positions.dim() == 1:
            return super().project(positions, x, meta, qkv_out, fold_eps, xq)
        assert fold_eps is None and xq is None, "Qwen2-VL layers have biases and are never folded"
        qkv = self.qkv_proj(x, out=qkv_out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if fused_enabled(qkv) and fused_rope.supported(qkv, self.head_dim):
            table, rows = self.rotary_emb.step_table(positions)              # [T, D] fp32, [T]
            kv = self.attn.kv_target(meta)
            fused_rope.qk_norm_rope_(qkv, rows, *self.qk_norm_weights(), table, self.qkv_proj.num_heads,
                                     self.qkv_proj.num_kv_heads, self.head_dim, kv=kv)
            return q, k, v, kv is not None
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v, False


class Qwen2VLDecoderLayer(Qwen2DecoderLayer):
    attention_cls = Qwen2VLAttention


class Qwen2VLTextModel(Qwen2Model):
    layer_cls = Qwen2VLDecoderLayer

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)     # LlamaModel's init builds a plain RoPE; the same parts with M-RoPE here
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        theta, _ = rope_settings(config)
        params = getattr(config, "rope_parameters", None) or {}
        hd = head_dim_of(config)
        section = params.get("mrope_section") or [hd // 2 - 2 * (hd * 3 // 16), hd * 3 // 16, hd * 3 // 16]
        rope = MRotaryEmbedding(hd, config.max_position_embeddings, theta, section)
        self.layers = nn.ModuleList(self.layer_cls(config, i, rope) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)



class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Decoder (``model``), LM head and vision tower (``visual``)."""

    model_cls = Qwen2VLTextModel
    vision_v25 = False
    mrope = True         # the vision step passes [3, T] positions

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.visual = VisionTower(config.vision_config, config.hidden_size, self.vision_v25)
        self.image_token_id = int(config.image_token_id)
        self.merge = self.visual.merge

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                input_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids [T], positions [T] or [3, T], input_embeds [T, H] or None -> hidden [T, H]."""
        return self.model(input_ids, positions, meta, input_embeds)

    @property
    def pixels_per_token(self) -> int:
        """Pixel values (``pixel_values`` elements) behind one image token: merge^2 patches of C*tp*p*p."""
        return self.merge * self.merge * self.visual.patch_embed.proj.weight[0].numel()

    def encode_images(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """Patches of several images [N, C*tp*p*p] -> their token embeddings [N / merge^2, H]."""
        return self.visual(pixel_values, grids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, H]; ids past the vocabulary (image slots' hash ids) read row 0."""
        vocab = self.config.vocab_size
        return self.model.embed_tokens(torch.where(input_ids < vocab, input_ids, torch.zeros_like(input_ids)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], require_head: bool = True) -> set[str]:
        """HF names of either layout; the tower's tensors load directly, the decoder's as Qwen2's."""
        vis = DirectWeights(self.visual.checkpoint_tensors(), type(self).__name__)

        def text_part() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in weights:
                name = name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
                if not name.startswith("visual."):
                    yield name, t
                    continue
                vis.load(name[len("visual."):], name, t)

        loaded = super().load_weights(text_part(), require_head)
        vis.check_complete()
        return loaded | {f"visual.{k}" for k in vis.seen}

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        # the decoder's completeness (the tower is checked in load_weights)
        super()._check_complete({k: v for k, v in params.items() if not k.startswith("visual.")}, loaded)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same decoder; the tower uses window attention, RMSNorm and a SwiGLU MLP."""

    vision_v25 = True
