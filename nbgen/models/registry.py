"""Maps ``config.architectures[0]`` to the nbgen model class that implements it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from nbgen.models.llama import LlamaForCausalLM, MistralForCausalLM
from nbgen.models.qwen2 import Qwen2ForCausalLM
from nbgen.models.qwen3 import Qwen3ForCausalLM
from nbgen.models.llava import LLAVA_MODEL_TYPES, LlavaForConditionalGeneration, flatten_llava_config
from nbgen.models.llava_next import (LLAVA_NEXT_MODEL_TYPES, LlavaNextForConditionalGeneration,
                                     flatten_llava_next_config)
from nbgen.models.qwen2_vl import (VL_MODEL_TYPES, Qwen2_5_VLForConditionalGeneration,
                                   Qwen2VLForConditionalGeneration, flatten_vl_config)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # base models (embedding checkpoints saved without the LM head) run on the same classes
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": MistralForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
    # vision-language: images in, text out (engine_images.py, runtime/vision_step.py)
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
}
VISION_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                        "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")

# configs without `architectures` (e.g. converted from GGUF) fall back on their model_type
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen2_vl": "Qwen2VLForConditionalGeneration",
                  "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "llava": "LlavaForConditionalGeneration",
                  "llava_next": "LlavaNextForConditionalGeneration"}
_VISION_HINTS = ("ForConditionalGeneration", "VL", "Llava", "Vision", "Idefics", "Pixtral")


def prepare_config(config: Any) -> Any:
    """The config the model class takes: vision-language configs flattened (``flatten_vl_config``)."""
    if getattr(config, "model_type", None) in VL_MODEL_TYPES and hasattr(config, "vision_config") \
            and not hasattr(config, "num_hidden_layers"):
        return flatten_vl_config(config)
    if getattr(config, "model_type", None) in LLAVA_MODEL_TYPES and hasattr(config, "text_config"):
        return flatten_llava_config(config)
    if getattr(config, "model_type", None) in LLAVA_NEXT_MODEL_TYPES and hasattr(config, "text_config"):
        return flatten_llava_next_config(config)
    return config


def supported_architectures() -> list[str]:
    """Architecture names nbgen can run."""
    return sorted(MODEL_REGISTRY)


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The class for this config; ValueError naming the architecture when it is not supported."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        mt = getattr(config, "model_type", None)
        if mt in _BY_MODEL_TYPE:
            archs = [_BY_MODEL_TYPE[mt]]
    arch = archs[0] if archs else None
    if arch not in MODEL_REGISTRY and arch is not None and any(h in arch for h in _VISION_HINTS):
        raise ValueError(f"vision-language architecture {arch!r} is not supported by nbgen; supported "
                         f"vision-language models: {', '.join(VISION_ARCHITECTURES)} (text models: "
                         f"{', '.join(a for a in supported_architectures() if a not in VISION_ARCHITECTURES)})")
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"model architecture {arch!r} is not supported by nbgen; "
                         f"supported: {', '.join(supported_architectures())}")
    return MODEL_REGISTRY[arch]
