"""ModelConfig: config.json read by nbgen itself for the families it runs, without transformers.

Defining any transformers config class (LlamaConfig, Qwen3Config, ...) pulls in much of transformers
(seconds of start-up on the GPU host). For plain llama / mistral / qwen2 / qwen3 configs nbgen builds
the same attribute values itself: the JSON keys as they are, plus the defaults and the derived values
(``head_dim``, ``num_key_value_heads``, ``sliding_window``, ``layer_types``, ``rope_parameters``) that
the transformers 5 config classes give. Anything else goes through ``AutoConfig`` unchanged.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Optional

_SHARED: dict[str, Any] = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                           "pad_token_id": None}
_LLAMA_LIKE: dict[str, Any] = {**_SHARED, "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                               "num_attention_heads": 32, "head_dim": None, "bos_token_id": 1,
                               "eos_token_id": 2}
_QWEN: dict[str, Any] = {**_SHARED, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                         "max_position_embeddings": 32768, "use_sliding_window": False,
                         "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
                         "bos_token_id": None, "eos_token_id": None}
# defaults of the keys nbgen reads, as in the transformers 5 `<Family>Config` signatures
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_LIKE, "intermediate_size": 11008, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "mistral": {**_LLAMA_LIKE, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": dict(_QWEN),
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
}
_DEFAULT_THETA = 10000.0
_LONG_ROPE_TYPES = ("llama3", "yarn", "longrope")   # these carry the pretraining context length


class ModelConfig:
    """A plain attribute bag with what HF's config object would expose; missing keys raise
    AttributeError, so ``getattr(config, key, default)`` behaves as on an HF config."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """JSON dict (of a supported ``model_type``) -> config with defaults and derived values."""
        d = copy.deepcopy(raw)
        mt = d["model_type"]
        for key, value in DEFAULTS[mt].items():
            d.setdefault(key, value)
        archs = d.get("architectures")
        d["architectures"] = list(archs) if archs is not None else None
        if mt in ("llama", "mistral") and d["head_dim"] is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if d["num_key_value_heads"] is None:
            d["num_key_value_heads"] = d["num_attention_heads"]
        if mt in ("qwen2", "qwen3"):
            if not d["use_sliding_window"]:
                d["sliding_window"] = None
            if d["layer_types"] is None:
                sliding = d["sliding_window"] is not None
                d["layer_types"] = ["sliding_attention" if sliding and i >= d["max_window_layers"]
                                    else "full_attention" for i in range(d["num_hidden_layers"])]
        if d.get("layer_types") is not None:    # the legacy spelling, renamed as transformers does
            d["layer_types"] = ["full_attention" if t == "attention" else t for t in d["layer_types"]]
        if d.get("dtype") is None and d.get("torch_dtype") is not None:
            d["dtype"] = d["torch_dtype"]        # kept as a string ("bfloat16"); HF makes a torch.dtype
        d["rope_parameters"] = _rope_parameters(d)
        d["rope_scaling"] = d["rope_parameters"]  # HF: a property returning rope_parameters
        return cls(d)

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the attributes (rope_scaling omitted: it is rope_parameters)."""
        return {k: copy.deepcopy(v) for k, v in self.__dict__.items() if k != "rope_scaling"}

    def __repr__(self) -> str:
        return f"ModelConfig({self.to_dict()!r})"


def _rope_parameters(d: dict[str, Any]) -> dict[str, Any]:
    """One flat RoPE dict with ``rope_type`` and ``rope_theta``, folded from the old keys as in
    transformers 5 (``rope_scaling`` wins over ``rope_parameters``; ``rope_theta`` is removed)."""
    params = dict(d.pop("rope_scaling", None) or d.get("rope_parameters") or {})
    params.setdefault("rope_theta", d.pop("rope_theta", _DEFAULT_THETA))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _LONG_ROPE_TYPES:
        params.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
    return params


def _is_plain(raw: dict[str, Any]) -> bool:
    """True when nbgen's reader covers this config: a known family, no remote code, flat RoPE."""
    if raw.get("model_type") not in DEFAULTS or "auto_map" in raw:
        return False
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    return isinstance(rope, dict) and not any(isinstance(v, dict) for v in rope.values())


def read_model_config(model_dir: str, trust_remote_code: bool = False) -> Any:
    """``model_dir/config.json`` as a ModelConfig when plain, else ``AutoConfig.from_pretrained``."""
    raw: Optional[dict[str, Any]] = None
    path = os.path.join(model_dir, "config.json")
    if not trust_remote_code and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            raw = None     # let transformers report the problem in its own words
    if isinstance(raw, dict) and _is_plain(raw):
        return ModelConfig.from_dict(raw)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def model_dims(hf: Any) -> tuple[int, int, int, int]:
    """(num_layers, num_q_heads, num_kv_heads, head_dim) of a model config."""
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return hf.num_hidden_layers, heads, kv, head_dim
