"""STANDALONE draft steps on CUDA graphs with the drafts kept on the device (the fast path of
runtime/spec_draft_model.py).

When every seq of a step is a decode and each one's draft catch-up fits a row of q tokens
(q = ``speculative_num_draft_tokens``; after a verify step the catch-up is its accepted drafts and the
bonus token, at most q), a draft step needs no host read until the drafts are verified:

1. catch-up and d1: the draft runner's own verify graphs (runtime/verify_graphs.py over the draft
   model, rows padded to q tokens) run each seq's tokens without draft KV; d1 is sampled on the device
   from each drafting row's last real token;
2. d2 .. dk: k - 1 replays of the draft's decode graphs. A step's input ids are placeholders naming
   rows of the previous step's sampled ids (``step_inputs.placeholder``), which the decode graph
   resolves inside itself (runtime/cuda_graphs.py), so no draft token crosses to the host in between;
3. the drafts [n, K] go to pinned host memory behind one event (``PendingDrafts``) and, on the device,
   into the target verify graph's input ids (``PendingDrafts.patch``): the target's verify forward is
   queued before the host waits for the drafts, and the host reads them once per engine step.

Drafts are sampled as the eager path samples them (the request's parameters and seeded noise at the
draft's output index), so both paths propose the same tokens up to kernel rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.step_inputs import placeholder, to_device
from nbgen.runtime.verify_graphs import VerifyGraphRunner


@dataclass
class PendingDrafts:
    """A step's drafts on the device, on their way to the host."""

    tokens: torch.Tensor               # [n, K] long on the device: seq i's drafts are tokens[i, :counts[i]]
    counts: list[int]                  # [n] drafts of each seq of the batch (its draft budget)
    host: torch.Tensor                 # [n, K] pinned copy of ``tokens`` (valid once ``event`` completed)
    event: Optional[torch.cuda.Event]  # after the copy; None on the CPU
    graph_steps: int = 0               # the drafter's graph steps so far (Engine.stats)

    def patch(self, q: int) -> Callable[[torch.Tensor], None]:
        """A function writing the drafts into a verify layout's flat input ids [bs * q] on the device:
        seq i's draft j goes to flat row ``i * q + 1 + j`` (runtime/verify_layout.py)."""
        K = self.tokens.shape[1]
        c = np.asarray(self.counts, dtype=np.int64)
        row = np.repeat(np.arange(len(c)), c)
        j = np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c)
        dst = to_device((row * q + 1 + j).tolist(), self.tokens.device)
        src = to_device((row * K + j).tolist(), self.tokens.device)
        flat = self.tokens.view(-1)

        def apply(ids: torch.Tensor) -> None:
            ids.index_copy_(0, dst, flat.index_select(0, src))
        return apply

    def lists(self) -> list[list[int]]:
        """Wait for the copy; each seq's drafts."""
        if self.event is not None:
            self.event.synchronize()
        return [r[:k] for r, k in zip(self.host.tolist(), self.counts)]


class DraftGraphs:
    """Graph steps of a draft runner: ``catch_up`` (its verify graphs, rows of q tokens) and its decode
    graphs (``runner.graphs``)."""

    def __init__(self, runner: ModelRunner, catch_up: VerifyGraphRunner) -> None:
        self.runner, self.catch_up, self.q = runner, catch_up, catch_up.q
        g = runner.graphs
        self.max_bs = min(catch_up.max_bs, g.max_bs) if g is not None else catch_up.max_bs   # both graph sets
        self.steps = 0                   # draft steps run here

    def can_run(self, work: list[SeqWork]) -> bool:
        """Every catch-up seq fits a verify row, and the batch fits both graph sets."""
        return not self.catch_up.stale and 0 < len(work) <= self.max_bs and all(0 < w.q_len <= self.q for w in work)

    def decode(self, batch: ScheduledBatch, ids: list[int], prev: torch.Tensor) -> torch.Tensor:
        """One decode-graph replay of one-token seqs whose ids may name rows of ``prev`` (the previous
        draft step's sampled ids [S] on the device) -> hidden states [bs, H] (rows past the batch: padding)."""
        g = self.runner.graphs
        st = g.stage(batch, ids)
        g.replay(st, prev)
        return g.padded_output(st)

    def _sample(self, logits: torch.Tensor, seqs: list[SeqWork]) -> torch.Tensor:
        """Draft ids [S] on the device (logprobs, where a request asks for them, are left unread)."""
        return self.runner.sampler(logits, seqs, defer_logprobs=True).token_ids

    def draft(self, work: list[SeqWork], limits: list[int], page_size: int) -> PendingDrafts:
        """``limits[i]`` drafts after catch-up seq ``work[i]`` (``can_run``; pages lent for them), on the
        device; nothing is read on the host."""
        n, K = len(work), max(limits)
        hidden, starts = self.catch_up.run(ScheduledBatch(work, page_size))           # [bs * q, H]
        live = [i for i in range(n) if limits[i] > 0]
        logits = self.catch_up.logits(hidden, [starts[i] + work[i].q_len - 1 for i in live])
        toks = self._sample(logits, [work[i] for i in live])                             # d1, [len(live)]
        cols = [(live, toks)]
        for j in range(1, K):          # feed d_j at position kv_len + j - 1, sample d_(j+1)
            keep = [r for r, i in enumerate(live) if limits[i] > j]       # rows of ``toks`` going on
            live = [live[r] for r in keep]
            seqs = [SeqWork(work[i].req, [placeholder(r)], work[i].kv_len + j - 1, work[i].pages, True)
                    for r, i in zip(keep, live)]
            padded = self.decode(ScheduledBatch(seqs, page_size), [s.token_ids[0] for s in seqs], toks)
            logits = self.runner.model.compute_logits(padded)[: len(seqs)]     # padded rows: see ModelRunner
            toks = self._sample(logits, seqs)
            cols.append((live, toks))
        self.steps += 1
        return pending_drafts(stack_drafts(cols, n, K), limits, self.steps)


def stack_drafts(cols: list[tuple[list[int], torch.Tensor]], n: int, K: int) -> torch.Tensor:
    """Draft step j's ids ``cols[j] = (seqs, ids [len(seqs)])`` as one [n, K] tensor on the device (0 where a
    seq drafted fewer)."""
    out = torch.zeros(n, K, dtype=torch.long, device=cols[0][1].device)
    for j, (rows, t) in enumerate(cols):
        if len(rows) == n:
            out[:, j].copy_(t)
        else:
            out[:, j].index_copy_(0, to_device(rows, out.device), t)
    return out


def pending_drafts(tokens: torch.Tensor, counts: list[int], graph_steps: int = 0) -> PendingDrafts:
    """``tokens`` [n, K] on their way to the host (pinned copy behind an event on CUDA)."""
    if tokens.device.type != "cuda":
        return PendingDrafts(tokens, counts, tokens, None, graph_steps)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return PendingDrafts(tokens, counts, host, ev, graph_steps)
