"""What a Qwen2(.5)-VL tower forward needs besides the pixels, planned once per grid signature: the
patches' 2-D rotary cos/sin, the window order and its inverse, and the attention segments of every
block (``SegmentPlan``: whole frames, or Qwen2.5's windows).

Plans depend only on the images' grids, so ``PlanCache`` keeps the latest few by grid tuple (a batch of
equal images, or a folder of photos the processor resizes to a few sizes, repeats them). Every index and
table reaches the device through pinned memory without a host sync: a plain copy would wait for the
LLM steps queued before the tower and leave the GPU idle while the tower's kernels are launched.
A CUDA graph of the tower holds its plan (``VisionTower.plan``), whatever the cache evicts later.
``vision_sdpa`` picks the attention kernels a vision tower's forward may use.
"""
from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Grid = tuple[int, int, int]
PLAN_CACHE_SIZE = 8          # grid signatures whose plans stay on the device


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; CUDA: through pinned memory, no host sync (the pinned block is
    kept by torch's host allocator until the copy ran)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# cuDNN's fused attention is left out: it builds an execution plan for every new (batch, length, stride)
# shape, tens to hundreds of milliseconds each on the loop thread, and a tower's batch changes with each
# prefill step (25, 26, 27, 28 images ... -> new shapes for the windows and the full-attention blocks)
_VISION_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def vision_sdpa(device: torch.device) -> ContextManager:
    """Around a vision tower's forward: on CUDA, scaled_dot_product_attention runs flash attention
    (memory-efficient or math where flash cannot), never cuDNN (see ``_VISION_SDPA``); elsewhere as is."""
    return sdpa_kernel(_VISION_SDPA) if device.type == "cuda" else contextlib.nullcontext()


class SegmentPlan:
    """Attention within consecutive segments of ``lengths`` rows (images, frames or windows), planned once
    per grid signature and reused by every layer: the segments of one length that lie back to back are a
    plain view [B, n, H, D] of q, k, v (no copy; a batch of equal images or full windows is one view);
    the segments of a length scattered among others are gathered by one precomputed index."""

    def __init__(self, lengths: Sequence[int], device: torch.device) -> None:
        self.total = sum(lengths)
        runs: dict[int, list[tuple[int, int]]] = defaultdict(list)      # length -> [(first row, segments)]
        pos, prev = 0, -1
        for n in lengths:
            if n:
                if n == prev and runs[n][-1][0] + runs[n][-1][1] * n == pos:
                    first, count = runs[n][-1]
                    runs[n][-1] = (first, count + 1)
                else:
                    runs[n].append((pos, 1))
            prev = n
            pos += n
        # (segment length n, segments B, first row of a back-to-back run or None, gather index [B * n] or None)
        self.groups: list[tuple[int, int, Optional[int], Optional[torch.Tensor]]] = []
        for n, rs in runs.items():
            if len(rs) == 1:
                self.groups.append((n, rs[0][1], rs[0][0], None))
                continue
            firsts = [f + j * n for f, c in rs for j in range(c)]
            idx = to_device_async((torch.tensor(firsts)[:, None] + torch.arange(n)).reshape(-1), device)
            self.groups.append((n, len(firsts), None, idx))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal attention per segment; q, k, v [N, H, D] (any row stride) -> [N, H, D]."""
        N, H, D = q.shape
        if len(self.groups) == 1 and self.groups[0][2] == 0 and self.groups[0][0] * self.groups[0][1] == N:
            n, B = self.groups[0][0], self.groups[0][1]
            o = F.scaled_dot_product_attention(*(t.view(B, n, H, D).transpose(1, 2) for t in (q, k, v)))
            return o.transpose(1, 2).reshape(N, H, D)                            # [B, H, n, D] -> rows
        out = q.new_empty(N, H, D)                        # every row lies in one segment of length > 0
        for n, B, first, idx in self.groups:
            if idx is None:
                qs, ks, vs = (t[first: first + B * n].reshape(B, n, H, D).transpose(1, 2) for t in (q, k, v))
            else:
                qs, ks, vs = (t.index_select(0, idx).view(B, n, H, D).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(B * n, H, D)
            if idx is None:
                out[first: first + B * n] = o
            else:
                out.index_copy_(0, idx, o)
        return out


@dataclass
class TowerPlan:
    """One grid signature's tower inputs besides the pixels (all on the device)."""

    grids: tuple[Grid, ...]
    cos: torch.Tensor                     # [N, Dh / 2] fp32, rows in window order when ``perm`` is set
    sin: torch.Tensor                     # [N, Dh / 2] fp32
    blocks: list[SegmentPlan]             # the attention segments of each block
    perm: Optional[torch.Tensor]          # [N / merge^2] merge units in window order, None: image order
    inverse: Optional[torch.Tensor]       # [N / merge^2] argsort(perm): merged tokens back to image order


def rotary_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """[N, 2] (row, column) of each patch in its image, patches in merge-block order (host tensor)."""
    return torch.cat([_grid_positions(*g, merge) for g in grids])


@functools.lru_cache(maxsize=64)
def _grid_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """``rotary_positions`` of one image (cached by grid: a batch of photos has few sizes)."""
    hh = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    ww = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    hw = torch.stack([hh.transpose(1, 2).reshape(-1), ww.transpose(1, 2).reshape(-1)], dim=-1)
    return hw.repeat(t, 1)


def window_order(grids: Sequence[Grid], merge: int, window_units: int) -> tuple[torch.Tensor, list[int]]:
    """(merge-unit order [N / merge^2] that makes each window of ``window_units`` x ``window_units`` merge
    units contiguous, window lengths in patches)."""
    orders, lengths, base = [], [], 0
    for t, h, w in grids:
        order, lens = _grid_windows(t, h, w, merge, window_units)
        orders.append(order + base)
        lengths.extend(lens)
        base += t * (h // merge) * (w // merge)
    return torch.cat(orders), lengths


@functools.lru_cache(maxsize=64)
def _grid_windows(t: int, h: int, w: int, merge: int, window_units: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``window_order`` of one image, from its first merge unit (cached by grid)."""
    unit = merge * merge
    gh, gw = h // merge, w // merge
    order, lengths = [], []
    for ti in range(t):
        for r0 in range(0, gh, window_units):
            for c0 in range(0, gw, window_units):
                ids = [ti * gh * gw + r * gw + c for r in range(r0, min(r0 + window_units, gh))
                       for c in range(c0, min(c0 + window_units, gw))]
                order.extend(ids)
                lengths.append(len(ids) * unit)
    return torch.tensor(order), tuple(lengths)


class PlanCache:
    """The latest ``size`` plans by grid tuple (least recently used dropped first)."""

    def __init__(self, build: Callable[[tuple[Grid, ...], torch.device], TowerPlan], size: int = PLAN_CACHE_SIZE) -> None:
        self.build, self.size = build, size
        self.plans: OrderedDict[tuple[tuple[Grid, ...], torch.device], TowerPlan] = OrderedDict()

    def get(self, grids: Sequence[Grid], device: torch.device) -> TowerPlan:
        key = (tuple(tuple(int(v) for v in g) for g in grids), torch.device(device))
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self.build(key[0], key[1])
            while len(self.plans) > self.size:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        return plan
