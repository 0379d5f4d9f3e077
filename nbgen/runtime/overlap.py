"""Overlap scheduling: the CPU schedules and launches step N+1 while the GPU still runs step N.

Per loop iteration (``OverlapStepper.step``):
  1. ``schedule()`` builds batch N+1 from the scheduler state, in which step N's sampled tokens are
     still *placeholders* (``step_inputs.placeholder(k)`` = "row k of step N's sampled ids");
  2. ``runner.launch`` queues batch N+1; placeholder inputs are filled on the GPU from step N's ids;
  3. step N is *resolved*: its ids come to the host (the only sync, while N+1 runs), placeholders in
     ``req.output_ids`` are replaced, stop tokens finish their requests, outputs are emitted;
  4. ``scheduler.update`` applies batch N+1 with placeholder ids (lengths, max_new_tokens and page
     bookkeeping only depend on counts), and N+1 becomes the pending step.
A request that hit a stop token at step N has already been scheduled for N+1; that extra token is
dropped because ``update`` skips requests that are no longer running. Output logprobs (``score``'s
label probabilities among them) ride along: computed on the GPU with the sampling, copied to the
host behind it and recorded when the step resolves. Batches that need host-side token values
(prompt logprobs, penalties over output ids, custom logit processors, hidden states) run
synchronously after a flush, so greedy and seeded outputs are identical with and without overlap.
Embedding batches pipeline too: step N's forward, pooling and the copy of its vectors to the host
are queued, step N-1 is delivered meanwhile, step N is applied (it samples nothing, so no
placeholders), and its vectors are read at the next flush, after step N+1 was launched.
Grammar batches pipeline one stage deeper, so that xgrammar's work leaves the host's critical path.
Step N+1's forward is queued without its sampling (``staged``); N+1's constrained rows are gathered while
the device ends step N; then step N resolves (the matchers
accept its tokens in the fill worker while its rows are walked; N+1's fill is queued behind them
unless rows jump forward, then it starts after the jumps), N's outputs are delivered, N+1 is applied
with placeholders, N+2 is scheduled and its inputs and attention plan are
queued (graph steps); only then does N+1's sampling wait for the fill, and N+2's forward is queued
right behind it (staged for the next call). A staged forward is never applied to the scheduler
before it is sampled, so ``flush`` may drop it: the next schedule recomputes the same positions
(its KV writes are simply repeated).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

from nbgen.core.batch import ScheduledBatch
from nbgen.core.finish import FinishReason
from nbgen.core.request import Request, Status
from nbgen.runtime.fill_worker import FillJob
from nbgen.runtime.grammar_batch import live_rows
from nbgen.runtime.embed_step import StepVectors, is_embedding_batch, launch_embed
from nbgen.runtime.overlap_rows import (RowsResolved, constrained, drop_placeholders, overlappable,
                                        placeholder_output)
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.step_handles import Forwarded, Launched
from nbgen.runtime.scheduler import Scheduler

Deliver = Callable[[list[Request], int], None]          # (changed requests, prompt tokens of the step)
FailBatch = Callable[[ScheduledBatch, Exception], None]  # fail one batch's requests
RunStep = Callable[[ScheduledBatch], None]              # a synchronous step (logprobs, penalties, ...)


class LoopLike(Protocol):
    """The loop's parts the stepper drives (``OverlapStepper.from_loop``)."""

    runner: ModelRunner
    scheduler: Scheduler

    def deliver(self, changed: list[Request], n_in: int) -> None: ...

    def fail_batch(self, batch: ScheduledBatch, error: Exception) -> None: ...

    def run_step(self, batch: ScheduledBatch) -> None: ...


