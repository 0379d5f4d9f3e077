"""LLaVA-1.5 (``LlavaForConditionalGeneration``): a CLIP vision tower (``models/clip_vision.py``), its
``vision_feature_layer`` hidden states with the CLS token dropped (``vision_feature_select_strategy=
"default"``; ``"full"`` keeps it), a two-layer projector, and a Llama / Mistral / Qwen2 decoder with plain
1-D RoPE. Each image is one run of ``image_token_index`` slots, one per patch (576 for 336 px / 14 px).

Checkpoint names: transformers 5 (``model.language_model.*``, ``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``lm_head.*``) and the older layout (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.*``, ``multi_modal_projector.*``).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from nbgen.models.clip_vision import CLIPVisionTower, activation
from nbgen.models.vision_weights import DirectWeights
from nbgen.models.llama import LlamaForCausalLM, LlamaModel
from nbgen.models.model_config import ModelConfig
from nbgen.models.qwen2 import Qwen2Model

LLAVA_MODEL_TYPES = ("llava",)
_TEXT_TYPES = ("llama", "mistral", "qwen2")


def flatten_llava_config(hf: Any) -> ModelConfig:
    """A transformers LlavaConfig -> one flat ModelConfig: the text config's keys plus ``vision_config``,
    ``image_token_id``, the feature-selection and projector settings and ``text_model_type``."""
    text = hf.text_config.to_dict()
    if text.get("model_type") not in _TEXT_TYPES:
        raise ValueError(f"LLaVA with a {text.get('model_type')!r} language model is not supported "
                         f"(supported: {', '.join(_TEXT_TYPES)})")
    if getattr(hf.vision_config, "model_type", None) != "clip_vision_model":
        raise ValueError(f"LLaVA with a {getattr(hf.vision_config, 'model_type', None)!r} vision tower is not "
                         "supported (supported: clip_vision_model)")
    layer = hf.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: only a single layer is supported")
    strategy = hf.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported ('default' or 'full')")
    d = {k: v for k, v in text.items() if k not in ("vision_config", "text_config")}
    d.update(model_type=hf.model_type, text_model_type=text["model_type"],
             architectures=list(getattr(hf, "architectures", None) or []), vision_config=hf.vision_config,
             image_token_id=int(getattr(hf, "image_token_id", None) or hf.image_token_index),
             vision_feature_layer=layer, vision_feature_select_strategy=strategy,
             projector_hidden_act=hf.projector_hidden_act,
             multimodal_projector_bias=bool(getattr(hf, "multimodal_projector_bias", True)),
             tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False) or text.get("tie_word_embeddings")))
    d["rope_scaling"] = d.get("rope_parameters") or d.get("rope_scaling")
    return ModelConfig(d)


def image_tokens_per_image(config: Any) -> int:
    """Slots one image fills: its patches, plus the CLS token under the 'full' strategy."""
    v = config.vision_config
    return (v.image_size // v.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")


# decoders that take image features through ``input_embeds``
_TEXT_MODELS = {"llama": LlamaModel, "mistral": LlamaModel, "qwen2": Qwen2Model}


class LlavaProjector(nn.Module):
    def __init__(self, vision_dim: int, text_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """Decoder (``model``; Llama- or Qwen2-shaped by ``text_model_type``), LM head, CLIP tower
    (``vision_tower``) and projector (``multi_modal_projector``)."""

    mrope = False        # the vision step passes 1-D positions

    @property
    def model_cls(self) -> type[LlamaModel]:       # read by LlamaForCausalLM.__init__ after self.config is set
        return _TEXT_MODELS[self.config.text_model_type]

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        v = config.vision_config
        self.vision_tower = CLIPVisionTower(v, config.vision_feature_layer)
        self.multi_modal_projector = LlavaProjector(v.hidden_size, config.hidden_size, config.projector_hidden_act,
                                                    config.multimodal_projector_bias)
        self.image_token_id = int(config.image_token_id)
        self.keep_cls = config.vision_feature_select_strategy == "full"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                input_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids [T], positions [T], input_embeds [T, H] or None -> hidden [T, H]."""
        return self.model(input_ids, positions, meta, input_embeds)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Images [N, C, S, S] -> their slot embeddings [N * tokens per image, H] (``grids`` unused:
        every image has the tower's fixed size)."""
        feats = self.vision_tower(pixel_values)                           # [N, 1 + P, D]
        if not self.keep_cls:
            feats = feats[:, 1:]
        return self.multi_modal_projector(feats).flatten(0, 1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, H]; ids past the vocabulary (image slots' hash ids) read row 0."""
        vocab = self.config.vocab_size
        return self.model.embed_tokens(torch.where(input_ids < vocab, input_ids, torch.zeros_like(input_ids)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], require_head: bool = True) -> set[str]:
        """HF names of either layout; tower and projector load directly, the decoder as Llama's / Qwen2's."""
        params = {f"vision_tower.{k}": p for k, p in self.vision_tower.named_parameters()}
        params.update({f"multi_modal_projector.{k}": p for k, p in self.multi_modal_projector.named_parameters()})
        direct = DirectWeights(params, type(self).__name__)

        def text_part() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in weights:
                for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                                 ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                                 ("model.multi_modal_projector.", "multi_modal_projector.")):
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                if not name.startswith(("vision_tower.", "multi_modal_projector.")):
                    yield name, t
                    continue
                key = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
                if key.startswith("vision_tower.") and self.vision_tower.skipped(key[len("vision_tower."):]):
                    continue
                direct.load(key, name, t)

        loaded = super().load_weights(text_part(), require_head)
        direct.check_complete()
        return loaded | direct.seen

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        # the decoder's completeness (tower and projector are checked in load_weights)
        super()._check_complete({k: v for k, v in params.items()
                                 if not k.startswith(("vision_tower.", "multi_modal_projector."))}, loaded)
