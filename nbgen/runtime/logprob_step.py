"""The runner's synchronous step with host-side values: prompt logprobs (teacher-forced rows of each
prompt chunk), output logprobs of the sampled tokens, and hidden states (SGLang's shape: every
prompt position, collected chunk by chunk, then the position of each sampled token); plus the
per-seq split of sampling errors.

Kept apart from ``runner.py``: the hot path (``launch`` / ``resolve``) never needs it, and the
overlap loop falls back to this synchronous step for batches that want logprobs or hidden states.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from nbgen.core.batch import HiddenRows, ScheduledBatch, SeqWork, StepOutput, TokenLogprobs
from nbgen.runtime.logprobs import prompt_logprobs
from nbgen.runtime.sampler import Sampler
from nbgen.runtime.step_inputs import FlatStep, flatten


class StepRunner(Protocol):
    """What the synchronous step needs of the ModelRunner."""

    model: torch.nn.Module
    sampler: Sampler

    def hidden_states(self, batch: ScheduledBatch, flat: FlatStep) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor: ...

    def to_device(self, values: list[int]) -> torch.Tensor: ...

    def note_sampled(self, tokens: torch.Tensor) -> None: ...


def sample_errors(batch: ScheduledBatch, errors: dict[int, str]) -> dict[int, str]:
    """Sampling-row errors -> keyed by seq index."""
    sample_idx = [i for i, s in enumerate(batch.seqs) if s.sample]
    return {sample_idx[k]: msg for k, msg in errors.items()}


def wants_logprobs(s: SeqWork) -> bool:
    """Whether the seq needs logprobs (prompt logprobs, or output logprobs of its token)."""
    return s.prompt_logprob_start >= 0 or (s.sample and s.req.logprobs.return_logprob)


def needs_sync_step(s: SeqWork) -> bool:
    """Whether the seq needs this step (logprobs, or its hidden states on the host)."""
    return wants_logprobs(s) or s.req.return_hidden_states


def hidden_positions(batch: ScheduledBatch, starts: list[int]) -> list[tuple[int, int, int]]:
    """(seq index, first position, flat row of that position) per seq whose request wants hidden
    states this step: positions from the first one not collected yet to the end of its chunk. A
    chunk never starts past that position (``waiting.matchable_ids`` keeps such prompts out of the
    prefix cache); a recomputed chunk (after preemption) before it yields nothing."""
    out = []
    for i, s in enumerate(batch.seqs):
        if s.req.return_hidden_states:
            first = max(s.start_pos, s.req.next_hidden_position())
            if first < s.kv_len:
                out.append((i, first, starts[i] + first - s.start_pos))
    return out


def gather_hidden(hidden: torch.Tensor, batch: ScheduledBatch, where: list[tuple[int, int, int]],
                  to_device: Callable[[list[int]], torch.Tensor]) -> list[Optional[HiddenRows]]:
    """The wanted rows of a step's hidden states [T, H], copied to the host at once, per seq."""
    out: list[Optional[HiddenRows]] = [None] * len(batch.seqs)
    rows = [r for i, first, row in where for r in range(row, row + batch.seqs[i].kv_len - first)]
    values = hidden.index_select(0, to_device(rows)).float().tolist()
    k = 0
    for i, first, _ in where:
        n = batch.seqs[i].kv_len - first
        out[i] = HiddenRows(first, values[k:k + n])
        k += n
    return out


def step_with_logprobs(runner: StepRunner, batch: ScheduledBatch) -> StepOutput:
    """A synchronous step that also computes prompt / output logprobs and collects hidden states
    (runner: the ModelRunner)."""
    flat = flatten(batch)
    sample_rows, sample_seqs, starts = flat.sample_rows, flat.sample_seqs, flat.starts
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_owner: list[int] = []  # seq index of each prompt-logprob row
    for i, s in enumerate(batch.seqs):
        if s.prompt_logprob_start >= 0:
            # hidden at position p predicts token p+1: targets t in [max(L, 1, start+1), min(kv_len, prompt_len-1)]
            plen = len(s.req.prompt_ids)
            lo = max(s.prompt_logprob_start, 1, s.start_pos + 1)
            hi = min(s.kv_len, plen - 1)
            for t in range(lo, hi + 1):
                prompt_rows.append(starts[i] + (t - 1 - s.start_pos))
                prompt_targets.append(s.req.prompt_ids[t])
                prompt_owner.append(i)
    hidden = runner.hidden_states(batch, flat)                              # [T, H]
    where = hidden_positions(batch, starts)
    hs = gather_hidden(hidden, batch, where, runner.to_device) if where else None
    logits = runner.logits(hidden, sample_rows + prompt_rows).float()       # [S + Np, V] fp32

    n = len(batch.seqs)
    next_ids = [-1] * n
    out_lps: list[Optional[TokenLogprobs]] = [None] * n
    prm_lps: list[Optional[list[TokenLogprobs]]] = [None] * n
    errors: dict[int, str] = {}
    if sample_seqs:
        res = runner.sampler(logits[: len(sample_rows)], sample_seqs)
        errors = sample_errors(batch, res.errors)
        runner.note_sampled(res.token_ids)
        toks = res.token_ids.tolist()
        k = 0
        for i, s in enumerate(batch.seqs):
            if s.sample:
                next_ids[i] = toks[k]
                out_lps[i] = res.logprobs[k]
                k += 1
    if prompt_rows:
        # each seq's prompt rows are contiguous: one call per seq with its own top-n / token ids
        base = len(sample_rows)
        for owner in dict.fromkeys(prompt_owner):
            lo = prompt_owner.index(owner)
            hi = lo + prompt_owner.count(owner)
            want = batch.seqs[owner].req.logprobs
            prm_lps[owner] = prompt_logprobs(logits[base + lo: base + hi], prompt_targets[lo:hi],
                                             want.top_logprobs_num, want.token_ids_logprob)
    for i, s in enumerate(batch.seqs):
        if s.prompt_logprob_start >= 0 and prm_lps[i] is None:
            prm_lps[i] = []
    return StepOutput(next_token_ids=next_ids, output_logprobs=out_lps,
                      prompt_logprobs=prm_lps, errors=errors, hidden_states=hs)
