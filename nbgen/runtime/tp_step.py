"""Tensor parallelism's step protocol: every rank runs the same step pipeline as at tp_size=1.

Rank 0 is the engine's loop thread (scheduler, requests, sampler); each worker rank
(``runtime/tp_worker.py``) holds a ModelRunner over its shard. The runner tells its ``peers``
(``ModelRunner.peers``, a ``StepSender`` here) about each model call before it runs it, and a worker
(``StepReplica``) runs the same runner call on its shard, so the collectives inside the model (the
embedding's and each block's all-reduce, the LM head's all-gather) meet in the same order:

- ``forward``: the step's lite batch (page tables, start positions, the token ids the host knows,
  overlap placeholders for the rest, which rows sample), sent the moment rank 0 queues the forward.
  Under overlap scheduling that is while the GPUs still run the previous step, so a worker prepares
  step N+1 on its host (inputs, attention plan, graph staging) while its GPU runs step N, as rank 0
  does. Nothing of it is read back from a GPU: positions follow from the start positions, and page
  lists travel as the pages added since the rank last saw the request (``StepEncoder``).
- ``sampled``: after rank 0 samples, the step's sampled ids [S] go to the workers on the device
  (``dist.broadcast`` on the GPU stream, into the decode graphs' input buffer where rank 0's greedy
  ids went), so a worker's previous-tokens tensor, which the next step's placeholders index, equals
  rank 0's without a host round-trip. A forward rank 0 never samples (the overlap stepper drops a
  staged step at a flush; the sampler failed) sends nothing: the worker's previous tokens stay.
- ``hidden`` / ``logits``: the synchronous steps (prompt logprobs, embeddings, speculative verify)
  ask for hidden states, then the LM head over some of their rows (row indices only).
- The LM head needs no hidden-state broadcast: after the final all-reduce the hidden states are the
  same on every rank, so each rank computes its vocabulary shard of the same rows.

Why rank 0 samples and broadcasts the ids instead of every rank sampling the all-gathered logits
(SGLang's way, which all-reduces the ids anyway when grammars are involved): the sampler's state
lives with the requests on rank 0 (penalties over output ids, grammar matchers and their bitmask
thread, custom logit processors, per-request seeds, the all-masked-row aborts), and replicating it
exactly would mean replicating the requests. One broadcast of S int64 ids per step costs less than
one of the model's all-reduces.

Why not SGLang's layout (a whole scheduler on each rank; rank 0 broadcasts the new requests each
iteration and every rank schedules identically): nbgen's rank 0 is a LoopThread inside the user's
process with services that act on the scheduler between steps (aborts, sessions, grammar holds,
priority preemption, exclusive calls, the caller's timing); keeping several schedulers in lockstep
would need all of them replicated and ordered. The lite batch is the scheduler's decision, a few
kilobytes per step, so the workers need no scheduler at all.

A failure of rank 0's half of a call after the workers were told gives the group up (``abandon``):
the workers may wait in a collective rank 0 never reaches, and the next step's collectives would
pair with the stale ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.runtime.step_inputs import flatten

T = TypeVar("T")

# a seq on the wire: (rid, prompt length, rope delta, token ids, start pos, sample, pages,
# pages is the tail added since the last message, tree parents)
SeqWire = tuple[str, int, int, list[int], int, bool, list[int], bool, Optional[list[int]]]


@dataclass
class LiteRequest:
    """What the runner reads of a request on a worker: id, prompt length (``prompt_ids`` is a range),
    M-RoPE decode offset."""

    rid: str
    prompt_ids: range
    rope_delta: int = 0
    lora_id: Optional[str] = None
    images: None = None


@dataclass
class TPStep:
    """One message to the workers. kind: "forward" and "hidden" (seqs, page_size, forget),
    "logits" (rows), "sampled" (n, dtype, into_prev), "stop"."""

    kind: str
    seqs: list[SeqWire] = field(default_factory=list)
    page_size: int = 0
    forget: list[str] = field(default_factory=list)   # request ids whose page lists the worker drops
    rows: list[int] = field(default_factory=list)     # rows of the last hidden states for the LM head
    n: int = 0                                        # sampled ids in the broadcast
    dtype: Optional[torch.dtype] = None
    into_prev: bool = False                           # rank 0 sampled into the decode graphs' prev buffer


class StepEncoder:
    """Rank 0's side of the lite batch: page lists sent whole once, then only the pages appended since
    (the trust rule of ``attention/page_tables.DecodeTables``: the same list object that only grew;
    steps that compute prompt tokens, after which the prefix cache may rewrite pages in place, send
    the whole list)."""

    def __init__(self) -> None:
        self._known: dict[str, list] = {}     # rid -> [pages list object, pages the workers have]

    def tracked(self) -> set[str]:
        """The request ids whose page lists the workers keep."""
        return set(self._known)

    def seqs(self, batch: ScheduledBatch) -> tuple[list[SeqWire], list[str]]:
        """The batch's seqs on the wire, and the request ids the workers may forget."""
        out = [self._seq(s) for s in batch.seqs]
        forget: list[str] = []
        if len(self._known) > 2 * len(batch.seqs) + 256:      # finished / preempted requests
            live = {s.req.rid for s in batch.seqs}
            forget = [r for r in self._known if r not in live]
            for r in forget:
                del self._known[r]
        return out, forget

    def _seq(self, s: SeqWork) -> SeqWire:
        req, pages = s.req, s.pages
        plen = len(req.prompt_ids)
        if s.q_len > 1 or s.start_pos < plen:
            self._known.pop(req.rid, None)
            wire, tail = list(pages), False
        else:
            e = self._known.get(req.rid)
            if e is not None and e[0] is pages and e[1] <= len(pages):
                wire, tail = pages[e[1]:], True
                e[1] = len(pages)
            else:
                wire, tail = list(pages), False
                self._known[req.rid] = [pages, len(pages)]
        return (req.rid, plen, req.rope_delta, s.token_ids, s.start_pos, s.sample, wire, tail, s.tree_parents)


