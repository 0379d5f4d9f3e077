"""Maps ``config.architectures[0]`` to the nbgen model class that implements it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from nbgen.models.llama import LlamaForCausalLM, MistralForCausalLM
from nbgen.models.qwen2 import Qwen2ForCausalLM
from nbgen.models.qwen3 import Qwen3ForCausalLM

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
}

# configs without `architectures` (e.g. converted from GGUF) fall back on their model_type
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"model architecture {arch!r} is not supported by nbgen; "
                         f"supported: {', '.join(supported_architectures())}")
    return MODEL_REGISTRY[arch]
