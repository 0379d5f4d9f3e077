"""This process's place in a tensor-parallel group: the scope a model is built in, local head counts,
and agreeing on one number across the ranks.

The linears (``models/linear.py``) read ``get_tp()`` when they are built and keep their own
(tp_size, tp_rank), so the process-wide setting only needs to hold while a model is constructed.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from nbgen.models.linear import get_tp, set_tp


@contextmanager
def tp_scope(size: int, rank: int) -> Iterator[None]:
    """Build models inside as rank ``rank`` of ``size`` (restores the previous setting after)."""
    old = get_tp()
    set_tp(size, rank)
    try:
        yield
    finally:
        set_tp(*old)


def local_heads(num_q_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(q heads, kv heads) one rank holds: q heads split evenly; KV heads split, or replicated
    (one each) when there are more ranks than KV heads, as SGLang does."""
    if num_q_heads % tp_size:
        raise ValueError(f"tp_size must divide the model's {num_q_heads} attention heads, got {tp_size}")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"tp_size must divide the model's {num_kv_heads} KV heads (or be a multiple "
                         f"of it), got {tp_size}")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tp_size must be a multiple of the model's {num_kv_heads} KV heads when "
                         f"larger, got {tp_size}")
    return num_q_heads // tp_size, max(1, num_kv_heads // tp_size)


def check_tp_shapes(hf: Any, tp_size: int) -> None:
    """ValueError naming tp_size unless the model's heads, MLP width and hidden size split over
    ``tp_size`` ranks (checked before any worker starts)."""
    heads = hf.num_attention_heads
    local_heads(heads, getattr(hf, "num_key_value_heads", None) or heads, tp_size)
    for name in ("intermediate_size", "hidden_size"):
        if getattr(hf, name) % tp_size:
            raise ValueError(f"tp_size must divide the model's {name} ({getattr(hf, name)}), got {tp_size}")


def agree_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the ranks of the default process group (every rank calls this;
    KV pools must have the same number of pages everywhere: the page tables are shared)."""
    if get_tp()[0] == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())
