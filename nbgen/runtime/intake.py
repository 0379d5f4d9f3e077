"""Intake: requests into the engine on the loop thread, and the callers' aborts.

A submission is held while an exclusive call (weight update, memory release) waits for the engine to
drain, and admitted after it runs; a session request first gets its whole prompt from its session;
each request is stamped with the weight version it will run under, then handed to ``Delivery``, and
refused at once when the memory is released. Aborts answer held submissions too. With overlap, the
stepper is flushed first wherever output ids must be final.
"""
from __future__ import annotations

from typing import Callable

from nbgen.core.request import Request
from nbgen.runtime.delivery import Delivery, Sink
from nbgen.runtime.exclusive import ExclusiveCalls
from nbgen.runtime.memory import MemoryService
from nbgen.runtime.sessions import SessionTable
from nbgen.runtime.weights import WeightService


class Intake:
    """Adds, holds and aborts requests for the LoopThread (loop thread only)."""

    def __init__(self, delivery: Delivery, exclusive: ExclusiveCalls, weights: WeightService,
                 memory: MemoryService, sessions: SessionTable, flush_overlap: Callable[[], None]) -> None:
        self.delivery, self.exclusive, self.weights, self.memory = delivery, exclusive, weights, memory
        # the loop's current stepper is flushed (looked up at each call: it may be replaced)
        self.sessions, self.flush_overlap = sessions, flush_overlap

    def run_exclusive(self) -> None:
        """Run the queued exclusive calls (the engine has drained), then admit what waited for them."""
        self.flush_overlap()
        for reqs, sink, stream in self.exclusive.run():
            self.add(reqs, sink, stream)
        self.delivery.publish()

    def add_or_hold(self, reqs: list[Request], sink: Sink, stream: bool) -> None:
        """Add the requests, or hold them while an exclusive call is queued."""
        if self.exclusive.pending:   # a weight update / memory release waits for the engine to drain
            self.exclusive.hold(reqs, sink, stream)
        else:
            self.add(reqs, sink, stream)

    def add_in_session(self, reqs: list[Request], sink: Sink, stream: bool) -> None:
        """Session requests get their whole prompt from their session (ValueError: none is added)."""
        self.flush_overlap()  # the continued requests' output ids are final
        for r in reqs:
            if r.session is not None:
                self.sessions.attach(r)
        self.add_or_hold(reqs, sink, stream)

    def add(self, reqs: list[Request], sink: Sink, stream: bool) -> None:
        """Stamp the weight version and track the requests; refused while the memory is released."""
        for r in reqs:
            r.weight_version = self.weights.version
        self.delivery.add(reqs, sink, stream)
        refusal = self.memory.refusal()
        if refusal is not None:      # held behind a memory release
            self.delivery.abort([r.rid for r in reqs], refusal)

    def abort(self, rids: list[str], message: str) -> None:
        """Abort requests, held ones included (answered now)."""
        self.flush_overlap()  # no placeholder token may reach an aborted request's output
        for held in self.exclusive.take(rids):   # waiting behind an exclusive call: answered now
            self.add(*held)
        self.delivery.abort(rids, message)
