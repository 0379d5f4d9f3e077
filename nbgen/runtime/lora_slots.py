"""The GPU slot pool of LoRA serving: ``max_loras_per_batch`` slots of stacked A/B per fused linear,
the adapters a step uses copied in on demand (least recently used unpinned slot evicted), and each
step's rows grouped by slot for the segmented kernels (``kernels/lora_sgmv.py``).

Admission (``runtime/lora_batch.py``) keeps a batch at ``max_loras_per_batch`` adapters at most, so
a step's adapters always find slots. Copies into a slot are queued on the stream behind the steps
already queued, which read the slot's previous adapter first.

A step's rows are given per seq (its slot, first row, row count): a decode seq has one row, a prefill
chunk a run of rows of one adapter; ``segment_layout`` groups them by slot with numpy (no Python loop
over rows). A step replayed from CUDA graphs (decode graphs, piecewise prefill graphs) reads its row
layout from static buffers (``graph_step``), filled by ``stage`` from a pinned staging ring before the
replay; eager steps get fresh tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from nbgen.models.linear import MergedColumnParallelLinear, QKVParallelLinear
from nbgen.models.lora_adapter import AdapterWeights
from nbgen.kernels.host_staging import StagingRing


@dataclass
class SlotStep:
    """A step's rows by slot: slot s owns rows ``perm[seg_start[s] : seg_start[s] + seg_len[s]]``."""

    perm: torch.Tensor            # [rows] int32 row indices grouped by slot
    seg_start: torch.Tensor       # [S] int32
    seg_len: torch.Tensor         # [S] int32
    max_rows: Optional[int]       # rows one slot holds at most (None: the step's row count)


