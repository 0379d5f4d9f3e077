"""The runner's synchronous step with logprobs: prompt logprobs (teacher-forced rows of each prompt
chunk) and output logprobs of the sampled tokens, plus the per-seq split of errors / hidden states.

Kept apart from ``runner.py``: the hot path (``launch`` / ``resolve``) never needs it, and the
overlap loop falls back to this synchronous step for batches that want logprobs.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from nbgen.core.batch import ScheduledBatch, SeqWork, StepOutput, TokenLogprobs
from nbgen.runtime.logprobs import prompt_logprobs
from nbgen.runtime.sampler import Sampler
from nbgen.runtime.step_inputs import FlatStep, flatten


class StepRunner(Protocol):
    """What the logprob step needs of the ModelRunner."""

    model: torch.nn.Module
    sampler: Sampler

    def hidden_states(self, batch: ScheduledBatch, flat: FlatStep) -> torch.Tensor: ...

    def to_device(self, values: list[int]) -> torch.Tensor: ...

    def note_sampled(self, tokens: torch.Tensor) -> None: ...


def per_seq(batch: ScheduledBatch, errors: dict[int, str],
            hidden: Optional[torch.Tensor]) -> tuple[dict[int, str], Optional[list[Optional[list[float]]]]]:
    """Sampling-row errors and hidden states [S, H] -> keyed / listed by seq index."""
    sample_idx = [i for i, s in enumerate(batch.seqs) if s.sample]
    out_err = {sample_idx[k]: msg for k, msg in errors.items()}
    if hidden is None:
        return out_err, None
    hs: list[Optional[list[float]]] = [None] * len(batch.seqs)
    rows = hidden.float().tolist()
    for k, i in enumerate(sample_idx):
        if batch.seqs[i].req.return_hidden_states:
            hs[i] = rows[k]
    return out_err, hs


def wants_logprobs(s: SeqWork) -> bool:
    """Whether the seq needs the logprob step (prompt logprobs, or output logprobs of its token)."""
    return s.prompt_logprob_start >= 0 or (s.sample and s.req.logprobs.return_logprob)


def step_with_logprobs(runner: StepRunner, batch: ScheduledBatch) -> StepOutput:
    """A synchronous step that also computes prompt / output logprobs (runner: the ModelRunner)."""
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
    rows = runner.to_device(sample_rows + prompt_rows)
    hidden = hidden.index_select(0, rows)                                   # [S + Np, H]
    logits = runner.model.compute_logits(hidden).float()                    # [S + Np, V] fp32

    n = len(batch.seqs)
    next_ids = [-1] * n
    out_lps: list[Optional[TokenLogprobs]] = [None] * n
    prm_lps: list[Optional[list[TokenLogprobs]]] = [None] * n
    errors, hs = {}, None
    if sample_seqs:
        res = runner.sampler(logits[: len(sample_rows)], sample_seqs)
        want_hs = any(s.req.return_hidden_states for s in sample_seqs)
        errors, hs = per_seq(batch, res.errors, hidden[: len(sample_rows)] if want_hs else None)
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
