"""Model families (Llama, Qwen2, Qwen3), weight loading and the embedded default model."""
from nbgen.models.loader import LoadedModel, load_model
from nbgen.models.registry import get_model_class, supported_architectures

__all__ = ["LoadedModel", "load_model", "get_model_class", "supported_architectures"]
