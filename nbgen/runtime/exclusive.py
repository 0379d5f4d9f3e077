"""Exclusive calls on the loop thread (weight updates, memory release), as SGLang's model-update lock.

SGLang's generate requests hold a reader lock for their whole life and a weight update takes the
writer lock, preferring writers: the update waits for the requests already submitted, and requests
submitted meanwhile wait for the update. ``ExclusiveCalls`` is that on the loop thread: queued calls
run once the engine has drained; submissions arriving while one is queued are held and admitted after.
"""
from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from typing import Any, Callable


class ExclusiveCalls:
    """Queued exclusive calls and the submissions held behind them (loop thread only)."""

    def __init__(self) -> None:
        self._calls: deque[tuple[Callable[[], Any], cf.Future]] = deque()
        self._held: list[tuple[list[Any], Any, bool]] = []    # (requests, sink, stream) of held submits

    @property
    def pending(self) -> bool:
        """A call is queued: new submissions are held."""
        return bool(self._calls)

    @property
    def num_held(self) -> int:
        """Submissions waiting behind the queued calls."""
        return len(self._held)

    def push(self, fn: Callable[[], Any], fut: cf.Future) -> None:
        """Queue ``fn``; ``fut`` gets its result (or exception) when it runs."""
        self._calls.append((fn, fut))

    def hold(self, reqs: list[Any], sink: Any, stream: bool) -> None:
        """Keep a submission until the queued calls ran."""
        self._held.append((reqs, sink, stream))

    def take(self, rids: list[str]) -> list[tuple[list[Any], Any, bool]]:
        """Remove and return the held submissions with a request among ``rids`` (being aborted)."""
        want = set(rids)
        taken, kept = [], []
        for h in self._held:
            (taken if any(r.rid in want for r in h[0]) else kept).append(h)
        self._held = kept
        return taken

    def run(self) -> list[tuple[list[Any], Any, bool]]:
        """Run every queued call in order (the engine is idle); return the held submissions to admit."""
        while self._calls:
            fn, fut = self._calls.popleft()
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(e)
        held, self._held = self._held, []
        return held
