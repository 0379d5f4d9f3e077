"""NGRAM drafts (prompt lookup): a sequence's next tokens guessed from its own earlier context (no torch).

For each request the proposer keeps the sequence's ids and, per token id, the positions where it
occurred (an index grown with each new token). To draft after a sequence ``ids`` ending in token t:
among the most recent earlier occurrences of t, take the one whose preceding tokens agree longest
with the sequence's suffix (up to ``max_match`` tokens; the most recent wins ties), and propose the
tokens that followed it. Extractive work (quote, edit, summarise a given passage) repeats long runs
of the prompt, so the guesses are often right; a wrong guess costs only its verify rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from nbgen.core.batch import ScheduledBatch
from nbgen.core.request import Request

CANDIDATES = 32   # most recent occurrences of the last token compared per draft (bounded Python work)


@dataclass
class _Index:
    """One request's ids and the positions of each token id among ids[:-1] (those with a successor)."""

    req: Request
    ids: list[int] = field(default_factory=list)
    where: dict[int, list[int]] = field(default_factory=dict)
    indexed: int = 0                       # positions of ids entered into `where`

    def sync(self) -> None:
        """Take in the request's tokens added since the last call."""
        req, ids = self.req, self.ids
        n_prompt = len(req.prompt_ids)
        if len(ids) < n_prompt:
            ids.extend(req.prompt_ids[len(ids):])
        ids.extend(req.output_ids[len(ids) - n_prompt:])
        where = self.where
        for pos in range(self.indexed, len(ids) - 1):
            where.setdefault(ids[pos], []).append(pos)
        self.indexed = max(self.indexed, len(ids) - 1)


class NgramProposer:
    """Prompt-lookup drafts for the running requests (loop thread); a ``spec_step.Drafter``."""

    pages_first = False   # drafts need no KV of their own: pages are lent for what was proposed

    def __init__(self, max_match: int) -> None:
        self.max_match = max_match
        self._index: dict[str, _Index] = {}

    def draft(self, batch: ScheduledBatch, limits: list[int]) -> list[list[int]]:
        """Per seq of ``batch``, up to ``limits[i]`` draft tokens."""
        return [self.propose(s.req, k) if k else [] for s, k in zip(batch.seqs, limits)]

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``req``'s sequence ([] when its context has no match)."""
        ix = self._index.get(req.rid)
        if ix is None or ix.req is not req:
            ix = self._index[req.rid] = _Index(req)
        ix.sync()
        ids = ix.ids
        n = len(ids)
        cands = ix.where.get(ids[-1])
        if k <= 0 or not cands:
            return []
        best, best_len = -1, 0
        for p in reversed(cands[-CANDIDATES:]):
            m = 1
            while m < self.max_match and m <= p and ids[p - m] == ids[n - 1 - m]:
                m += 1
            if m > best_len:
                best, best_len = p, m
                if m >= self.max_match:
                    break
        return ids[best + 1: best + 1 + k]

    def prune(self) -> None:
        """Forget requests that finished."""
        for rid in [r for r, ix in self._index.items() if ix.req.finished]:
            del self._index[rid]
