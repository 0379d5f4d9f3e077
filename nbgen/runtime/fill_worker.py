"""The grammar fill worker: one thread that runs a constrained step's accepts and bitmask fills in order.

``Constraints`` (runtime/constraints.py) queues each step's xgrammar work here so that it runs
beside the loop thread's Python: xgrammar's accept and fill release the GIL inside. Jobs run one at
a time in submission order, so a fill queued behind a step's accepts sees every matcher after its
token; the loop thread changes a matcher only while no job is queued (``drain`` waits for that).

A job starts only once the worker holds the GIL. While the loop thread runs Python it keeps the GIL
until its next blocking call or the interpreter's switch interval (5 ms), so ``submit`` blocks (GIL
released) until the job started running; the job's Python before it enters xgrammar is then short.
A step's accepts from 128 rows run in parts at once, beside the worker in side threads; the loop
thread wakes every part's thread together and waits once. The worker runs no torch work: the filled
bitmask goes to the device from the loop thread at sampling (``FillJob.on_device`` / ``into``, one
queued copy from the pinned buffer), since torch calls in the worker (each one a GIL hand-off) slowed
the loop thread's staging of the next step more than the copy costs it. The copy runs on a side stream
(``SideCopy``): at 256 rows of a 152k vocabulary it is ~5 MB, ~0.1-0.2 ms of PCIe that would otherwise
sit between the step's forward and its sampling on the compute stream; queued beside the forward still
running, it is hidden, and the compute stream waits only for its event. A greedy step's rows go into the
masked greedy heads' static buffer (``DeviceBitmask``), which their captured graphs read. ``FillJob`` is
the sampler's handle on one fill.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
from torch import Tensor

from nbgen.runtime.grammar_batch import accept_handles

T = TypeVar("T")

SPLIT_ACCEPT_MIN = 64  # rows at least in each part of a step's accept split over threads
ACCEPT_PARTS = 2       # parts at most of a step's accept (the first in the worker, the others in side threads)


@dataclass
class FillJob:
    """A bitmask fill started ahead of sampling: ``rows`` of ``bitmask`` once ``future`` is done."""

    rows: list[int]
    bitmask: Tensor                 # int32 [>= B, ceil(vocab/32)] host buffer
    future: Optional[cf.Future]     # None: filled inline already
    vocab: int = 0                  # the tokenizer's size: the bitmask covers ids [0, vocab)
    greedy: bool = False            # every row is constrained and greedy with nothing else to apply
    states: Optional[list[Any]] = None   # the rows' GrammarStates (worker fills: accept_async reuses them)
    handles: Optional[list[Any]] = None   # the states' matcher FFI handles, set by the worker's fill

    def on_device(self, n: int, device: torch.device, side: Optional[SideCopy] = None) -> Tensor:
        """The first n bitmask rows on ``device`` (call after ``wait``): a copy queued now, on ``side``'s
        stream when given (the current stream waits for it), else on the current stream. The pinned buffer
        is refilled only after this step resolved."""
        if side is None:
            return self.bitmask[:n].to(device, non_blocking=True)
        return side.to_device(self.bitmask[:n], device)

    def into(self, target: DeviceBitmask, n: int) -> bool:
        """Queue the first n filled rows into ``target``'s first rows (``DeviceBitmask.copy_in``: on a side
        stream the current one waits for; call after ``wait``); False (nothing queued) where they do not fit."""
        if not target.fits(n, self.bitmask.shape[1]):
            return False
        target.copy_in(self.bitmask[:n], self.vocab)
        return True

    def wait(self) -> None:
        """Wait for the fill; re-raises its error."""
        if self.future is not None:
            self.future.result()

    def settle(self) -> None:
        """Wait for the fill without raising (the buffer and matchers are free again afterwards)."""
        if self.future is not None:
            cf.wait([self.future])


class FillWorker:
    """One worker thread (started on first use) and the side threads of split accepts."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self._sides: list[cf.ThreadPoolExecutor] = []   # each runs one part of a split job beside the worker

    @property
    def started(self) -> bool:
        """The thread exists (a job was submitted once)."""
        return self._pool is not None

    def submit(self, fn: Callable[[], Any]) -> cf.Future:
        """Run fn in the worker thread after the jobs queued before it; returns once it started."""
        fut, started = _queue(self._worker_pool(), fn)
        started.wait()
        return fut

    def _worker_pool(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbgen-grammar-fill")
        return self._pool

    def _side_pool(self, k: int) -> cf.ThreadPoolExecutor:
        """Side thread k (started on first use): runs one part of a split job beside the worker."""
        while len(self._sides) <= k:
            self._sides.append(cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbgen-grammar-side"))
        return self._sides[k]

    def accept(self, handles: list[Any], toks: list[int]) -> cf.Future:
        """Queue the matchers ``handles`` (FFI objects) accepting ``toks`` (``accept_handles``); the
        future gives None or the refused positions. From 2 x SPLIT_ACCEPT_MIN rows they split into up to
        ACCEPT_PARTS parts of at least SPLIT_ACCEPT_MIN rows run at the same time (xgrammar's accept is a
        loop over the rows), the first in the worker, which then waits for the others' results, so a fill
        queued behind the job sees every token accepted. The loop thread wakes every part's thread at
        once and waits once for them all to start."""
        n = len(handles)
        parts = min(ACCEPT_PARTS, n // SPLIT_ACCEPT_MIN)
        if parts < 2:
            return self.submit(lambda: accept_handles(handles, toks))
        cut = [n * k // parts for k in range(parts + 1)]       # part k: rows [cut[k], cut[k + 1])
        sides = [_queue(self._side_pool(k - 1), lambda a=cut[k], b=cut[k + 1]: accept_handles(handles[a:b], toks[a:b]))
                 for k in range(1, parts)]

        def all_parts() -> Optional[set[int]]:
            bad = accept_handles(handles[:cut[1]], toks[:cut[1]])
            for (side, _), start in zip(sides, cut[1:]):
                more = side.result()
                if more:
                    bad = (bad or set()) | {start + k for k in more}
            return bad

        fut, started = _queue(self._worker_pool(), all_parts)
        for _, side_started in sides:
            side_started.wait()
        started.wait()
        return fut

    def drain(self) -> None:
        """Wait until every job queued so far ran (then the loop thread may change matchers)."""
        if self._pool is not None:
            self.submit(lambda: None).result()


class SideCopy:
    """Copies queued on a side stream of their own, beside the compute stream's queued work: the current
    stream waits only for their end (one event). Host tensors (tests, the CPU) copy in place."""

    def __init__(self) -> None:
        self._stream: Optional[Any] = None    # torch.cuda.Stream, made on first use
        self._done: Optional[Any] = None      # CUDA event recorded after the latest copy

    def run(self, device: torch.device, copy: Callable[[], T], after: Optional[Any] = None) -> T:
        """Queue ``copy()``'s work on the side stream, behind ``after`` (an event recorded on another
        stream, or None), and make the current stream wait for it; returns what ``copy`` returns."""
        if device.type != "cuda":
            return copy()
        if self._stream is None:
            self._stream, self._done = torch.cuda.Stream(device), torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            out = copy()
            self._done.record(self._stream)
        torch.cuda.current_stream(device).wait_event(self._done)
        return out

    def to_device(self, host: Tensor, device: torch.device) -> Tensor:
        """A copy of pinned ``host`` on ``device``, queued on the side stream (``run``)."""
        out = self.run(device, lambda: host.to(device, non_blocking=True))
        if device.type == "cuda":
            out.record_stream(torch.cuda.current_stream(device))   # allocated on the side stream, read here
        return out


class DeviceBitmask:
    """A static int32 [rows, ceil(width / 32)] device bitmask that captured graphs read (the masked greedy
    heads, runtime/greedy_heads.py). A step's filled rows are copied into its first rows (``copy_in``) behind
    the last read of it (``mark_read``); words past the tokenizer's ids stay zero (those ids never allowed)."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.words = torch.zeros(rows, -(-width // 32), dtype=torch.int32, device=device)
        self._read: Optional[Any] = None      # CUDA event recorded after the latest read
        self._side = SideCopy()

    def fits(self, n: int, words: int) -> bool:
        """n rows of ``words`` words each fit."""
        return n <= self.words.shape[0] and words <= self.words.shape[1]

    def copy_in(self, rows: Tensor, vocab: int) -> Tensor:
        """Queue pinned host rows [n, w] (a fill of ids [0, vocab)) into the first n rows, the bits past
        ``vocab`` in their last word cleared (xgrammar may leave them set): on a side stream, after the last
        read of the buffer; the current stream waits for it. -> words[:n]."""
        n, w = rows.shape
        dst = self.words[:n, :w]

        def copy() -> None:
            dst.copy_(rows, non_blocking=True)
            if vocab % 32 and (vocab - 1) // 32 < w:
                dst[:, (vocab - 1) // 32].bitwise_and_((1 << (vocab % 32)) - 1)

        self._side.run(self.words.device, copy, after=self._read)
        return self.words[:n]

    def mark_read(self) -> None:
        """Record (on the current stream) that the work queued so far read the buffer: the next ``copy_in``
        waits for it on its stream."""
        if not self.words.is_cuda:
            return                            # host tensors (tests): reads are done when queued
        if self._read is None:
            self._read = torch.cuda.Event()
        self._read.record(torch.cuda.current_stream(self.words.device))


def _queue(pool: cf.ThreadPoolExecutor, fn: Callable[[], Any]) -> tuple[cf.Future, threading.Event]:
    """Submit fn to pool -> (its future, an event set as it starts running): the caller waits on the
    event (GIL released) so the thread holds the GIL when it enters fn."""
    started = threading.Event()

    def work() -> Any:
        started.set()
        return fn()

    return pool.submit(work), started
