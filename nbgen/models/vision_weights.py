"""A vision-language model's tower (and projector) tensors, loaded by name beside its decoder's loader.

Both VLM families split a checkpoint's stream: decoder tensors go on to the Llama-family
``load_weights`` (fused q|k|v, gate|up), tower tensors load directly into their parameters here,
and the tower must be complete at the end.
"""
from __future__ import annotations

import torch

from nbgen.models.layers import default_weight_loader


class DirectWeights:
    """Parameters filled one tensor at a time by name; ``check_complete`` raises for any left unset."""

    def __init__(self, params: dict[str, torch.Tensor], model_name: str) -> None:
        self.params = params
        self.model_name = model_name
        self.seen: set[str] = set()

    def load(self, key: str, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (checkpoint name ``name``) into the parameter ``key``; ValueError if none."""
        param = self.params.get(key)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {self.model_name}")
        with torch.no_grad():
            default_weight_loader(param, tensor)
        self.seen.add(key)

    def check_complete(self) -> None:
        """ValueError naming the tower tensors the checkpoint did not have."""
        missing = sorted(set(self.params) - self.seen)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} vision tensor(s), e.g. {missing[:5]}")
