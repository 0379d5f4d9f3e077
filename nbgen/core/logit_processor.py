"""CustomLogitProcessor: caller-supplied code that edits a request's logits (SGLang's interface).

Subclass it, implement ``__call__(self, logits, custom_param_list)`` and pass ``MyProc.to_str()``
as ``generate(..., custom_logit_processor=...)``; per-request arguments go in
``sampling_params["custom_params"]``. The Engine must be created with
``enable_custom_logit_processor=True``: the string is unpickled, i.e. it runs code.
"""
from __future__ import annotations

import functools
import json
import pickle
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional

from nbgen.core.errors import ArgumentTypeError

if TYPE_CHECKING:
    import torch


class CustomLogitProcessor(ABC):
    """Base class of custom logit processors (as ``sglang.srt.sampling.custom_logit_processor``)."""

    @abstractmethod
    def __call__(self, logits: "torch.Tensor",
                 custom_param_list: Optional[list[dict[str, Any]]] = None) -> "torch.Tensor":
        """logits: [rows, V] float32 of the requests using this processor (nbgen calls it with one
        row per request); custom_param_list: one ``custom_params`` dict per row. Returns [rows, V]."""

    @classmethod
    def to_str(cls) -> str:
        """Serialise the class (by value with cloudpickle when installed, so notebook classes work)."""
        try:
            import cloudpickle

            blob, how = cloudpickle.dumps(cls), "cloudpickle"
        except ImportError:
            blob, how = pickle.dumps(cls), "pickle"
        return json.dumps({"callable": blob.hex(), "serializer": how})

    @classmethod
    def from_str(cls, json_str: str) -> "CustomLogitProcessor":
        """An instance of the serialised class (cached per string)."""
        return _load_class(json_str)()


@functools.lru_cache(maxsize=64)
def _load_class(json_str: str) -> type:
    data = json.loads(json_str)
    blob = bytes.fromhex(data["callable"])
    if data.get("serializer") is None:   # a string made by SGLang (dill)
        import dill

        return dill.loads(blob)
    return pickle.loads(blob)            # cloudpickle output loads with pickle (cloudpickle importable)


def load_processor(spec: Any) -> Any:
    """A callable processor from ``custom_logit_processor`` (a to_str() string or an instance)."""
    if isinstance(spec, str):
        try:
            return CustomLogitProcessor.from_str(spec)
        except Exception as e:  # noqa: BLE001 - any decoding failure is the caller's input
            raise ValueError(f"custom_logit_processor could not be loaded: {type(e).__name__}: {e}") from None
    if callable(spec):
        return spec
    raise ArgumentTypeError(f"custom_logit_processor must be a string from CustomLogitProcessor.to_str(), got {spec!r:.60}")
