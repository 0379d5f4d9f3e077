"""Pooling math for embedding requests: a step's final hidden rows -> per-request vectors.

Pure functions over tensors (nothing here knows requests or the runner): pick rows, sum a
request's rows of a chunk, and finish vectors (Matryoshka truncation, then L2 normalisation, as
SGLang's Pooler orders them). Sums and vectors are fp32 whatever the model's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def pick_rows(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """hidden [T, H], rows [N] (int64, same device) -> [N, H] fp32 (a copy: ``hidden`` may view
    a CUDA graph's output buffer, which the next replay overwrites)."""
    return hidden.index_select(0, rows).float()


def segment_sums(hidden: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
    """Per-segment sums in fp32: hidden [R, H] rows, owner [R] (int64: the segment of each row,
    in [0, n)) -> [n, H]. One index_add_ for every segment of the step."""
    out = torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, owner, hidden.float())


class PendingVectors:
    """A step's finished vectors on their way to the host: the copies are queued behind the step's
    GPU work (pinned buffers, non-blocking) and ``lists()`` waits for them. Built before the host
    moves on, so the next step can be scheduled and launched while this one still runs."""

    def __init__(self, vectors: torch.Tensor, dimensions: list[Optional[int]], normalize: list[bool]) -> None:
        self.n = len(dimensions)
        groups: dict[tuple[Optional[int], bool], list[int]] = {}
        for i, key in enumerate(zip(dimensions, normalize)):
            groups.setdefault(key, []).append(i)
        self._parts: list[tuple[list[int], torch.Tensor]] = []
        cuda = vectors.is_cuda
        for (dims, norm), idx in groups.items():
            v = vectors if len(idx) == self.n else vectors[idx]
            v = truncate(v, dims)
            v = l2_normalize(v) if norm else v
            if cuda:   # into pinned memory without blocking the host
                host = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=True)
                host.copy_(v, non_blocking=True)
                v = host
            self._parts.append((idx, v))
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Block until the copies have landed (CUDA; nothing to wait for on the CPU)."""
        if self._event is not None:
            self._event.synchronize()

    def lists(self) -> list[list[float]]:
        """The N vectors as lists of floats (waits for the copies on CUDA)."""
        self.wait()
        out: list[Optional[list[float]]] = [None] * self.n
        for idx, host in self._parts:
            for i, row in zip(idx, host.numpy().tolist()):     # numpy's tolist: ~2x torch's
                out[i] = row
        return out  # type: ignore[return-value]


def truncate(vectors: torch.Tensor, dimensions: Optional[int]) -> torch.Tensor:
    """The first ``dimensions`` components of each row (Matryoshka); all of them for None."""
    return vectors if dimensions is None else vectors[..., :dimensions]


def l2_normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Each row divided by its L2 norm (a zero row stays zero: eps 1e-12, as torch and SGLang)."""
    return F.normalize(vectors, p=2.0, dim=-1)
