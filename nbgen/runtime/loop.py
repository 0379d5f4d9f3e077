"""LoopThread: one daemon thread with its own asyncio loop that owns scheduler, runner and model.

Callers cross only through ``submit`` / ``abort`` / ``call`` (thread-safe) and the per-request sinks
they pass in (thread-safe callables: a queue.put, or a call_soon_threadsafe onto the caller's loop).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import logging
import sys
import threading
from typing import Any, Callable, Optional

from nbgen.core.config import EngineConfig
from nbgen.core.batch import ScheduledBatch
from nbgen.runtime.loop_stats import LoopStats
from nbgen.core.request import Request
from nbgen.runtime.tracker import Tracked, Update

logger = logging.getLogger("nbgen")

Sink = Callable[[Update], None]


class LoopThread:
    """Starts the engine's owner thread; ``start()`` blocks until the model is loaded (or raises)."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._thread = threading.Thread(target=self._run, name="nbgen-engine", daemon=True)
        self._ready: cf.Future = cf.Future()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wake: Optional[asyncio.Event] = None
        self._stopping = False
        self._tracked: dict[str, Tracked] = {}
        self._stats = LoopStats()
        self.runner = None
        self.scheduler = None
        self.tokenizer = None
        self._overlap = None  # OverlapStepper when the runner overlaps CPU and GPU work (CUDA)
        self._grammar = None  # GrammarService, made at the first json_schema / regex / ebnf request
        self._stepped = False  # steps ran since the loop last went idle
        self._rids: set[str] = set()   # ids submitted and not yet finished (guarded by _rids_lock)
        self._rids_lock = threading.Lock()

    # ---- caller side (any thread) ---------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        self._thread.start()
        return self._ready.result()

    def submit(self, reqs: list[Request], sink: Sink, stream: bool) -> None:
        """Queue requests; ValueError (nothing queued) when a request id is already in flight."""
        rids = [r.rid for r in reqs]
        with self._rids_lock:
            taken = sorted({rid for rid in rids if rid in self._rids})
            if taken or len(set(rids)) != len(rids):
                dup = taken or sorted({rid for rid in rids if rids.count(rid) > 1})
                raise ValueError(f"rid {dup[0]!r} is already used by a request that has not finished "
                                 f"(request ids must be unique)")
            self._rids.update(rids)
        try:
            self._post(self._add, reqs, sink, stream)
        except RuntimeError:
            with self._rids_lock:
                self._rids.difference_update(rids)
            raise

    def abort(self, rids: list[str], message: str = "aborted by the caller", wait: bool = False) -> None:
        """Abort requests; with ``wait``, return once the loop has finished them (stats() agrees)."""
        fut: Optional[cf.Future] = cf.Future() if wait else None
        self._post(self._abort, rids, message, fut=fut)
        if fut is not None:
            self._wait(fut)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result (blocking)."""
        fut: cf.Future = cf.Future()
        self._post(fn, fut=fut)
        return self._wait(fut)

    def _wait(self, fut: cf.Future) -> Any:
        """The result of a posted call; RuntimeError if the loop thread dies before it runs."""
        while True:
            try:
                return fut.result(timeout=0.1)
            except cf.TimeoutError:
                if not self._thread.is_alive():
                    raise RuntimeError("engine is shut down") from None

    def stats(self) -> dict[str, Any]:
        return self._stats.read()

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._post(self._stop)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def _post(self, fn: Callable, *args: Any, fut: Optional[cf.Future] = None) -> None:
        if self._loop is None or self._stopping:
            raise RuntimeError("engine is shut down")
        try:
            self._loop.call_soon_threadsafe(self._wrap, fn, args, fut)
        except RuntimeError:  # loop already closed
            raise RuntimeError("engine is shut down") from None

    def _wrap(self, fn: Callable, args: tuple, fut: Optional[cf.Future]) -> None:
        """Run a posted call; its future (if any) resolves after the stats snapshot is refreshed."""
        result: Any = None
        error: Optional[BaseException] = None
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed back to the caller, or re-raised
            if fut is None:
                raise
            error = e
        finally:
            if self.scheduler is not None:
                self._publish()
            self._wake.set()
        if fut is not None:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    # ---- loop thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            info = self._build()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by start()
            self._ready.set_exception(e)
            loop.close()
            return
        self._loop = loop
        self._wake = asyncio.Event()
        self._ready.set_result(info)
        try:
            loop.run_until_complete(self._main())
        finally:
            if self._grammar is not None:
                self._grammar.shutdown("engine is shut down")
            self._fail_all("engine is shut down")
            self.runner = None
            loop.close()
            _thaw_heap()

    def _build(self) -> dict[str, Any]:
        import torch

        from nbgen.runtime.runner import ModelRunner
        from nbgen.runtime.scheduler import Scheduler, SchedulerConfig

        device = torch.device(self.cfg.resolve_device())
        runner = ModelRunner(self.cfg, device)
        ctx = runner.loaded.context_length
        on_gpu = device.type == "cuda"
        sc = SchedulerConfig(
            page_size=self.cfg.page_size, num_pages=runner.num_pages,
            max_running_requests=self.cfg.max_running_requests or (256 if on_gpu else 64),
            chunked_prefill_size=self.cfg.chunked_prefill_size or (8192 if on_gpu else 1024),
            schedule_policy=self.cfg.schedule_policy, disable_radix_cache=self.cfg.disable_radix_cache,
            context_length=ctx)
        self.runner = runner
        self.scheduler = Scheduler(sc)
        self.tokenizer = runner.loaded.tokenizer
        if getattr(runner, "overlap", False):
            from nbgen.runtime.overlap import OverlapStepper

            self._overlap = OverlapStepper(self)
        self._publish()
        _freeze_heap()
        return {"device": str(device), "scheduler": sc, "loaded": runner.loaded}

    async def _main(self) -> None:
        while not self._stopping:
            if self.scheduler.has_work() or (self._overlap is not None and self._overlap.busy):
                self._step()
                self._stepped = True
                await asyncio.sleep(0)  # let submissions / aborts / calls in between steps
            else:
                if self._stepped:
                    self._stepped = False
                    _freeze_new_code()
                self._wake.clear()
                await self._wake.wait()

    def _step(self) -> None:
        if self._overlap is not None:
            self._overlap.step()
            return
        batch = self.scheduler.schedule()
        self._reap()
        if batch is not None:
            self.run_step(batch)

    def run_step(self, batch: ScheduledBatch) -> None:
        """Run one batch synchronously and deliver its results."""
        try:
            out = self.runner.step(batch)
        except Exception as e:  # noqa: BLE001 - handed to fail_batch
            self.fail_batch(batch, e)
            return
        self.deliver(self.scheduler.update(batch, out), batch.num_prefill_tokens)

    def fail_batch(self, batch: ScheduledBatch, e: Exception) -> None:
        """A failing step aborts its own requests only; the engine goes on."""
        logger.exception("step failed")
        for s in batch.seqs:
            self.scheduler.abort(s.req.rid, f"{type(e).__name__}: {e}")
        self._reap()

    def deliver(self, changed: list[Request], n_in: int) -> None:
        """Send the step's changed requests to their callers, then count the step's tokens."""
        n_out = 0
        tracked = self._tracked
        for req in changed:
            t = tracked.get(req.rid)
            if t is None:
                continue
            m = len(req.output_ids)
            n_out += m - t.n_ids
            if t.quiet and not req.finished:   # the common decode step: nothing to send yet
                t.n_ids = m
                continue
            self._emit(t)
        self._reap()
        self._account(n_in, n_out)

    def _account(self, n_in: int, n_out: int) -> None:
        self._stats.account(n_in, n_out, self._snapshot())

    def _emit(self, t: Tracked) -> None:
        try:
            upd = t.advance(self.scheduler)
        except Exception as e:  # a failure inside one request fails only that request
            logger.exception("request %s failed", t.req.rid)
            msg = f"{type(e).__name__}: {e}"
            if not t.req.finished:
                self.scheduler.abort(t.req.rid, msg)
            else:                  # its output could not be built: say so rather than "length"/"stop"
                t.req.finish_reason = {"type": "abort", "message": msg}
            upd = t.final_update()
        if upd is None:
            return
        if upd.finished:
            self._tracked.pop(t.req.rid, None)
            with self._rids_lock:
                self._rids.discard(t.req.rid)
            self._stats.finished(t.req.cached_tokens)
            self._publish()   # a caller that got its final output sees it gone from stats()
        try:
            t.sink(upd)
        except Exception:  # noqa: BLE001 - a broken caller must not stop the engine
            logger.exception("delivering output of %s failed", t.req.rid)

    def _reap(self) -> None:
        """Deliver requests the scheduler finished on its own (aborted, or too big to ever fit)."""
        for t in [t for t in self._tracked.values() if t.req.finished]:
            self._emit(t)

    def _publish(self) -> None:
        """Refresh the stats() snapshot that callers read from other threads."""
        self._stats.publish(self._snapshot())

    def _snapshot(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        held = len(self._grammar.held) if self._grammar is not None else 0   # waiting for a grammar
        return {"running": s["running"], "waiting": s["waiting"] + held, "kv_pages_used": s["pages_used"],
                "kv_pages_total": s["pages_total"], "prefix_cache_pages": s["prefix_cache_pages"],
                "page_size": self.cfg.page_size}

    def _add(self, reqs: list[Request], sink: Sink, stream: bool) -> None:
        for r in reqs:
            t = self._tracked[r.rid] = Tracked(r, sink, stream, self.tokenizer)
            if r.params.json_schema is None and r.params.regex is None and r.params.ebnf is None:
                self.scheduler.add(r)
                if r.finished:   # can never run (e.g. longer than the whole KV cache): answer now
                    self._emit(t)
            else:  # compiled in a worker thread; admitted once ready
                self._grammars().prepare(r)

    def _grammars(self) -> Any:
        if self._grammar is None:
            from nbgen.runtime.grammar import GrammarService

            self._grammar = GrammarService(self.tokenizer, self.runner.vocab_size, self._post,
                                           admit=self._admit, finished=self._reap)
        return self._grammar

    def _admit(self, req: Request) -> None:
        self.scheduler.add(req)
        t = self._tracked.get(req.rid)
        if t is not None and req.finished:   # add() finishes a request that can never fit at once
            self._emit(t)

    def _abort(self, rids: list[str], message: str) -> None:
        if self._overlap is not None:
            self._overlap.flush()  # no placeholder token may reach an aborted request's output
        for rid in rids:
            if rid in self._tracked:
                self.scheduler.abort(rid, message)
                if self._grammar is not None:
                    self._grammar.abort(rid, message)
        self._reap()

    def _fail_all(self, message: str) -> None:
        for rid in list(self._tracked):
            t = self._tracked[rid]
            if not t.req.finished:
                try:
                    self.scheduler.abort(rid, message)
                except Exception:  # noqa: BLE001 - shutting down anyway
                    t.req.finish_reason = {"type": "abort", "message": message}
                    t.req.status = type(t.req.status).FINISHED
            self._emit(t)

    def _stop(self) -> None:
        if self._overlap is not None:
            self._overlap.flush()
        self._stopping = True


_frozen_by = 0                 # live loops that froze the heap
_modules_at_freeze = 0         # len(sys.modules) at the last freeze
_frozen_lock = threading.Lock()


def _freeze_heap() -> None:
    """Move every object alive after start-up (torch, transformers, the model's modules) out of the
    cyclic GC's reach. Otherwise a full collection, which a batch's many short-lived objects trigger
    every so often, walks millions of them while holding the GIL: on the H100 host one took 0.28 s in
    the middle of W-nano's prefill, with the GPU idle (vLLM and SGLang freeze after start-up too)."""
    global _frozen_by, _modules_at_freeze
    with _frozen_lock:
        _frozen_by += 1
        gc.collect()
        gc.freeze()
        _modules_at_freeze = len(sys.modules)


def _freeze_new_code() -> None:
    """At an idle point after steps: freeze again if modules were imported since the last freeze.

    The first steps load code lazily (on CUDA the first prefill brings flashinfer's prefill module and
    its imports: ~220k objects on the H100 host); left unfrozen, a later full collection walked them in
    0.12 s in the middle of a W-nano run. ``gc.freeze()`` without a collection is O(1); cyclic garbage
    alive at that moment stays uncollected until the last engine stops (bounded: only when code was
    loaded, which happens a few times per process)."""
    global _modules_at_freeze
    with _frozen_lock:
        if _frozen_by > 0 and len(sys.modules) != _modules_at_freeze:
            _modules_at_freeze = len(sys.modules)
            gc.freeze()


def _thaw_heap() -> None:
    """After the last live loop stops, frozen objects become collectable again (and get finalised at
    exit: extension objects left frozen are reported as leaks there)."""
    global _frozen_by
    with _frozen_lock:
        _frozen_by = max(0, _frozen_by - 1)
        if _frozen_by == 0:
            gc.unfreeze()