class OverlapStepper:
    """Drives a scheduler and runner one step ahead of the host; ``deliver`` sends a resolved step's
    outputs, ``fail_batch`` fails a batch whose launch raised, ``run_step`` runs a batch that cannot
    overlap synchronously."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, deliver: Deliver, fail_batch: FailBatch,
                 run_step: RunStep, before_wait: Optional[Callable[[], None]] = None) -> None:
        self.runner = runner
        self._before_wait = before_wait   # called right before the host blocks on a step's ids
        self.scheduler = scheduler
        self._deliver_fn = deliver
        self._fail_batch = fail_batch
        self._run_step = run_step
        # (launched, changed, n_in, sampled): a launched step, its changed requests, prompt tokens, sampling rows
        self.pending: Optional[tuple[Launched, list[Request], int, int]] = None
        self.staged: Optional[Forwarded] = None   # grammar step: forward queued, not sampled
        self._pending_fill: Optional[FillJob] = None   # the pending step's bitmask job (grammar steps)
        self._undelivered: Optional[tuple[list[Request], int]] = None    # resolved, outputs not sent yet
        self._stale: frozenset[int] = frozenset()   # ids of GrammarStates whose request jumped at the last resolve
        self.embedded: Optional[tuple[ScheduledBatch, StepVectors, list[Request], int]] = None  # vectors in flight

    @classmethod
    def from_loop(cls, loop: LoopLike) -> "OverlapStepper":
        """A stepper over a loop's runner and scheduler, delivering through it."""
        return cls(loop.runner, loop.scheduler, loop.deliver, loop.fail_batch, loop.run_step)

    @property
    def busy(self) -> bool:
        """A step is launched or staged and not delivered yet."""
        return self.pending is not None or self.staged is not None or self.embedded is not None

    def step(self) -> None:
        runner, sched = self.runner, self.scheduler
        fwd, self.staged = self.staged, None
        if fwd is None:
            batch = sched.schedule()
            if batch is None:
                self.flush()
                return
            if is_embedding_batch(batch):
                self._embed_step(batch)
                return
            if not overlappable(batch):
                self.flush()
                self._run_step(batch)
                return
            try:
                fwd = runner.forward(batch)
            except Exception as e:  # noqa: BLE001 - fail this step's requests only
                self.flush()
                self._fail_batch(batch, e)
                return
        batch = fwd.batch
        if constrained(fwd.seqs):
            self._grammar_step(fwd)
            return
        try:
            launched = runner.sample(fwd)
        except Exception as e:  # noqa: BLE001
            self.flush()
            self._fail_batch(batch, e)
            return
        self.flush()
        self.pending = (launched, self._apply(batch, len(fwd.seqs)), batch.num_prefill_tokens, len(fwd.seqs))

    def drop(self) -> None:
        """Forget the steps in flight without reading them (after a step raised where nothing caught it:
        the loop aborts their requests); a bitmask job still running is waited for first."""
        if self._pending_fill is not None:
            self._pending_fill.settle()
        self.pending = self.staged = self._pending_fill = self._undelivered = self.embedded = None
        self._stale = frozenset()

    def _embed_step(self, batch: ScheduledBatch) -> None:
        """Launch an embedding step, deliver the previous step while it runs, apply it; its vectors
        are read at the next flush."""
        try:
            out, vectors = launch_embed(self.runner, batch)
        except Exception as e:  # noqa: BLE001 - fail this step's requests only
            self.flush()
            self._fail_batch(batch, e)
            return
        self.flush()
        self.embedded = (batch, vectors, self.scheduler.update(batch, out), batch.num_prefill_tokens)

    def _grammar_step(self, fwd: Forwarded) -> None:
        """Sample a staged grammar step once its bitmask is filled; stage the next step's forward."""
        runner, sched, batch = self.runner, self.scheduler, fwd.batch
        # previous step: tokens accepted by the matchers; this step's fill may start in it already
        fill = self._resolve(fwd)
        try:
            if fill is None:
                fill = runner.sampler.constraints.fill_async(fwd.seqs, self._stale)
        except Exception as e:  # noqa: BLE001 - e.g. a matcher failing: this step's requests only
            self.flush()
            self._fail_batch(batch, e)
            return
        self.flush()                                  # deliver the previous step (fill runs meanwhile)
        changed = self._apply(batch, len(fwd.seqs))
        nxt = sched.schedule()
        if nxt is not None and not overlappable(nxt):
            nxt = None                                # dropped: the next step() schedules it again
        prep = None
        if nxt is not None:                           # its inputs and plan, still under the fill
            try:
                prep = runner.prepare(nxt, len(fwd.seqs))
            except Exception:  # noqa: BLE001 - forward(nxt) below stages it again and fails nxt there
                prep = None
        try:
            launched = runner.sample(fwd, fill)      # waits for the fill (also when it raises)
        except Exception as e:  # noqa: BLE001
            drop_placeholders(batch)
            self._fail_batch(batch, e)
            return
        self.pending = (launched, changed, batch.num_prefill_tokens, len(fwd.seqs))
        self._pending_fill = fill
        if nxt is None:
            return
        try:
            self.staged = runner.forward(nxt, prep)
        except Exception as e:  # noqa: BLE001
            self.flush()
            self._fail_batch(nxt, e)

    def _apply(self, batch: ScheduledBatch, sampled: int) -> list[Request]:
        """Apply a launched batch with placeholder ids (lengths and pages only depend on counts);
        ``sampled``: its sampling rows."""
        return self.scheduler.update(batch, placeholder_output(batch, sampled))

    def flush(self) -> None:
        """Resolve the pending step (wait for its ids), then deliver its outputs; drop a staged one."""
        self.staged = None
        self._resolve()
        if self._undelivered is not None:
            changed, n_in = self._undelivered
            self._undelivered = None
            self._deliver(changed, n_in)

    def _resolve(self, nxt: Optional[Forwarded] = None) -> Optional[FillJob]:
        """Wait for the pending step's ids, put them in place, accept grammar tokens, finish stops
        (or, for an embedding step, its vectors). ``nxt``: the staged step after it, whose bitmask
        fill is then queued behind the accepts (after the jumps where rows may jump forward; returned, or
        None: the caller fills it, leaving out ``_stale``)."""
        self._stale = frozenset()
        if self.embedded is not None:
            batch, vectors, changed, n_in = self.embedded
            self.embedded = None
            for s, v in zip(batch.seqs, vectors.lists()):
                if v is not None:
                    s.req.set_pooled(None, v)
            self._undelivered = (changed, n_in)
            return None
        if self.pending is None:
            return None
        launched, changed, n_in, sampled = self.pending
        fill, self.pending, self._pending_fill = self._pending_fill, None, None
        sched = self.scheduler
        if self._before_wait is not None:
            self._before_wait()
        # the next step's constrained rows, gathered while the device ends this step (no grammar completes
        # before this step's settle, after the next fill is queued)
        live = live_rows(nxt.seqs) if nxt is not None and fill is not None else None
        toks = self.runner.resolve(launched)
        # the constrained rows' matchers take their tokens in the worker while the rows are walked
        accepted = None if fill is None else self.runner.sampler.constraints.accept_async(
            fill, toks if sampled == len(toks) else [t for t, s in zip(toks, launched.batch.seqs) if s.sample])
        lps = launched.logprobs.lists() if launched.logprobs is not None else None   # per sampling row
        listed: set[int] = set()                         # ids of changed's requests, made at the first finish
        rows = RowsResolved(lambda req, reason: self._end(req, reason, changed, listed),
                            lambda req, msg: self._end(req, FinishReason.abort(msg), changed, listed))
        rows.place(launched.batch, sampled, toks, launched.errors, lps)
        grammar = rows.grammar
        nxt_fill = None
        cons = self.runner.sampler.constraints
        if nxt is not None and accepted is not None and not grammar.jumping:
            # queued behind the accepts (one worker thread): it starts as they end, while this thread
            # collects its rows and settles; jumps would change matchers, so they fill afterwards
            try:
                nxt_fill = cons.fill_async(nxt.seqs, frozenset(grammar.completing()), queued=True, live=live)
            except Exception:  # noqa: BLE001 - the caller's fill_async raises it again, for nxt's requests
                nxt_fill = None
        completing = frozenset(grammar.completing()) if grammar.jumping and live is not None else frozenset()
        if grammar.jumping and nxt is not None:         # its rows compute K/V of the tokens being accepted
            grammar.queued = frozenset([id(s.req) for s in nxt.seqs if s.start_pos == s.req.num_computed])
        for req, reason in grammar.settle(sched.cfg.context_length, accepted):
            self._end(req, reason, changed, listed)
        self._undelivered = (changed, n_in)
        # the next step was scheduled before these jumps: its rows of requests that jumped are stale (the
        # scheduler's update skips them, their tokens are never kept), so their matchers, already past the
        # forced text, are left out of its fill and of its accepts
        if grammar.jumped:
            self._stale = frozenset(map(id, grammar.jumped))
        if nxt_fill is None and live is not None and grammar.jumping:
            try:
                nxt_fill = cons.fill_async(nxt.seqs, completing | self._stale, live=live)
            except Exception:  # noqa: BLE001 - the caller's fill_async raises it again, for nxt's requests
                nxt_fill = None
        return nxt_fill

    def _end(self, req: Request, reason: FinishReason, changed: list[Request], listed: set[int]) -> None:
        """Finish req at a resolved step (it is delivered with the step)."""
        if req.status is Status.FINISHED:
            req.finish_reason = reason                   # length and stop in the same step: stop wins
        else:
            self.scheduler.finish(req, reason)
        _add_once(changed, req, listed)

    def _deliver(self, changed: list[Request], n_in: int) -> None:
        self._deliver_fn(changed, n_in)


def _add_once(changed: list[Request], req: Request, listed: set[int]) -> None:
    """Append req to changed unless it is there. By identity through ``listed`` (filled on first use):
    ``req in changed`` compares dataclasses field by field, O(n) each, when a whole batch finishes."""
    if not listed:
        listed.update(map(id, changed))
    if id(req) not in listed:
        listed.add(id(req))
        changed.append(req)
