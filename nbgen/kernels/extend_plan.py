"""Host side of the causal chunk ("extend") attention (kernels/triton_extend.py): the launch shape, the split
rule, a step's block plan (numpy, no per-block Python) and the pinned staging of its tables.

The plan runs on every mixed step, so its tables (qo_indptr, kv_indptr, last_page_len, the blocks, and the
page indices when they come from the host) go to the device as one int32 transfer from a pinned host buffer
of a ``StagingRing`` (kernels/host_staging.py): a plan made while earlier steps are still queued (overlap
scheduling) never overwrites host memory a queued copy still reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from nbgen.kernels.host_staging import StagingRing

MAX_SPLITS = 8
MIN_SPLIT = 128        # prefix keys: a block's prefix is cut into splits of at least this many


@dataclass(frozen=True)
class ExtendShape:
    """The launch shape: tile rows (chunk tokens x q heads), KV tokens per tile, warps, K/V tiles in
    flight, page numbers one tile ahead, splits per (block, kv head) (None: ``num_splits``)."""

    block_m: int = 64
    block_n: int = 64
    warps: int = 4
    stages: int = 3
    ahead: bool = True
    splits: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {v}")
        if self.warps < 1 or self.stages < 1:
            raise ValueError(f"warps and stages must be >= 1, got {self.warps} and {self.stages}")


def num_splits(programs: int, longest: int, num_sms: int) -> int:
    """Splits per (block, kv head): about two programs an SM over ``programs`` (block, kv head) pairs, a
    power of 2 in [1, MAX_SPLITS], no split of the ``longest`` prefix under MIN_SPLIT keys."""
    want = min(2 * num_sms // max(1, programs), longest // MIN_SPLIT, MAX_SPLITS)
    return 1 << (max(1, want).bit_length() - 1)


@dataclass
class ExtendPlan:
    """A step's blocks, host side: per block its sequence and first chunk token (int32 [nb], longest
    prefix first), the split count; the tables' device copy is the wrapper's."""

    seq: np.ndarray
    first: np.ndarray
    splits: int


def plan_blocks(q_len: np.ndarray, kv_len: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Blocks of ``tokens`` chunk tokens per sequence (``q_len`` [B] chunk tokens, ``kv_len`` [B] KV
    lengths with them, int64), ordered by the keys every row of the block sees (longest first, ties in
    order) -> (seq [nb], first token [nb], longest prefix keys)."""
    per = -(-q_len // tokens)
    seq = np.repeat(np.arange(len(q_len), dtype=np.int32), per)
    first = (np.arange(len(seq)) - np.repeat(np.cumsum(per) - per, per)) * tokens
    seen = kv_len[seq] - q_len[seq] + first + 1
    order = np.argsort(-seen, kind="stable")
    return seq[order], first[order].astype(np.int32), int(seen.max()) if len(seen) else 0


class TableStaging:
    """A plan's int32 tables: written into a ``StagingRing``'s host buffers in turn, then copied to one device
    buffer in one transfer; both grow as needed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ring: Optional[StagingRing] = None
        self._size = 0                  # entries of each host buffer
        self._host: Optional[torch.Tensor] = None      # the buffer last handed out
        self._dev = torch.zeros(0, dtype=torch.int32, device=device)

    def host(self, n: int) -> np.ndarray:
        """The next host buffer's first ``n`` entries to fill, once the copy queued from it before ran."""
        if n > self._size:   # a larger ring (torch keeps a dropped pinned buffer until its queued copy ran)
            self._size = size = max(2 * n, 1024)
            self._ring = StagingRing(lambda: [torch.zeros(size, dtype=torch.int32)], cuda=self.device.type == "cuda")
        st, npv = self._ring.next()
        self._host = st[0]
        return npv[0][:n]

    def send(self, n: int) -> torch.Tensor:
        """Copy the current host buffer's first ``n`` entries to the device buffer -> its view [n]."""
        if self._dev.numel() < n:      # the old buffer: freed in stream order after the kernels that read it
            self._dev = torch.zeros(max(2 * n, 1024), dtype=torch.int32, device=self.device)
        dev = self._dev[:n]
        dev.copy_(self._host[:n], non_blocking=True)
        self._ring.done()               # behind the copy: host() waits for it before reusing the buffer
        return dev
