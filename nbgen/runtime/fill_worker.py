"""The grammar fill worker: one thread that runs a constrained step's accepts and bitmask fills in order.

``Constraints`` (runtime/constraints.py) queues each step's xgrammar work here so that it runs
beside the loop thread's Python: xgrammar's accept and fill release the GIL inside. Jobs run one at
a time in submission order, so a fill queued behind a step's accepts sees every matcher after its
token; the loop thread changes a matcher only while no job is queued (``drain`` waits for that).

A job starts only once the worker holds the GIL. While the loop thread runs Python it keeps the GIL
until its next blocking call or the interpreter's switch interval (5 ms), so ``submit`` blocks (GIL
released) until the job started running; the job's Python before it enters xgrammar is then short.
On CUDA the worker also queues the filled bitmask's copy to the device on a side stream
(``copy_out``), so the copy runs beside the queued forward instead of before the sampling.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable, Optional

import torch
from torch import Tensor


class FillWorker:
    """One worker thread (started on first use) and, on CUDA, its side stream for bitmask copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self._stream: Optional[Any] = None         # CUDA: the bitmask copies' side stream

    @property
    def started(self) -> bool:
        """The thread exists (a job was submitted once)."""
        return self._pool is not None

    def submit(self, fn: Callable[[], Any]) -> cf.Future:
        """Run fn in the worker thread after the jobs queued before it; returns once it started."""
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbgen-grammar-fill")
        started = threading.Event()

        def work() -> Any:
            started.set()
            return fn()

        fut = self._pool.submit(work)
        started.wait()
        return fut

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
