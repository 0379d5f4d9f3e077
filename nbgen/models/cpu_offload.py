"""CPU weight offloading (SGLang's ``cpu_offload_gb``): decoder layers whose weights live in pinned
host memory and are copied to the GPU just before they run.

The last ``n`` layers of the model (as many whole layers as fit the budget) give their parameters
to host memory. Every offloaded layer's parameters then point into one shared set of device
tensors (the staging buffers, one per parameter name, shaped like one layer's), and the layer's
``stage_in`` hook copies its host weights into them at the start of ``pre_attention``. Layers run one
after another on one stream, so a layer's copy lands after the previous layer's last read and
before its own first; the copies are ordinary stream work, so decode and prefill CUDA graphs capture
them like the kernels (pinned-memory copies are capturable) and replay the same weights.

Cost: every step reads the offloaded bytes over the host link (PCIe 5 x16: ~50 GB/s, against
~3 TB/s of HBM). Weights are never changed in place while offloaded: the engine refuses weight
updates and norm folding for such models (folding rescales weights once after loading; the staging
buffers are shared by many layers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

GIB = 1 << 30


@dataclass
class OffloadPlan:
    """What ``offload_layers`` moved: layer indices, host bytes, and the staging bytes kept on the device."""
    layers: list[int] = field(default_factory=list)
    host_bytes: int = 0
    staging_bytes: int = 0


class _StageIn:
    """Copies one layer's host weights into the shared staging tensors (the layer's ``stage_in``)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs          # (staging tensor on the device, this layer's pinned host tensor)

    def __call__(self) -> None:
        for staging, host in self.pairs:
            staging.copy_(host, non_blocking=True)


def _layer_params(layer: nn.Module) -> dict[str, nn.Parameter]:
    return dict(layer.named_parameters())


def plan_layers(layers: nn.ModuleList, budget_bytes: int) -> list[int]:
    """The indices of the last layers whose weights fit ``budget_bytes`` together (whole layers)."""
    per = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    n = min(len(layers), budget_bytes // per) if per else 0
    return list(range(len(layers) - n, len(layers)))


@torch.no_grad()
def offload_layers(model: nn.Module, cpu_offload_gb: float) -> Optional[OffloadPlan]:
    """Move the weights of the last layers worth ``cpu_offload_gb`` GiB to pinned host memory (CUDA
    models; see the module docstring). None when the model's weights are not on a GPU or the budget is
    0; a plan with no layers when the budget is smaller than one layer."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not cpu_offload_gb or layers is None or not len(layers):
        return None
    if not all(hasattr(m, "stage_in") for m in layers):
        raise ValueError(f"cpu_offload_gb: {type(model).__name__} has no offloadable decoder layers")
    if next(layers[0].parameters()).device.type != "cuda":
        return None
    plan = move_layers(layers, plan_layers(layers, int(cpu_offload_gb * GIB)), pin_memory=True)
    torch.cuda.empty_cache()
    return plan


@torch.no_grad()
def move_layers(layers: nn.ModuleList, idx: list[int], pin_memory: bool) -> OffloadPlan:
    """Give the layers ``idx`` host copies of their weights and point their parameters at one shared
    set of staging tensors on the weights' device, filled by each layer's ``stage_in``."""
    first = _layer_params(layers[0])
    shapes = {n: (p.shape, p.dtype) for n, p in first.items()}
    if any({n: (p.shape, p.dtype) for n, p in _layer_params(m).items()} != shapes for m in layers):
        raise ValueError("cpu_offload_gb: the model's layers differ in their weights' shapes")
    plan = OffloadPlan(layers=list(idx))
    if not idx:
        return plan
    staging = {n: torch.empty_like(p) for n, p in first.items()}
    plan.staging_bytes = sum(t.numel() * t.element_size() for t in staging.values())
    for i in idx:
        pairs = []
        for name, p in _layer_params(layers[i]).items():
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin_memory)
            host.copy_(p)
            p.data = staging[name]              # the device copy is freed with its last reference
            pairs.append((staging[name], host))
            plan.host_bytes += host.numel() * host.element_size()
        layers[i].stage_in = _StageIn(pairs)
    return plan
