"""The STANDALONE draft model's share of the target's GPU memory budget.

The target sizes its KV pool from what ``mem_fraction_static`` leaves after its weights; the draft
model (``runtime/spec_draft_model.py``) loads afterwards with its own pool of the same page count.
So that both fit in the budget, the target's sizing subtracts the draft's weights and prices each
page at the target's plus the draft's K/V bytes (``DraftShare``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nbgen.core.config import EngineConfig
from nbgen.models.model_config import model_dims, read_model_config
from nbgen.models.registry import get_model_class, prepare_config


@dataclass(frozen=True)
class DraftShare:
    weight_bytes: int = 0          # the draft's parameters in the engine's dtype
    bytes_per_page: int = 0        # the draft's K and V of one page, all its layers


def draft_share(cfg: EngineConfig, dtype: torch.dtype) -> DraftShare:
    """What a STANDALONE draft of ``cfg`` takes from the budget (nothing for other configs). Its
    parameters are counted on the meta device: no weights are read."""
    if cfg.speculative_algorithm != "STANDALONE" or cfg.speculative_draft_model_path is None:
        return DraftShare()
    hf = prepare_config(read_model_config(cfg.speculative_draft_model_path, cfg.trust_remote_code))
    with torch.device("meta"):
        n = sum(p.numel() for p in get_model_class(hf)(hf).parameters())
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_item = 1 if cfg.kv_cache_dtype == "fp8_e4m3" else itemsize      # the draft's pool follows the target's
    layers, _, kv, head_dim = model_dims(hf)
    return DraftShare(n * itemsize, 2 * layers * cfg.page_size * kv * head_dim * kv_item)