class SlotLinear:
    """One fused linear's slots: a [S, nshard * R, in], b [S, out, R]; shard bounds of the output."""

    def __init__(self, linear: nn.Module, slots: int, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        out, k = linear.weight.shape
        if isinstance(linear, QKVParallelLinear):
            self.shards = [linear.shard_rows(s) for s in ("q", "k", "v")]
        elif isinstance(linear, MergedColumnParallelLinear):
            self.shards = [linear.shard_rows(i) for i in range(len(linear.output_sizes))]
        else:
            self.shards = [(0, out)]
        self.nshard = len(self.shards)
        ends = [lo + n for lo, n in self.shards]
        self.bounds = (ends[0] if self.nshard > 1 else out, ends[1] if self.nshard > 2 else out)
        self.a = torch.zeros(slots, self.nshard * rank, k, dtype=dtype, device=device)
        self.b = torch.zeros(slots, out, rank, dtype=dtype, device=device)


class LoRASlots:
    """The pool: slot owners, LRU order, the weights per fused linear, the static step buffers."""

    def __init__(self, linears: dict[tuple[int, str], nn.Module], num_slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device, max_graph_rows: int) -> None:
        self.num_slots, self.rank, self.device = num_slots, rank, device
        self.linears = {key: SlotLinear(m, num_slots, rank, dtype, device) for key, m in linears.items()}
        self.scaling = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.owner: list[Optional[int]] = [None] * num_slots     # lora_id held by each slot
        self._lru: list[int] = list(range(num_slots))             # least recently used first
        # static step buffers the graphs read (decode rows or a prefill bucket's tokens):
        # seg_start [S] | seg_len [S] | padding to 128 bytes | perm [max_graph_rows]; a step copies the
        # head and its own rows of perm only
        self._rows = max_graph_rows
        self._head = -(-2 * num_slots // 32) * 32
        self._static = torch.zeros(self._head + max_graph_rows, dtype=torch.int32, device=device)
        self.graph_step = SlotStep(self._static[self._head:], self._static[:num_slots],
                                   self._static[num_slots:2 * num_slots], None)
        self._ring = StagingRing(lambda: [torch.zeros(self._static.numel(), dtype=torch.int32)]) \
            if device.type == "cuda" else None

    # ---- slots ----------------------------------------------------------------------------------
    def assign(self, ids: list[int], resident: dict[int, AdapterWeights], pinned: set[int]) -> dict[int, int]:
        """Slots of the adapters ``ids`` (distinct, at most ``num_slots``), copying in those not held;
        the victims: empty slots first, then the least recently used unpinned ones not in ``ids``."""
        if len(ids) > self.num_slots:
            raise RuntimeError(f"{len(ids)} LoRA adapters in one step, above max_loras_per_batch={self.num_slots}")
        held = {lid: s for s, lid in enumerate(self.owner) if lid is not None}
        out: dict[int, int] = {}
        for lid in ids:
            if lid in held:
                out[lid] = held[lid]
        for lid in ids:
            if lid in out:
                continue
            free = [s for s in self._lru if self.owner[s] is None] or \
                [s for s in self._lru if s not in out.values() and self.owner[s] not in pinned]
            slot = free[0]
            self._load(slot, lid, resident[lid])
            out[lid] = slot
        for s in out.values():                        # most recently used last
            self._lru.remove(s)
            self._lru.append(s)
        return out

    def _load(self, slot: int, lora_id: int, w: AdapterWeights) -> None:
        """Copy an adapter into a slot (zeros where it has no weights: those linears add nothing)."""
        self.owner[slot] = lora_id
        self.scaling[slot] = w.scaling
        for key, sl in self.linears.items():
            a, b = sl.a[slot], sl.b[slot]
            a.zero_()
            b.zero_()
            mod = w.modules.get(key)
            if mod is None:
                continue
            for sh in mod.shards:
                k = next(i for i, (lo, n) in enumerate(sl.shards) if lo <= sh.out_lo < lo + n)
                r = sh.a_hi - sh.a_lo
                a[k * self.rank: k * self.rank + r].copy_(mod.a[sh.a_lo:sh.a_hi], non_blocking=True)
                b[sh.out_lo:sh.out_hi, :r].copy_(sh.b, non_blocking=True)

    def reload(self, resident: dict[int, AdapterWeights]) -> None:
        """Copy every held adapter into its slot again (its weights changed: a refold)."""
        for s, lid in enumerate(self.owner):
            if lid is not None and lid in resident:
                self._load(s, lid, resident[lid])

    def tensors(self) -> list[torch.Tensor]:
        """The pool's device tensors (memory release offloads them with the weights)."""
        return [self.scaling, self._static] + [t for sl in self.linears.values() for t in (sl.a, sl.b)]

    def evict(self, lora_id: int) -> None:
        """An adapter was unloaded: its slot (if any) becomes empty."""
        for s, lid in enumerate(self.owner):
            if lid == lora_id:
                self.owner[s] = None

    # ---- a step's rows --------------------------------------------------------------------------
    def eager_step(self, slot: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> SlotStep:
        """The row layout of an eager step as device tensors (``segment_layout``'s arguments): one copy
        from pinned memory, queued on the stream (no host sync, so the loop keeps the GPU fed)."""
        perm, start, length = segment_layout(slot, starts, lens, self.num_slots)
        S, P = self.num_slots, max(len(perm), 1)
        host = np.zeros(P + 2 * S, dtype=np.int32)            # perm | seg_start | seg_len
        host[:len(perm)] = perm
        host[P:P + S] = start
        host[P + S:] = length
        buf = torch.from_numpy(host)
        if self.device.type == "cuda":
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        return SlotStep(buf[:P], buf[P:P + S], buf[P + S:], int(length.max()) if len(length) else 0)

    def stage(self, slot: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> None:
        """Fill the static buffers a graph replay reads (``segment_layout``'s arguments; no seq: every
        segment empty). Queued on the stream, no host sync."""
        perm, start, length = segment_layout(slot, starts, lens, self.num_slots)
        n = len(perm)
        if n > self._rows:
            raise RuntimeError(f"{n} LoRA rows in a graph step, above {self._rows}")
        S, h = self.num_slots, self._head
        if self._ring is None:
            host = np.zeros(h + n, dtype=np.int32)
        else:
            st, npv = self._ring.next()
            host = npv[0]
        host[:S] = start
        host[S:2 * S] = length
        host[h:h + n] = perm
        if self._ring is None:
            self._static[:h + n].copy_(torch.from_numpy(host))
            return
        self._static[:h + n].copy_(st[0][:h + n], non_blocking=True)
        self._ring.done()


def segment_layout(slot: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                   num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(perm, seg_start, seg_len) int32 of a step whose seq i owns rows ``starts[i] : starts[i] + lens[i]``
    under slot ``slot[i]`` (-1: the base model, in no segment): the rows grouped by slot, seqs of one
    slot in their batch order."""
    order = np.argsort(slot, kind="stable")
    order = order[np.count_nonzero(slot < 0):]                   # the adapter seqs, grouped by slot
    ln, st = lens[order], starts[order]
    length = np.bincount(slot[order], weights=ln, minlength=num_slots).astype(np.int32)
    total = int(length.sum())
    if total == len(order) and (ln == 1).all():                  # one row per seq (a decode step)
        perm = st.astype(np.int32)
    else:                                                        # runs: each seq's rows from its first
        first = np.cumsum(ln) - ln                               # each seq's first place in perm
        perm = (np.arange(total, dtype=np.int64) + np.repeat(st - first, ln)).astype(np.int32)
    return perm, np.cumsum(length, dtype=np.int32) - length, length


def seq_segments(ids: list[Optional[int]], q_lens: list[int],
                 slots: dict[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slot, first row, rows) per seq of a flat stream of ``q_lens`` rows per seq, seq i under adapter
    ``ids[i]`` (None: the base model, slot -1) held in ``slots[ids[i]]``: ``segment_layout``'s input."""
    n = len(ids)
    slot = np.fromiter((-1 if i is None else slots[i] for i in ids), dtype=np.int32, count=n)
    lens = np.asarray(q_lens, dtype=np.int64)
    return slot, np.cumsum(lens) - lens, lens
