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
Step N+1's forward is queued without its sampling (``staged``); then step N resolves (the matchers
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

from nbgen.core.batch import ScheduledBatch, SeqWork, StepOutput
from nbgen.core.finish import FinishReason
from nbgen.core.request import Request, Status
from nbgen.runtime.constraints import FillJob
from nbgen.runtime.embed_step import StepVectors, is_embedding_batch, launch_embed
from nbgen.runtime.grammar_batch import StepGrammar
from nbgen.runtime.runner import Forwarded, Launched, ModelRunner
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.step_inputs import is_placeholder, placeholder

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


def overlappable(batch: ScheduledBatch) -> bool:
    """True when no seq needs real token values on the host before its next step."""
    for s in batch.seqs:
        r = s.req
        ok = r.overlaps
        if ok is None:                         # its fixed needs, looked at once
            ok = r.overlaps = _overlaps(r)
        if not ok and not _seq_overlaps(s):
            return False
    return True


def constrained(seqs: list[SeqWork]) -> bool:
    """Whether a seq's request has a grammar."""
    return any([s.req.grammar is not None for s in seqs])


def _overlaps(r: Request) -> bool:
    """Whether every step of r may run ahead of its token values: no prompt logprobs, penalties over
    output ids, custom processors (they may read output ids), hidden states (copied to the host) or
    pooling."""
    p = r.params
    return (r.logprobs.logprob_start_len < 0 and p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty and r.logit_processor is None and not r.return_hidden_states
            and r.embed is None)


def _seq_overlaps(s: SeqWork) -> bool:
    """Whether the step of s may run ahead of its token values (a request that is not ``_overlaps``:
    its prompt logprobs may be done)."""
    r = s.req
    if s.prompt_logprob_start >= 0 or r.wants_prompt_logprobs:   # output logprobs overlap
        return False
    p = r.params
    if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
        return False
    return r.logit_processor is None and not r.return_hidden_states and r.embed is None


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
        self.pending: Optional[tuple[Launched, list[Request], int]] = None  # (launched, changed, n_in)
        self.staged: Optional[Forwarded] = None   # grammar step: forward queued, not sampled
        self._pending_fill: Optional[FillJob] = None   # the pending step's bitmask job (grammar steps)
        self._undelivered: Optional[tuple[list[Request], int]] = None    # resolved, outputs not sent yet
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
        self.pending = (launched, self._apply(batch, len(fwd.seqs)), batch.num_prefill_tokens)

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
                fill = runner.sampler.constraints.fill_async(fwd.seqs)
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
            _drop_placeholders(batch)
            self._fail_batch(batch, e)
            return
        self.pending = (launched, changed, batch.num_prefill_tokens)
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
        n = len(batch.seqs)
        if sampled == n:                                 # every row samples (decode steps)
            fake = list(_placeholders(n))
        else:
            fake, rows = [-1] * n, iter(_placeholders(sampled))
            for i, s in enumerate(batch.seqs):
                if s.sample:
                    fake[i] = next(rows)
        return self.scheduler.update(batch, StepOutput(fake, [None] * n, [None] * n))

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
        fill is then queued behind the accepts when no row may jump forward (returned, else None)."""
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
        launched, changed, n_in = self.pending
        fill, self.pending, self._pending_fill = self._pending_fill, None, None
        sched = self.scheduler
        if self._before_wait is not None:
            self._before_wait()
        toks = self.runner.resolve(launched)
        # the constrained rows' matchers take their tokens in the worker while the rows are walked
        accepted = None if fill is None else self.runner.sampler.constraints.accept_async(
            fill, [t for t, s in zip(toks, launched.batch.seqs) if s.sample])
        lps = launched.logprobs.lists() if launched.logprobs is not None else None   # per sampling row
        grammar = StepGrammar()                          # constrained rows (runtime/grammar_batch.py)
        listed: set[int] = set()                         # ids of changed's requests, made at the first finish
        errors = launched.errors
        row = -1
        phs = _placeholders(len(launched.batch.seqs))
        for s, tok in zip(launched.batch.seqs, toks):
            if not s.sample:
                continue
            row += 1
            req = s.req
            out = req.output_ids
            at = s.start_pos + len(s.token_ids) - len(req.prompt_ids)   # s.out_index, inlined (hot)
            if not (0 <= at < len(out) and out[at] == phs[row]):
                continue                                 # never appended (aborted / preempted before)
            if errors and row in errors:                 # every token masked: abort, as the plain loop
                del out[at:]                             # the placeholder (the next step is not applied yet)
                sched.finish(req, FinishReason.abort(errors[row]))
                _add_once(changed, req, listed)
                continue
            out[at] = tok
            if lps is not None and lps[row] is not None and len(req.output_token_logprobs) == at:
                req.add_output_logprob(lps[row])
            # the one stop check (a length cut was made at update), asked where it may end the request
            reason = req.end_after(tok, at + 1) if tok in req.stop_ids or at >= req.end_len - 1 else None
            if req.grammar is not None:
                grammar.add(req, tok, reason)            # accepted below, all rows in one call
            elif reason is not None:
                self._end(req, reason, changed, listed)
        nxt_fill = None
        if nxt is not None and accepted is not None and not grammar.jumping:
            # queued behind the accepts (one worker thread): it starts as they end, while this thread
            # collects its rows and settles; jumps would change matchers, so they fill afterwards
            try:
                nxt_fill = self.runner.sampler.constraints.fill_async(nxt.seqs, frozenset(grammar.completing()), queued=True)
            except Exception:  # noqa: BLE001 - the caller's fill_async raises it again, for nxt's requests
                nxt_fill = None
        for req, reason in grammar.settle(sched.cfg.context_length, accepted):
            self._end(req, reason, changed, listed)
        self._undelivered = (changed, n_in)
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


def _placeholders(n: int) -> range:
    """The placeholder ids of sampled rows 0 .. n-1 (``step_inputs.placeholder``, a linear encoding)."""
    return range(placeholder(0), placeholder(n), placeholder(1) - placeholder(0))


def _add_once(changed: list[Request], req: Request, listed: set[int]) -> None:
    """Append req to changed unless it is there. By identity through ``listed`` (filled on first use):
    ``req in changed`` compares dataclasses field by field, O(n) each, when a whole batch finishes."""
    if not listed:
        listed.update(map(id, changed))
    if id(req) not in listed:
        listed.add(id(req))
        changed.append(req)


def _drop_placeholders(batch: ScheduledBatch) -> None:
    """Remove the placeholder ids a failed launch left at the end of its requests' outputs."""
    for s in batch.seqs:
        out = s.req.output_ids
        while out and is_placeholder(out[-1]):
            out.pop()
