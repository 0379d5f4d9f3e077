"""Host buffers for a step's host-to-device copies, used in turn behind an event each.

A graph runner or kernel wrapper writes a step's inputs (ids, positions, page tables) into a host buffer with
numpy and copies it to the GPU without a host sync. Under overlap scheduling the next step is written while
earlier copies may still be queued, so the host memory they read must not be overwritten yet: two sets of
buffers are used in turn, and a set is handed out again only once the GPU has run the copies queued from it.
On a GPU the buffers are pinned (asynchronous copies); without one (the Triton interpreter's CPU tests) they
are plain memory and no events are recorded.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch


class StagingRing:
    """Two sets of host buffers used in turn for host->device copies (see the module docstring).
    ``make``: one set's tensors; ``cuda``: pin them and fence each set with an event."""

    def __init__(self, make: Callable[[], list[torch.Tensor]], cuda: bool = True) -> None:
        self._cuda = cuda
        self._sets = [[t.pin_memory() if cuda else t for t in make()] for _ in range(2)]
        self._np = [[t.numpy() for t in st] for st in self._sets]
        self._events: list[Optional[torch.cuda.Event]] = [None, None]
        self._i = 0

    def next(self) -> tuple[list[torch.Tensor], list[np.ndarray]]:
        """The next set (its tensors and their numpy views), once its previous copies have run."""
        self._i ^= 1
        ev = self._events[self._i]
        if ev is not None:
            ev.synchronize()
        return self._sets[self._i], self._np[self._i]

    def done(self) -> None:
        """Mark the copies from the current set as queued (recorded behind them on the stream)."""
        if not self._cuda:
            return
        ev = self._events[self._i]
        if ev is None:
            ev = self._events[self._i] = torch.cuda.Event()
        ev.record()                 # re-recorded: synchronize waits for the latest record
