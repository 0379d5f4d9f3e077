"""Verifying chain drafts: the target's own token at every draft position, the agreeing prefix, the bonus.

A verify seq runs ``[last, d1 .. dk]`` (the last sampled token and k drafts) in one forward; row j of
its logits is the target's distribution for the token after ``d1 .. dj``. Each row is sampled
exactly as plain decoding would sample that position — the request's penalties over the output
*including* ``d1 .. dj``, ``min_new_tokens``, its seeded noise at that output index
(runtime/sampler.py) — giving target tokens ``t0 .. tk``. The drafts are accepted while
``dj == t(j-1)``; the first disagreement's target token (or ``tk`` after a full match) is the bonus.

Why this is lossless: every emitted token is the token plain decoding draws at that position from
the same prefix. For a point-mass draft d (NGRAM; a greedy draft model) it is the standard rejection
rule: the seeded draw equals d with probability p(d) (accept), and otherwise it is a draw from p
restricted to tokens other than d, renormalised (reject and resample) — together exactly p. For a
sampled draft model the draft uses the same seeded noise, so the rule stays exact (a coupling of the
two draws) and a seed gives the same tokens with or without speculation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from nbgen.core.batch import SeqWork, TokenLogprobs
from nbgen.core.request import Request
from nbgen.runtime.sampler import Sampler

# (drafts, target tokens t0 .. tk) -> how many drafts are accepted
AcceptRule = Callable[[list[int], list[int]], int]


def longest_agreeing(drafts: list[int], targets: list[int]) -> int:
    """The accepted count: drafts agreeing with the target's tokens, up to the first disagreement."""
    a = 0
    for d, t in zip(drafts, targets):
        if d != t:
            break
        a += 1
    return a


@dataclass
class Verified:
    """One sampling seq's result: accepted drafts (with logprobs), the bonus token, an error."""

    accepted: list[int]
    accepted_logprobs: list[Optional[TokenLogprobs]]
    token: int
    logprob: Optional[TokenLogprobs]
    error: Optional[str] = None


def uses_output(req: Request) -> bool:
    """The request's sampling reads its output ids (penalties): draft rows need them extended."""
    p = req.params
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def position_seqs(seq: SeqWork, k: int) -> list[SeqWork]:
    """The k + 1 row views of a verify seq ``[last, d1 .. dk]`` (k = 0: the seq itself): row j samples
    output index ``seq.out_index - k + j`` after the drafts ``d1 .. dj``."""
    if k == 0:
        return [seq]
    req, n = seq.req, len(seq.token_ids)
    drafts = seq.token_ids[n - k:]
    out = []
    for j in range(k + 1):
        r = dataclasses.replace(req, output_ids=req.output_ids + drafts[:j]) if j and uses_output(req) else req
        out.append(SeqWork(r, seq.token_ids[: n - k + j], seq.start_pos, seq.pages, True))
    return out


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[SeqWork], num_drafts: list[int],
           rule: AcceptRule = longest_agreeing) -> list[Verified]:
    """Sample every row of ``logits`` [R, V] (seq i owns ``num_drafts[i] + 1`` consecutive rows, its
    drafts being the last ``num_drafts[i]`` of ``seqs[i].token_ids``) and accept drafts by ``rule``."""
    rows: list[SeqWork] = []
    for s, k in zip(seqs, num_drafts):
        rows.extend(position_seqs(s, k))
    res = sampler(logits, rows)
    toks = res.token_ids.tolist()
    out: list[Verified] = []
    r0 = 0
    for s, k in zip(seqs, num_drafts):
        t, drafts = toks[r0: r0 + k + 1], s.token_ids[len(s.token_ids) - k:]
        a = rule(drafts, t) if k else 0
        err = next((res.errors[r] for r in range(r0, r0 + a + 1) if r in res.errors), None)
        lps = res.logprobs[r0: r0 + a + 1]
        out.append(Verified(drafts[:a], lps[:a], t[a], lps[a], err))
        r0 += k + 1
    return out
