"""A step's host-side inputs: the flat token stream of a ScheduledBatch, overlap placeholders, and
host->device copies of small index lists.

Placeholder ids (overlap scheduling): while step N still runs on the GPU, step N+1 is scheduled with
its sampled tokens unknown; the k-th sampled token of step N appears in N+1's inputs (and in the
requests' output ids) as ``placeholder(k)`` = -(k + 1), a negative id no vocabulary uses. The
runner fills those rows on the GPU from step N's sampled ids (``placeholder_row``); the overlap
stepper replaces them in the outputs once step N is resolved.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from nbgen.core.batch import ScheduledBatch, SeqWork

def placeholder(row: int) -> int:
    """The placeholder id for row ``row`` of the previous launch's sampled ids."""
    return -(row + 1)


def is_placeholder(token_id: int) -> bool:
    """True for a placeholder id (every real token id is >= 0)."""
    return token_id < 0


def placeholder_row(token_id: Any) -> Any:
    """The sampled-id row a placeholder names (ints or numpy arrays of placeholders)."""
    return -token_id - 1


@dataclass
class FlatStep:
    """A batch as one flat token stream (the model's input order)."""

    ids: list[int]              # [T] token ids (placeholders < 0 where overlap left them)
    positions: list[int]        # [T] position of each token in its sequence
    sample_rows: list[int]      # [S] row of each sampling seq's last token
    sample_seqs: list[SeqWork]  # [S] the sampling seqs, in row order
    starts: list[int]           # first row of every seq of the batch


def flatten(batch: ScheduledBatch) -> FlatStep:
    """The batch's flat token ids, positions, sampling rows and seq starts."""
    ids: list[int] = []
    pos: list[int] = []
    rows: list[int] = []
    seqs: list[SeqWork] = []
    starts: list[int] = []
    for s in batch.seqs:
        starts.append(len(ids))
        ids.extend(s.token_ids)
        d = s.req.rope_delta     # M-RoPE offset of text after the last image (chunks reaching one: vision_step)
        if s.tree_parents is None:
            pos.extend(range(s.start_pos + d, s.kv_len + d))
        else:                                   # a tree verify chunk: position = depth below its first token
            pos.extend(s.start_pos + d + x for x in s.tree_depths())
        if s.sample:
            rows.append(len(ids) - 1)
            seqs.append(s)
    return FlatStep(ids, pos, rows, seqs, starts)


def sampling_rows(batch: ScheduledBatch) -> tuple[list[SeqWork], list[int]]:
    """The batch's sampling seqs [S] and their rows in it ([] when every seq samples: the rows are 0..S-1)."""
    seqs = [s for s in batch.seqs if s.sample]
    if len(seqs) == len(batch.seqs):
        return seqs, []
    return seqs, [i for i, s in enumerate(batch.seqs) if s.sample]


def sampling_rows_first(seqs: list[SeqWork]) -> tuple[list[SeqWork], int]:
    """(seqs with the sampling ones first, each part in its order; S, the sampling seqs) where some seqs
    sample and some do not (jump-forward's forced rows), else (seqs, 0)."""
    first = [s for s in seqs if s.sample]
    if not first or len(first) == len(seqs):
        return seqs, 0
    return first + [s for s in seqs if not s.sample], len(first)


def positions_into(batch: ScheduledBatch, out: np.ndarray) -> None:
    """``flatten(batch).positions`` written straight into ``out`` (int64, at least the batch's token
    count): numpy ranges per seq, no Python list of ints (the prefill graphs' staging buffer)."""
    o = 0
    for s in batch.seqs:
        a, b = s.start_pos, s.kv_len
        d = s.req.rope_delta                    # M-RoPE offset of text after the last image, as flatten
        if b - a == 1:
            out[o] = a + d
        elif s.tree_parents is not None:        # a tree verify chunk: position = depth below its first token
            out[o:o + b - a] = np.asarray(s.tree_depths(), dtype=np.int64) + (a + d)
        else:
            out[o:o + b - a] = np.arange(a + d, b + d)
        o += b - a


def rope_deltas(seqs: Sequence[SeqWork]) -> np.ndarray:
    """[B] M-RoPE position offsets of one-token decode seqs (0 for text models and text prompts)."""
    return np.fromiter((s.req.rope_delta for s in seqs), dtype=np.int64, count=len(seqs))


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``; on CUDA through pinned memory without a host sync."""
    t = torch.from_numpy(np.asarray(values, dtype=np.int64))     # ~3x faster than torch.tensor(list)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def placeholder_patch(ids: list[int], last_tokens: Optional[torch.Tensor], device: torch.device
                      ) -> Optional[Callable[[torch.Tensor], None]]:
    """A function filling the placeholder ids of ``ids`` from ``last_tokens`` (the previous launch's
    sampled ids [S] on the device) in a step's input-id tensor, or None when there are none; the
    placeholders in ``ids`` become 0 on the host."""
    if not ids or min(ids) >= 0:         # min() runs at C speed on an 8k-id prefill step
        return None
    rows = [i for i, t in enumerate(ids) if is_placeholder(t)]
    if not rows:
        return None
    assert last_tokens is not None, "placeholder token without a previous launch"
    rows_t, src_t = to_device(rows, device), to_device([placeholder_row(ids[i]) for i in rows], device)
    for i in rows:
        ids[i] = 0

    def patch(input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, rows_t, last_tokens.index_select(0, src_t))
    return patch


class IdsToHost:
    """A step's sampled ids [S] copied to pinned host memory behind it, into buffers (and events) reused
    in turn: one goes out again only once the object that took it was read (its ``read`` attribute set)
    or is gone, else a fresh pair is made. Saves a pinned allocation and an event a step."""

    def __init__(self, capacity: int, n: int = 4) -> None:
        self._bufs = [torch.empty(capacity, dtype=torch.long, pin_memory=True) for _ in range(n)]
        self._events = [torch.cuda.Event() for _ in range(n)]
        self._holders: list[Optional[weakref.ref]] = [None] * n
        self._i = 0

    def copy(self, ids: torch.Tensor, holder: Any) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Queue the copy of ``ids`` (on the device): (pinned host tensor, event recorded after the copy).
        ``holder`` carries them until read; it sets ``holder.read`` once it has read the host tensor."""
        k = self._i = (self._i + 1) % len(self._bufs)
        ref = self._holders[k]
        prev = ref() if ref is not None else None
        if (prev is not None and not prev.read) or ids.numel() > len(self._bufs[k]) or ids.dtype != torch.long:
            host, ev = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True), torch.cuda.Event()
        else:
            host, ev = self._bufs[k][: ids.numel()], self._events[k]
            self._holders[k] = weakref.ref(holder)
        host.copy_(ids, non_blocking=True)
        ev.record()
        return host, ev
