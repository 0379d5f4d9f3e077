"""Building an engine's LoRA manager (``enable_lora``): the rank and target limits (given, or inferred
from the ``lora_paths`` adapters as SGLang), the GPU slot pool on CUDA, the initial adapters.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from nbgen.kernels import lora_sgmv
from nbgen.models.lora_adapter import MODULE_MAP, read_adapter_config
from nbgen.runtime.lora import LoRAManager
from nbgen.runtime.lora_batch import LoRABatchLimit


def inferred_limits(cfg: Any) -> tuple[Optional[int], Optional[tuple[str, ...]]]:
    """(max rank, allowed target modules) of an engine, as SGLang: ``max_lora_rank`` and
    ``lora_target_modules`` when given, else inferred from the ``lora_paths`` adapters (the largest
    rank, the union of their targets); None = no limit (no adapters given)."""
    confs = [read_adapter_config(spec["lora_path"]) for spec in cfg.lora_paths or []]
    rank = cfg.max_lora_rank if cfg.max_lora_rank is not None else max((int(c["r"]) for c in confs), default=None)
    if cfg.lora_target_modules is not None:
        return rank, tuple(cfg.lora_target_modules)
    names: set[str] = set()
    for c in confs:
        t = c.get("target_modules") or []
        names.update([t] if isinstance(t, str) else t)
    # a pattern (peft's "all-linear", a regex) names no module list: no limit
    return rank, (tuple(sorted(names)) if confs and names <= set(MODULE_MAP) else None)


def make_lora_manager(cfg: Any, model: nn.Module, dtype: torch.dtype, device: torch.device,
                      slots: Optional[bool] = None, graph_rows: int = 0) -> Optional[LoRAManager]:
    """The manager of an ``enable_lora`` engine (None otherwise), adapters not loaded yet
    (``load_initial``). ``slots``: the slot pool and kernels (default: on CUDA with Triton), of the
    engine's max rank (16 when nothing says)."""
    if not cfg.enable_lora:
        return None
    if slots is None:
        slots = device.type == "cuda" and lora_sgmv.available()
    max_rank, targets = inferred_limits(cfg)
    # a blocked request lets a full batch of admissions pass it before the scan stops at it
    limit = LoRABatchLimit(cfg.max_loras_per_batch, patience=cfg.max_running_requests)
    return LoRAManager(model, dtype, device, cfg.max_loaded_loras, max_rank, targets, limit,
                       (max_rank or 16) if slots else None, graph_rows)


def load_initial(mgr: Optional[LoRAManager], cfg: Any) -> None:
    """Load the ``lora_paths`` adapters (after norm folding: their A are folded at load)."""
    if mgr is None:
        return
    for spec in cfg.lora_paths or []:
        mgr.load(spec["lora_name"], spec["lora_path"], bool(spec.get("pinned", False)))
