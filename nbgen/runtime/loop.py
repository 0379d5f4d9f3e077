"""LoopThread: one daemon thread with its own asyncio loop that owns scheduler, runner and model.

Callers cross only through ``submit`` / ``abort`` / ``call`` (thread-safe) and the per-request sinks
they pass in (thread-safe callables: a queue.put, or a call_soon_threadsafe onto the caller's loop).
The loop runs steps while there is work and sleeps on an event otherwise; a step that raises aborts its
running requests, not the engine. Building the parts is ``engine_parts``; requests in and aborts are
``intake``; requests in flight and their outputs ``delivery``; the GC freeze ``gc_freeze``; the control
calls (sessions, profiling, cache flush, server info) ``loop_control``."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
from typing import Any, Callable, Optional

from nbgen.core.batch import ScheduledBatch
from nbgen.core.config import EngineConfig
from nbgen.core.multimodal import settle_all
from nbgen.core.request import Request
from nbgen.runtime.delivery import Delivery, RidRegistry, Sink
from nbgen.runtime.engine_parts import build_engine_parts
from nbgen.runtime.exclusive import ExclusiveCalls
from nbgen.runtime.gc_freeze import freeze_heap, freeze_new_code, thaw_heap
from nbgen.runtime.intake import Intake
from nbgen.runtime.loop_control import LoopControl
from nbgen.runtime.loop_stats import LoopStats
from nbgen.runtime.memory import MemoryService
from nbgen.runtime.overlap import OverlapStepper
from nbgen.runtime.profiler import StepProfiler
from nbgen.runtime.weights import WeightService
from nbgen.runtime.sessions import SessionTable
from nbgen.runtime.tp_group import TPGroup
from nbgen.runtime.spec_setup import make_spec_stepper

logger = logging.getLogger("nbgen")

__all__ = ["LoopThread", "Sink"]


class LoopThread(LoopControl):
    """Starts the engine's owner thread; ``start()`` blocks until the model is loaded (or raises)."""

    def __init__(self, cfg: EngineConfig, on_stage: Optional[Callable[[str], None]] = None) -> None:
        self.cfg = cfg
        self._on_stage = on_stage    # start-up stages, reported from this thread while it builds
        self._thread = threading.Thread(target=self._run, name="nbgen-engine", daemon=True)
        self._ready: cf.Future = cf.Future()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wake: Optional[asyncio.Event] = None
        self._stopping = False
        self._stats = LoopStats()
        self._rids = RidRegistry()   # ids submitted and not yet finished
        self._delivery: Optional[Delivery] = None
        self._intake: Optional[Intake] = None   # requests in, aborts (loop thread)
        self.runner = None
        self.scheduler = None
        self.tokenizer = None
        self._spec = None     # SpecStepper when the engine speculates (runtime/spec_step.py)
        self._overlap = None  # OverlapStepper when the runner overlaps CPU and GPU work (CUDA)
        self._stepped = False  # steps ran since the loop last went idle
        self.profiler = StepProfiler()  # start_profile / stop_profile, driven on this thread
        self._exclusive = ExclusiveCalls()  # weight updates / memory release, and submissions held behind them
        self.weights: Optional[WeightService] = None  # weight updates and reads, weight_version
        self.memory: Optional[MemoryService] = None   # release / resume of the GPU memory
        self.sessions: Optional[SessionTable] = None  # open_session / session_params
        self.tp: Optional[TPGroup] = None  # tensor parallelism: the worker ranks, stopped with the loop

    # ---- caller side (any thread) ---------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        self._thread.start()
        return self._ready.result()

    def submit(self, reqs: list[Request], sink: Sink, stream: bool) -> None:
        """Queue requests; ValueError (nothing queued) when a request id is already in flight, or
        (waiting for the loop) when a session request cannot continue its session."""
        refusal = self.memory.refusal() if self.memory is not None else None
        if refusal is not None:
            raise RuntimeError(refusal)
        settle_all(reqs)     # image ids still hashed on the caller's pool: in the slots before the loop reads them
        rids = [r.rid for r in reqs]
        self._rids.claim(rids)
        try:
            if any(r.session is not None for r in reqs):
                self.call(lambda: self._intake.add_in_session(reqs, sink, stream))
            else:
                self._post(self._intake.add_or_hold, reqs, sink, stream)
        except (RuntimeError, ValueError):
            self._rids.release(rids)
            raise

    def abort(self, rids: list[str], message: str = "aborted by the caller", wait: bool = False) -> None:
        """Abort requests; with ``wait``, return once the loop has finished them (stats() agrees)."""
        fut: Optional[cf.Future] = cf.Future() if wait else None
        self._post(self._intake.abort, rids, message, fut=fut)
        if fut is not None:
            self._wait(fut)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result (blocking)."""
        fut: cf.Future = cf.Future()
        self._post(fn, fut=fut)
        return self._wait(fut)

    def call_exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread once every request submitted before this call has finished;
        requests submitted meanwhile wait and start after it (SGLang's model-update lock)."""
        fut: cf.Future = cf.Future()
        self._post(self._exclusive.push, fn, fut)
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
            if self._thread.is_alive():    # still freeing (a process group's teardown): say so, not silently
                logger.warning("the engine loop thread did not stop within %.0f s of shutdown()", timeout)

    @property
    def delivery(self) -> Optional[Delivery]:
        """The step-result delivery (outputs, grammars, streams) once the engine started."""
        return self._delivery

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
            if self._delivery is not None:
                self._delivery.publish()
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
            if self.tp is not None:     # the workers started before the failure
                self.tp.shutdown()
            self._ready.set_exception(e)
            loop.close()
            return
        self._loop = loop
        self._wake = asyncio.Event()
        self._ready.set_result(info)
        try:
            loop.run_until_complete(self._main())
        finally:
            self._delivery.fail_all("engine is shut down")
            # the model, KV pool and graphs go with the runner and everything stepping with it
            self.runner = self._spec = self._overlap = self._intake = None
            self.weights.close()      # weight_version stays readable
            self.memory = None
            if self.tp is not None:
                self.tp.shutdown()
            loop.close()
            thaw_heap()

    def _build(self) -> dict[str, Any]:
        parts = build_engine_parts(self.cfg, self._on_stage)
        self.runner, self.scheduler, self.tokenizer = parts.runner, parts.scheduler, parts.tokenizer
        self.tp = parts.tp
        self._delivery = Delivery(parts.scheduler, parts.tokenizer, parts.runner.vocab_size,
                                  parts.cfg.page_size, self._stats, self._rids, self._post,
                                  parts.cfg.stream_interval, parts.cfg.enable_jump_forward)
        self.deliver = self._delivery.deliver    # the step's hand-off, bound once (hot path)
        self.memory = MemoryService(parts.runner, parts.scheduler)
        self.weights = WeightService(parts.runner, parts.scheduler, self.memory, parts.cfg.weight_version,
                                     parts.cfg.load_format)
        bos = getattr(parts.tokenizer, "bos_token_id", None)
        self.sessions = SessionTable(parts.scheduler, lambda rid, msg: self._delivery.abort([rid], msg), bos,
                                     parts.cfg.allow_context_overflow,   # timeouts: fn on this thread after delay
                                     lambda delay, fn: self._loop.call_later(delay, self._wrap, fn, (), None))
        parts.scheduler.on_finish = self.sessions.on_finish
        parts.scheduler.on_flush = self.sessions.unpin_all
        self._spec = make_spec_stepper(parts.runner, parts.scheduler, parts.cfg, self._stats)
        if getattr(parts.runner, "overlap", False):
            self._overlap = OverlapStepper(parts.runner, parts.scheduler, self.deliver, self.fail_batch,
                                           self.run_step, self._delivery.release_wakes)
        self._intake = Intake(self._delivery, self._exclusive, self.weights, self.memory, self.sessions,
                              self.flush_overlap)
        self._delivery.publish()
        freeze_heap()
        return parts.info()

    async def _main(self) -> None:
        while not self._stopping:
            if self.scheduler.has_work() or (self._overlap is not None and self._overlap.busy):
                try:
                    self._step()
                except Exception as e:  # noqa: BLE001 - a step raised past the runner's guards
                    self._step_failed(e)
                self._stepped = True
                if self.profiler.active:
                    self.profiler.after_step()
                await asyncio.sleep(0)  # let submissions / aborts / calls in between steps
            elif self._exclusive.pending and self._drained():
                self._intake.run_exclusive()
            else:
                if self._stepped:
                    self._stepped = False
                    freeze_new_code()
                self._delivery.release_wakes()
                self._wake.clear()
                await self._wake.wait()

    def _step(self) -> None:
        if self._overlap is not None:
            self._overlap.step()
            return
        batch = self.scheduler.schedule()
        self._delivery.reap_outside()
        if batch is not None:
            self.run_step(batch)

    def run_step(self, batch: ScheduledBatch) -> None:
        """Run one batch synchronously and deliver its results."""
        self._delivery.release_wakes()   # stream consumers run while this step computes
        try:
            out = self._spec.step(batch) if self._spec is not None else self.runner.step(batch)
        except Exception as e:  # noqa: BLE001 - handed to fail_batch
            self.fail_batch(batch, e)
            return
        self.deliver(self.scheduler.update(batch, out), batch.num_prefill_tokens)

    def deliver(self, changed: list[Request], n_in: int) -> None:
        """Send the step's changed requests to their callers, then count the step's tokens
        (replaced by the Delivery's bound method once the engine is built)."""
        self._delivery.deliver(changed, n_in)

    def fail_batch(self, batch: ScheduledBatch, e: Exception) -> None:
        """A failing step aborts its own requests only; the engine goes on."""
        logger.exception("step failed")
        for s in batch.seqs:
            self.scheduler.abort(s.req.rid, f"{type(e).__name__}: {e}")
        self._delivery.reap()

    def _step_failed(self, e: Exception) -> None:
        """A step raised where no guard caught it (the scheduler's update, a grammar's settle, delivery): the
        running requests, maybe left half-updated, are aborted with the error and the steps in flight forgotten."""
        logger.exception("engine step failed: its running requests are aborted, the engine goes on")
        if self._overlap is not None:
            self._overlap.drop()
        self._delivery.abort([r.rid for r in self.scheduler.running], f"{type(e).__name__}: {e}")

    def _drained(self) -> bool:
        """No request in flight (grammar compilations included)."""
        s = self._delivery.snapshot()
        return s["running"] + s["waiting"] == 0

    def flush_overlap(self) -> None:
        """Resolve and deliver the overlap stepper's step in flight, if any (loop thread)."""
        if self._overlap is not None:
            self._overlap.flush()

    def _stop(self) -> None:
        if self._overlap is not None:
            self._overlap.flush()
        if self.profiler.active:  # shutting down mid-profile still writes the trace
            self.profiler.stop()
        self.sessions.close_all()
        self._stopping = True
