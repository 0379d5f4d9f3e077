"""The overlap stepper's work on a step's rows (runtime/overlap.py; torch-free).

Which batches may run one step ahead of their token values (``overlappable``, from each request's
fixed needs, looked at once); the placeholder ids a launched step is applied with
(``placeholder_output``); and, once its ids are on the host, putting them in place of the
placeholders (``RowsResolved.place``): a decode row that neither stops, nor is constrained, nor has
errors or logprobs costs a comparison and a store, the others go through ``end_after`` and the
grammar's batched accept.
"""
from __future__ import annotations

from typing import Callable, Optional

from nbgen.core.batch import ScheduledBatch, SeqWork, StepOutput, TokenLogprobs
from nbgen.core.finish import FinishReason
from nbgen.core.request import Request
from nbgen.runtime.grammar_batch import StepGrammar
from nbgen.runtime.step_inputs import is_placeholder, placeholder, placeholder_row

End = Callable[[Request, FinishReason], None]      # finish a request at the resolved step
Abort = Callable[[Request, str], None]             # abort a request whose row failed


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


def _overlaps(r: Request) -> bool:
    """Whether every step of r may run ahead of its token values: no prompt logprobs and none of the
    needs ``_never_overlaps`` lists."""
    return r.logprobs.logprob_start_len < 0 and not _never_overlaps(r)


def _never_overlaps(r: Request) -> bool:
    """Needs that keep every step of r on its token values: penalties over output ids, custom processors
    (they may read output ids), hidden states (copied to the host) or pooling."""
    p = r.params
    return (p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)
            or r.logit_processor is not None or r.return_hidden_states or r.embed is not None)


def _seq_overlaps(s: SeqWork) -> bool:
    """Whether the step of s may run ahead of its token values (a request that is not ``_overlaps``:
    its prompt logprobs may be done; output logprobs overlap)."""
    r = s.req
    return s.prompt_logprob_start < 0 and not r.wants_prompt_logprobs and not _never_overlaps(r)


def constrained(seqs: list[SeqWork]) -> bool:
    """Whether a seq's request has a grammar."""
    return any([s.req.grammar is not None for s in seqs])


def placeholders(n: int) -> range:
    """The placeholder ids of sampled rows 0 .. n-1 (``step_inputs.placeholder``, a linear encoding)."""
    return range(placeholder(0), placeholder(n), placeholder(1) - placeholder(0))


def placeholder_output(batch: ScheduledBatch, sampled: int) -> StepOutput:
    """The StepOutput a launched batch is applied with: row k of its ``sampled`` sampling rows gets
    ``placeholder(k)``, the other rows -1."""
    n = len(batch.seqs)
    if sampled == n:                                 # every row samples (decode steps)
        fake = list(placeholders(n))
    else:                                            # jump-forward's forced rows, prefill chunks
        rows = iter(placeholders(sampled))
        fake = [next(rows) if s.sample else -1 for s in batch.seqs]
    return StepOutput(fake, [None] * n, [None] * n)


def drop_placeholders(batch: ScheduledBatch) -> None:
    """Remove the placeholder ids a failed launch left at the end of its requests' outputs."""
    for s in batch.seqs:
        out = s.req.output_ids
        while out and is_placeholder(out[-1]):
            out.pop()


class RowsResolved:
    """A resolved step's ids put in place: requests finished (``end``) or aborted (``abort``) at it,
    constrained rows gathered in ``grammar`` for one batched accept."""

    def __init__(self, end: End, abort: Abort) -> None:
        self.end, self.abort = end, abort
        self.grammar = StepGrammar()                 # constrained rows (runtime/grammar_batch.py)

    def place(self, batch: ScheduledBatch, sampled: int, toks: list[int], errors: dict[int, str],
              lps: Optional[list[Optional[TokenLogprobs]]]) -> None:
        """``toks``: one id per seq of ``batch`` (-1 where it does not sample; ``sampled`` rows do);
        ``errors`` and ``lps`` by sampling row."""
        seqs = batch.seqs
        rows = zip(seqs, toks) if sampled == len(seqs) else [(s, t) for s, t in zip(seqs, toks) if s.sample]
        each = bool(errors) or lps is not None
        add = self.grammar.add
        for (s, tok), ph in zip(rows, placeholders(sampled)):
            req = s.req
            out = req.output_ids
            at = s.start_pos + len(s.token_ids) - len(req.prompt_ids)   # s.out_index, inlined (hot)
            if not (0 <= at < len(out) and out[at] == ph):
                continue                                 # never appended (aborted / preempted before)
            if each or tok in req.stop_ids or at >= req.end_len - 1:
                self._place_one(req, tok, at, placeholder_row(ph), errors, lps)
            else:                                        # goes on: no stop id, short of its length limit
                out[at] = tok
                if req.grammar is not None:              # its matcher takes the token in the batched accept
                    add(req, tok, None)

    def _place_one(self, req: Request, tok: int, at: int, row: int, errors: dict[int, str],
                   lps: Optional[list[Optional[TokenLogprobs]]]) -> None:
        """A row that may end, is constrained, failed or carries logprobs."""
        if errors and row in errors:                     # every token masked: abort, as the plain loop
            del req.output_ids[at:]                      # the placeholder (the next step is not applied yet)
            self.abort(req, errors[row])
            return
        req.output_ids[at] = tok
        if lps is not None and lps[row] is not None and len(req.output_token_logprobs) == at:
            req.add_output_logprob(lps[row])
        reason = req.end_after(tok, at + 1)              # the one stop check (a length cut was made at update)
        if req.grammar is not None:
            self.grammar.add(req, tok, reason)           # accepted by the caller, all rows in one call
        elif reason is not None:
            self.end(req, reason)
