"""LoRA's hooks in the fused linears (``models/linear.py``'s ``lora``) and a step's adapter rows.

A hook adds, into its linear's output, the low-rank products of the rows of each adapter of the step
the manager (``runtime/lora.py``) activated: per adapter in torch (CPU, the reference), or through the
slot pool's segmented Triton kernels (CUDA, ``kernels/lora_sgmv.py``), which read the row layout from
tensors only, so decode graphs capture them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from nbgen.core.batch import ScheduledBatch
from nbgen.kernels import lora_sgmv
from nbgen.models.lora_adapter import MODULE_MAP, ModuleLoRA
from nbgen.runtime.lora_slots import SlotLinear, SlotStep
from nbgen.runtime.step_inputs import to_device


@dataclass
class LoRASegment:
    """The rows of one adapter in a step's flat token stream."""

    lora_id: int
    rows: Optional[torch.Tensor]     # [n] int64 row indices on the device; None = every row


@dataclass
class LoRAStep:
    """The per-step adapter info, built by the runner from its batch's requests: torch segments
    (CPU) or the slot pool's row layout (CUDA)."""

    segments: list[LoRASegment]
    slots: Optional[SlotStep] = None


def torch_step(batch: ScheduledBatch, starts: list[int], device: torch.device) -> LoRAStep:
    """The torch path's step: each adapter's rows of the batch's flat stream (``starts``: each seq's
    first row) as one index tensor (None when the adapter has every row)."""
    rows: dict[int, list[int]] = {}
    total = 0
    for s, start in zip(batch.seqs, starts):
        total += s.q_len
        if s.req.lora_id is not None:
            rows.setdefault(s.req.lora_id, []).extend(range(start, start + s.q_len))
    return LoRAStep([LoRASegment(i, None if len(r) == total else to_device(r, device)) for i, r in rows.items()])


class StepState:
    """The step the hooks serve now (None outside LoRA steps); shared by every hook of a model."""

    def __init__(self) -> None:
        self.step: Optional[LoRAStep] = None


@dataclass
class DenseLoRA:
    """One adapter's weights of one linear laid out for the torch path: two matmuls, no per-shard loop."""

    a_t: torch.Tensor              # [in, R] all shards' A rows, transposed (contiguous)
    b_t: torch.Tensor              # [R, out] the shards' B (times scaling) in their output columns, 0 elsewhere


def dense_lora(w: ModuleLoRA, out_features: int) -> DenseLoRA:
    """``w`` as one block-sparse product: delta = (x @ a_t) @ b_t (scaling folded into b_t, fp32, rounded once)."""
    b_t = torch.zeros(w.a.shape[0], out_features, dtype=torch.float32, device=w.a.device)
    for sh in w.shards:
        b_t[sh.a_lo:sh.a_hi, sh.out_lo:sh.out_hi] = sh.b.float().t() * w.scaling
    return DenseLoRA(w.a.t().contiguous(), b_t.to(w.a.dtype))


class LinearLoRA:
    """The hook in one fused linear: adds x[rows] @ A^T @ B^T * scaling into y's shard columns."""

    def __init__(self, state: StepState, out_features: int) -> None:
        self.state = state
        self.out_features = out_features
        self.weights: dict[int, DenseLoRA] = {}    # lora_id -> this linear's weights of that adapter (torch path)
        self.slots: Optional[SlotLinear] = None    # this linear's slots of the pool (CUDA)
        self.scaling: Optional[torch.Tensor] = None  # [S] fp32 per slot (the pool's)

    def add(self, lora_id: int, w: ModuleLoRA) -> None:
        """An adapter's weights of this linear (the torch path's layout; the slot pool copies its own)."""
        self.weights[lora_id] = dense_lora(w, self.out_features)

    @property
    def active(self) -> bool:
        return self.state.step is not None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x [T, in], y [T, out] (the base output, changed in place)."""
        ks = self.state.step.slots
        if ks is not None:
            sl = self.slots
            lora_sgmv.lora_sgmv(x, y, sl.a, sl.b, self.scaling, ks.perm, ks.seg_start, ks.seg_len,
                                sl.bounds, sl.nshard, ks.max_rows)
            return
        for seg in self.state.step.segments:
            w = self.weights.get(seg.lora_id)
            if w is None:        # the adapter does not target this linear
                continue
            if seg.rows is None:
                y.addmm_(x @ w.a_t, w.b_t)                            # y += (x A^T) B^T s, in place
            else:
                y.index_add_(0, seg.rows, (x.index_select(0, seg.rows) @ w.a_t) @ w.b_t)


def install_hooks(model: nn.Module, state: StepState) -> dict[tuple[int, str], LinearLoRA]:
    """A hook in every fused linear an adapter may target, per (layer, submodule), sharing ``state``."""
    hooks: dict[tuple[int, str], LinearLoRA] = {}
    for i, layer in enumerate(model.model.layers):
        for sub in sorted({sub for sub, _ in MODULE_MAP.values()}):
            linear = layer.get_submodule(sub)
            linear.lora = hooks[(i, sub)] = LinearLoRA(state, linear.weight.shape[0])
    return hooks
