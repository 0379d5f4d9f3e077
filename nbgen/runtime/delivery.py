"""Requests in flight on the loop thread: admission, and outputs back to the callers' sinks.

``RidRegistry`` (any thread) keeps request ids unique among unfinished requests. ``Delivery`` (loop
thread) tracks each submitted request (``Tracked``: text deltas, stop strings), hands it to the
scheduler (or to the ``GrammarService`` until its grammar is compiled), sends updates after each
step, answers requests the scheduler finished on its own, and keeps the stats snapshot fresh.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

from nbgen.core.finish import ABORT, FinishReason
from nbgen.core.request import Request, Status
from nbgen.runtime.grammar import GrammarService
from nbgen.runtime.loop_stats import LoopStats
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.stream_buffer import StreamBuffer, wake_all
from nbgen.runtime.tracker import Tracked, Update

logger = logging.getLogger("nbgen")

Sink = Callable[[Update], None]


class RidRegistry:
    """Ids submitted and not yet finished; ``claim`` refuses a duplicate (thread-safe)."""

    def __init__(self) -> None:
        self._rids: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, rids: list[str]) -> None:
        """Register all of ``rids`` or none: ValueError when one is in flight or repeated."""
        with self._lock:
            taken = sorted({rid for rid in rids if rid in self._rids})
            if taken or len(set(rids)) != len(rids):
                dup = taken or sorted({rid for rid in rids if rids.count(rid) > 1})
                raise ValueError(f"rid {dup[0]!r} is already used by a request that has not finished "
                                 f"(request ids must be unique)")
            self._rids.update(rids)

    def release(self, rids: list[str]) -> None:
        with self._lock:
            self._rids.difference_update(rids)

    def discard(self, rid: str) -> None:
        with self._lock:
            self._rids.discard(rid)


class Delivery:
    """Tracked requests of one loop: add / abort them, deliver a step's results (loop thread only)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any, vocab_size: int, page_size: int,
                 stats: LoopStats, rids: RidRegistry, post: Callable[..., None], stream_interval: int = 1,
                 jump_forward: bool = False) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._page_size = page_size
        self._stats = stats
        self._rids = rids
        self._post = post                 # post(fn, *args): run fn on the loop thread (thread-safe)
        self._stream_interval = stream_interval   # the engine's; a request's sampling param overrides it
        self._tracked: dict[str, Tracked] = {}
        self.grammar: Optional[GrammarService] = None   # made at the first constrained request
        self._jump_forward = jump_forward  # EngineConfig.enable_jump_forward (runtime/jump_forward.py)
        self._wakes: list[StreamBuffer] = []   # streams with new ids whose consumers are not woken yet

    # ---- requests in --------------------------------------------------------------------------
    def add(self, reqs: list[Request], sink: Sink, stream: bool) -> None:
        # a stream's consumer that makes its text from ids (runtime/stream_buffer.py) gets only the ids
        buffer = sink if stream and isinstance(sink, StreamBuffer) and sink.deferred else None
        for r in reqs:
            t = self._tracked[r.rid] = Tracked(r, sink, stream, self.tokenizer, self._stream_interval, buffer)
            if not r.params.constrained:
                self.scheduler.add(r)
                if r.finished:   # can never run (e.g. longer than the whole KV cache): answer now
                    self._emit(t)
            else:  # compiled in a worker thread; admitted once ready
                self._grammars().prepare(r)

    def _grammars(self) -> GrammarService:
        if self.grammar is None:
            self.grammar = GrammarService(self.tokenizer, self._vocab_size, self._post,
                                          admit=self._admit, finished=self.reap, jump_forward=self._jump_forward)
        return self.grammar

    def _admit(self, req: Request) -> None:
        self.scheduler.add(req)
        t = self._tracked.get(req.rid)
        if t is not None and req.finished:   # add() finishes a request that can never fit at once
            self._emit(t)

    def abort(self, rids: list[str], message: str) -> None:
        for rid in rids:
            if rid in self._tracked:
                self.scheduler.abort(rid, message)
                if self.grammar is not None:
                    self.grammar.abort(rid, message)
        self.reap()

    def fail_all(self, message: str) -> None:
        """At shutdown: every tracked request ends with an abort and is answered."""
        if self.grammar is not None:
            self.grammar.shutdown(message)
        for rid in list(self._tracked):
            t = self._tracked[rid]
            if not t.req.finished:
                try:
                    self.scheduler.abort(rid, message)
                except Exception:  # noqa: BLE001 - shutting down anyway
                    t.req.finish_reason = FinishReason.abort(message)
                    t.req.status = Status.FINISHED
            self._emit(t)

    # ---- outputs ------------------------------------------------------------------------------
    def deliver(self, changed: list[Request], n_in: int) -> None:
        """Send the step's changed requests to their callers, then count the step's tokens."""
        n_out = 0
        tracked, FINISHED = self._tracked, Status.FINISHED
        self.release_wakes()              # the previous step's, if no wait for the device came between
        wake = self._wakes
        for req in changed:
            t = tracked.get(req.rid)
            if t is None:
                continue
            m = len(req.output_ids)
            n_out += m - t.n_ids
            if req.status is not FINISHED:
                if t.quiet or (t.lazy and t.within_interval(m)):   # nothing to send yet
                    t.n_ids = m
                    continue
                if t.buffer is not None:                # only the new ids, to its consumer
                    if t.push_new():
                        wake.append(t.buffer)
                    continue
            self._emit(t)
        self.reap_outside()
        self._stats.account(n_in, n_out, self.snapshot())

    def release_wakes(self) -> None:
        """Wake the consumers of the streams the last step pushed ids to (the loop calls it right
        before it waits for the device, so they run then rather than during its host work)."""
        if self._wakes:
            wakes, self._wakes = self._wakes, []
            wake_all(wakes)

    def reap_outside(self) -> None:
        """Answer the requests the scheduler finished outside a step (refused, aborted, never fitting):
        its list of them, not a scan of every tracked request (thousands wait in a large batch)."""
        for req in self.scheduler.take_finished_outside():
            t = self._tracked.get(req.rid)
            if t is not None and t.req is req and req.finished:
                self._emit(t)

    def reap(self) -> None:
        """Deliver every tracked request that is finished (a scan: after aborts and failures)."""
        for t in [t for t in self._tracked.values() if t.req.finished]:
            self._emit(t)

    def _emit(self, t: Tracked) -> None:
        try:
            upd = t.advance(self.scheduler)
        except Exception as e:  # a failure inside one request fails only that request
            logger.exception("request %s failed", t.req.rid)
            msg = f"{type(e).__name__}: {e}"
            if not t.req.finished:
                self.scheduler.abort(t.req.rid, msg)
            else:                  # its output could not be built: say so rather than "length"/"stop"
                t.req.finish_reason = FinishReason.abort(msg)
            upd = t.final_update()
        if upd is None:
            return
        if upd.finished:
            self._tracked.pop(t.req.rid, None)
            self._rids.discard(t.req.rid)
            fr = t.req.finish_reason
            self._stats.finished(t.req.cached_tokens, aborted=fr is not None and fr.type == ABORT)
            self.publish()   # a caller that got its final output sees it gone from stats()
        try:
            t.sink(upd)
        except Exception:  # noqa: BLE001 - a broken caller must not stop the engine
            logger.exception("delivering output of %s failed", t.req.rid)

    # ---- stats --------------------------------------------------------------------------------
    def publish(self) -> None:
        """Refresh the stats() snapshot that callers read from other threads."""
        self._stats.publish(self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        held = len(self.grammar.held) if self.grammar is not None else 0   # waiting for a grammar
        return {"running": s["running"], "waiting": s["waiting"] + held, "kv_pages_used": s["pages_used"],
                "kv_pages_total": s["pages_total"], "prefix_cache_pages": s["prefix_cache_pages"],
                "page_size": self._page_size, "priorities": s["priorities"]}
