"""Overlap scheduling: the CPU schedules and launches step N+1 while the GPU still runs step N.

Per loop iteration (``OverlapStepper.step``):
  1. ``schedule()`` builds batch N+1 from the scheduler state, in which step N's sampled tokens are
     still *placeholders* (-(k+1) = "row k of step N's sampled ids");
  2. ``runner.launch`` queues batch N+1; placeholder inputs are filled on the GPU from step N's ids;
  3. step N is *resolved*: its ids come to the host (the only sync, while N+1 runs), placeholders in
     ``req.output_ids`` are replaced, stop tokens finish their requests, outputs are emitted;
  4. ``scheduler.update`` applies batch N+1 with placeholder ids (lengths, max_new_tokens and page
     bookkeeping only depend on counts), and N+1 becomes the pending step.
A request that hit a stop token at step N has already been scheduled for N+1; that extra token is
dropped because ``update`` skips requests that are no longer running. Batches that need host-side
token values (logprobs, penalties over output ids, custom logit processors, hidden states) run
synchronously after a flush, so greedy and seeded outputs are identical with and without overlap.
Grammar requests overlap: step N is resolved inside the launch of N+1, after its forward is queued
and before its sampling, so the matchers accept N's tokens before N+1's bitmask is filled. N's
outputs are delivered there too (before the fill): the GPU is busy with N+1's forward meanwhile,
whereas after sampling is queued it has only the short sampling kernels left to hide host work.
"""
from __future__ import annotations

from typing import Any, Optional

from nbgen.runtime.batch import ScheduledBatch, StepOutput
from nbgen.runtime.request import Request, Status


def overlappable(batch: ScheduledBatch) -> bool:
    """True when no seq needs real token values on the host before its next step."""
    for s in batch.seqs:
        p, lp = s.req.params, s.req.logprobs
        if s.prompt_logprob_start >= 0 or lp.return_logprob:
            return False
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            return False
        r = s.req   # custom processors may read output ids; hidden states are copied to the host
        if r.logit_processor is not None or r.return_hidden_states:
            return False
    return True


class OverlapStepper:
    """Drives a LoopThread's scheduler and runner one step ahead of the host."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.pending: Optional[tuple[Any, list[Request], int]] = None  # (launched, changed, n_in)
        self._undelivered: Optional[tuple[list[Request], int]] = None    # resolved, outputs not sent yet

    def step(self) -> None:
        loop, sched = self.loop, self.loop.scheduler
        batch = sched.schedule()
        if batch is None:
            self.flush()
            return
        if not overlappable(batch):
            self.flush()
            self.loop.run_step(batch)
            return
        # grammar rows: the previous step resolves after this forward is queued and before sampling,
        # so their matchers accept its tokens and the bitmask is filled while the GPU runs the forward
        grammar = any(s.req.grammar is not None for s in batch.seqs)
        try:
            launched = loop.runner.launch(batch, before_sample=self.flush if grammar else None)
        except Exception as e:  # noqa: BLE001 - fail this step's requests only
            self.flush()
            self.loop.fail_batch(batch, e)
            return
        self.flush()
        n = len(batch.seqs)
        fake, k = [-1] * n, 0
        for i, s in enumerate(batch.seqs):
            if s.sample:
                fake[i] = -(k + 1)
                k += 1
        changed = sched.update(batch, StepOutput(fake, [None] * n, [None] * n))
        self.pending = (launched, changed, batch.num_prefill_tokens)

    def flush(self) -> None:
        """Resolve the pending step (wait for its ids), then deliver its outputs."""
        self._resolve()
        if self._undelivered is not None:
            changed, n_in = self._undelivered
            self._undelivered = None
            self._deliver(changed, n_in)

    def _resolve(self) -> None:
        """Wait for the pending step's ids, put them in place, accept grammar tokens, finish stops."""
        if self.pending is None:
            return
        launched, changed, n_in = self.pending
        self.pending = None
        loop, sched = self.loop, self.loop.scheduler
        toks = loop.runner.resolve(launched)
        k = 0
        for i, s in enumerate(launched.batch.seqs):
            if not s.sample:
                continue
            ph, tok, k = -(k + 1), toks[i], k + 1
            req = s.req
            at = s.kv_len - len(req.prompt_ids)          # index of this step's token in output_ids
            if not (0 <= at < len(req.output_ids) and req.output_ids[at] == ph):
                continue                                 # never appended (aborted / preempted before)
            req.output_ids[at] = tok
            reason = {"type": "stop", "matched": tok} if (tok in req.stop_ids
                                                          and at + 1 >= req.params.min_new_tokens) else None
            if req.grammar is not None:
                reason = req.grammar.on_token(tok, reason)
            if reason is not None:
                if req.status is Status.FINISHED:
                    req.finish_reason = reason           # length and stop in the same step: stop wins
                else:
                    sched.finish(req, reason)
                if req not in changed:
                    changed.append(req)
        self._undelivered = (changed, n_in)

    def _deliver(self, changed: list[Request], n_in: int) -> None:
        self.loop.deliver(changed, n_in)

