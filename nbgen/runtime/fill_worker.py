"""The grammar fill worker: one thread that runs a constrained step's accepts and bitmask fills in order.

``Constraints`` (runtime/constraints.py) queues each step's xgrammar work here so that it runs
beside the loop thread's Python: xgrammar's accept and fill release the GIL inside. Jobs run one at
a time in submission order, so a fill queued behind a step's accepts sees every matcher after its
token; the loop thread changes a matcher only while no job is queued (``drain`` waits for that).

A job starts only once the worker holds the GIL. While the loop thread runs Python it keeps the GIL
until its next blocking call or the interpreter's switch interval (5 ms), so ``submit`` blocks (GIL
released) until the job started running; the job's Python before it enters xgrammar is then short.
A step's accepts from 128 rows run as two halves at once, one in a side thread. On CUDA the worker
also queues the filled bitmask's copy to the device on a side stream (``copy_out``), so the copy
runs beside the queued forward instead of before the sampling.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from nbgen.runtime.grammar_batch import accept_handles

SPLIT_ACCEPT_MIN = 64  # rows in each half of a step's accept split over two threads


class FillWorker:
    """One worker thread (started on first use) and, on CUDA, its side stream for bitmask copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self._side: Optional[cf.ThreadPoolExecutor] = None   # runs part of a job beside the worker
        self._stream: Optional[Any] = None         # CUDA: the bitmask copies' side stream

    @property
    def started(self) -> bool:
        """The thread exists (a job was submitted once)."""
        return self._pool is not None

    def submit(self, fn: Callable[[], Any]) -> cf.Future:
        """Run fn in the worker thread after the jobs queued before it; returns once it started."""
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbgen-grammar-fill")
        return _started(self._pool, fn)

    def beside(self, fn: Callable[[], Any]) -> cf.Future:
        """Run fn in the side thread now, beside whatever the worker runs (a part of the job queued
        next, which waits for it); returns once it started."""
        if self._side is None:
            self._side = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbgen-grammar-side")
        return _started(self._side, fn)

    def accept(self, handles: list[Any], toks: list[int]) -> cf.Future:
        """Queue the matchers ``handles`` (FFI objects) accepting ``toks`` (``accept_handles``); the
        future gives None or the refused positions. From 2 x SPLIT_ACCEPT_MIN rows half of them run
        in the side thread at the same time (xgrammar's accept is a loop over the rows); the worker's
        half waits for it, so a fill queued behind the job sees every token accepted."""
        if len(handles) < 2 * SPLIT_ACCEPT_MIN:
            return self.submit(lambda: accept_handles(handles, toks))
        h = len(handles) // 2
        side = self.beside(lambda: accept_handles(handles[h:], toks[h:]))

        def both() -> Optional[set[int]]:
            bad, more = accept_handles(handles[:h], toks[:h]), side.result()
            if more:
                bad = (bad or set()) | {h + k for k in more}
            return bad

        return self.submit(both)

    def drain(self) -> None:
        """Wait until every job queued so far ran (then the loop thread may change matchers)."""
        if self._pool is not None:
            self.submit(lambda: None).result()

    def copy_out(self, rows: Tensor) -> tuple[Tensor, Any]:
        """Queue a copy of pinned bitmask rows to the device on the side stream (worker thread).
        -> (the device copy, its event)."""
        with torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            with torch.cuda.stream(self._stream):
                dev = rows.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        return dev, event


def _started(pool: cf.ThreadPoolExecutor, fn: Callable[[], Any]) -> cf.Future:
    """Submit fn to pool; return once it started running (the calling thread blocks, GIL released)."""
    started = threading.Event()

    def work() -> Any:
        started.set()
        return fn()

    fut = pool.submit(work)
    started.wait()
    return fut