class StepSender:
    """Rank 0's peers (``ModelRunner.peers``): each call tells the workers, then runs rank 0's half.
    ``send`` delivers a message to every worker; ``abandon`` gives the group up."""

    def __init__(self, send: Callable[[TPStep], None], abandon: Callable[[], None]) -> None:
        self._send = send
        self._abandon = abandon
        self._enc = StepEncoder()
        self._forwarding = False    # inside a forward: its hidden states are the forward message's

    def _local(self, run: Callable[[], T]) -> T:
        try:
            return run()
        except BaseException:
            self._abandon()
            raise

    def _batch_step(self, kind: str, batch: ScheduledBatch) -> TPStep:
        seqs, forget = self._enc.seqs(batch)
        return TPStep(kind, seqs, batch.page_size, forget)

    def forward(self, batch: ScheduledBatch, run: Callable[[], T]) -> T:
        """A step's forward and its sampling rows' logits (``ModelRunner.forward``)."""
        self._send(self._batch_step("forward", batch))
        self._forwarding = True
        try:
            return self._local(run)
        finally:
            self._forwarding = False

    def hidden(self, batch: ScheduledBatch, run: Callable[[], T]) -> T:
        """A synchronous step's hidden states (``ModelRunner.hidden_states``; within a forward, part of it)."""
        if self._forwarding:
            return run()
        self._send(self._batch_step("hidden", batch))
        return self._local(run)

    def logits(self, rows: list[int], run: Callable[[], T]) -> T:
        """The LM head over rows of the last hidden states (``ModelRunner.logits``)."""
        self._send(TPStep("logits", rows=list(rows)))
        return self._local(run)

    def sampled(self, tokens: torch.Tensor, into_prev: bool) -> None:
        """The step's sampled ids [S] to the workers, on the device (queued on the stream, no sync)."""
        self._send(TPStep("sampled", n=tokens.numel(), dtype=tokens.dtype, into_prev=into_prev))
        self._local(lambda: dist.broadcast(tokens if tokens.is_contiguous() else tokens.contiguous(), src=0))


class StepReplica:
    """A worker's side: rebuilds each lite batch (its page lists kept per request, extended in place so
    that its decode tables' cache holds as on rank 0) and runs the same runner call on its shard."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner            # this rank's ModelRunner (peers None)
        self._pages: dict[str, list[int]] = {}
        self._reqs: dict[str, LiteRequest] = {}      # one per request id (not rebuilt each step)
        self._hidden: Optional[torch.Tensor] = None   # [T, H] of the last "hidden" message

    def tracked(self) -> set[str]:
        """The request ids whose page lists this rank keeps (rank 0's ``StepEncoder.tracked``)."""
        return set(self._pages)

    def _batch(self, cmd: TPStep) -> ScheduledBatch:
        for rid in cmd.forget:
            self._pages.pop(rid, None)
            self._reqs.pop(rid, None)
        seqs = []
        for rid, plen, delta, toks, start, sample, pages, tail, parents in cmd.seqs:
            if tail:
                have = self._pages[rid]
                have.extend(pages)
                pages = have
            elif len(toks) > 1 or start < plen:    # a prompt step: rank 0 keeps no entry either
                self._pages.pop(rid, None)
                self._reqs.pop(rid, None)
            else:
                self._pages[rid] = pages
            req = self._reqs.get(rid)
            if req is None or len(req.prompt_ids) != plen or req.rope_delta != delta:
                req = LiteRequest(rid, range(plen), delta)
                if rid in self._pages:
                    self._reqs[rid] = req
            seqs.append(SeqWork(req, toks, start, pages, sample, tree_parents=parents))  # type: ignore[arg-type]
        return ScheduledBatch(seqs, cmd.page_size)

    @torch.inference_mode()
    def run(self, cmd: TPStep) -> None:
        """This rank's share of one message (outputs dropped: rank 0 has the same)."""
        r = self.runner
        if cmd.kind == "forward":
            r.forward(self._batch(cmd))
        elif cmd.kind == "hidden":
            batch = self._batch(cmd)
            self._hidden = r.hidden_states(batch, flatten(batch))
        elif cmd.kind == "logits":
            assert self._hidden is not None, "logits without hidden states"
            r.logits(self._hidden, cmd.rows)
        elif cmd.kind == "sampled":
            prev = r.graphs.prev if r.graphs is not None else None
            if cmd.into_prev and prev is not None and cmd.dtype == prev.dtype:
                buf = prev[: cmd.n]
            else:
                buf = torch.empty(cmd.n, dtype=cmd.dtype, device=r.device)
            dist.broadcast(buf, src=0)
            r.note_sampled(buf)
        else:
            raise ValueError(f"unknown tensor-parallel message {cmd.kind!r}")
