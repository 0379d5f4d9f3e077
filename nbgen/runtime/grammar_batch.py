"""A step's constrained tokens accepted by one call into xgrammar, then each row's outcome (torch-free).

The loop walks a step's sampling rows (``Scheduler.update``, ``OverlapStepper``'s resolve) and
gathers the rows of requests with a live grammar in a ``StepGrammar``; ``settle`` then has every
matcher accept its token in one batched call (xgrammar's ``BatchGrammarMatcher.batch_accept_token``,
a C++ loop) instead of one Python call per row, and gives the finish reasons: a stop token completes
the grammar, a refused token aborts its request; requests that go on may jump forward
(runtime/jump_forward.py). Under overlap scheduling the accept runs in the bitmask fill's worker
thread instead (``AcceptJob``, started by ``Constraints.accept_async`` as soon as the step's ids are
on the host): the loop thread walks the step's rows meanwhile and ``settle`` reads the outcome.

xgrammar's Python wrapper of the batched accept turns its result into a list with one FFI call per
row (more than the accepts cost); the binding is called directly and the result is read with one
``0 in result`` (a native search): only a step with a refused token reads it row by row.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from nbgen.core.finish import FinishReason

BATCH_ACCEPT_MIN = 4   # fewer rows: one accept_token call each (the batched call's fixed cost)


@functools.lru_cache(maxsize=1)
def _binding() -> Optional[Any]:
    """xgrammar's FFI class of the batched matcher calls, or None (then its Python API is used)."""
    import xgrammar as xgr

    core = getattr(getattr(xgr, "base", None), "_core", None)
    return getattr(core, "BatchGrammarMatcher", None)


def binding_ready() -> bool:
    """xgrammar's FFI class of the batched calls is there (``accept_handles`` can run)."""
    return _binding() is not None


def accept_handles(handles: list[Any], toks: list[int]) -> Optional[set[int]]:
    """Matcher ``handles[k]`` (FFI objects) accepts ``toks[k]``, one call (GIL released inside
    xgrammar): None when every token was taken, else the refused positions (run in a worker)."""
    if not handles:
        return None
    flags = _binding().batch_accept_token(handles, toks, False)
    if 0 not in flags:
        return None
    return {k for k in range(len(handles)) if not flags[k]}


class AcceptJob:
    """A step's tokens being accepted in a worker (``Constraints.accept_async``): the matchers of
    ``states`` (the step's live constrained rows when its bitmask was filled, less rows already
    stale) take their tokens while the loop thread walks the step's rows; ``StepGrammar.settle``
    then reads the outcome. ``drain`` waits until the worker ran everything queued (the next step's
    fill may be queued behind the accepts: a matcher is never changed while the worker fills it)."""

    def __init__(self, states: list[Any], future: Any, drain: Callable[[], None]) -> None:
        self.states = states
        self.future = future          # -> None or the refused positions in states
        self.drain = drain

    def refused(self, kept: list[Any]) -> set[int]:
        """Wait; the positions in ``kept`` (the states the step's walk gathered, a subset of
        ``states`` in the same order) whose token was refused. A matcher of a row the walk did not
        keep (its request aborted meanwhile: its token is not in its output) gives its token back,
        once the worker is idle."""
        bad = self.future.result()
        if len(kept) == len(self.states) and not bad:
            return set()
        out = {id(self.states[k]) for k in bad} if bad else set()
        if len(kept) != len(self.states):
            ids = {id(s) for s in kept}
            back = [s for s in self.states if id(s) not in ids and id(s) not in out]
            if back:
                self.drain()
                for s in back:
                    s.matcher.rollback(1)
        return {k for k, s in enumerate(kept) if id(s) in out} if out else set()


def accept_tokens(states: list[Any], toks: list[int]) -> list[bool]:
    """Each GrammarState's matcher accepts its token (one call into xgrammar); whether it took it.
    A refused token leaves its matcher unchanged."""
    refused = _accept(states, [s.handle for s in states], toks)
    return [True] * len(states) if refused is None else [k not in refused for k in range(len(states))]


def force_rows(states: list[Any], idss: list[Any], replaced: list[Optional[int]]) -> list[bool]:
    """Each GrammarState ``states[k]`` accepts the forced tokens ``idss[k]`` (jump-forward), after
    rolling back its last token where ``replaced[k]`` (that token) is given; all or nothing per row:
    a row with a refused token is put back as it was. One call into xgrammar for all rows (its
    batched accept is a loop in order, so a matcher may appear once per token)."""
    handles = [s.handle for s in states]
    binding = _binding()
    if binding is None or None in handles:
        return [s.force(list(ids), r) for s, ids, r in zip(states, idss, replaced)]
    back = [h for h, r in zip(handles, replaced) if r is not None]
    if back:
        binding.batch_rollback(back, [1] * len(back))
    hs: list[Any] = []
    toks: list[int] = []
    for h, ids in zip(handles, idss):
        hs += [h] * len(ids)
        toks += ids
    flags = binding.batch_accept_token(hs, toks, False)
    if 0 not in flags:
        return [True] * len(states)
    flags = list(flags)
    ok, at = [], 0
    for s, ids, r in zip(states, idss, replaced):
        took = sum(flags[at:at + len(ids)])
        at += len(ids)
        ok.append(took == len(ids))
        if took != len(ids):               # tokens after a refused one may have been taken: all back
            if took:
                s.matcher.rollback(took)
            if r is not None:
                s.accept(r)
    return ok


def _accept(states: list[Any], handles: list[Any], toks: list[int]) -> Optional[set[int]]:
    """Accept toks[k] in states[k] (``handles``: their matchers' FFI objects); None when every token
    was taken, else the refused positions."""
    n = len(states)
    if n < BATCH_ACCEPT_MIN or None in handles:
        refused = {k for k in range(n) if not states[k].accept(toks[k])}
        return refused or None
    binding = _binding()
    if binding is None:
        import xgrammar as xgr

        flags = xgr.BatchGrammarMatcher.batch_accept_token([s.matcher for s in states], toks)
    else:
        flags = binding.batch_accept_token(handles, toks, False)   # int flags [n], an FFI array
        if 0 not in flags:                                         # one native search
            return None
    refused = {k for k in range(n) if not flags[k]}
    return refused or None


@dataclass
class StepGrammar:
    """A step's sampled tokens of requests with a live grammar, in row order."""

    reqs: list[Any] = field(default_factory=list)                    # Request per row
    toks: list[int] = field(default_factory=list)                    # its sampled token
    reasons: list[Optional[FinishReason]] = field(default_factory=list)   # its reason before the grammar
    states: list[Any] = field(default_factory=list)                  # its GrammarState
    ended: list[tuple[Any, FinishReason]] = field(default_factory=list)   # rows whose grammar completed earlier
    # rows that need more than the accept (a stop token, a reason already): the others go on unchanged
    # unless a token is refused or the request jumps, so without jumpers settle visits these only
    flagged: list[int] = field(default_factory=list)
    jumping: bool = False                                            # some row's grammar has a jumper
    jumper: Any = None                                               # the first row's jumper (one per engine)
    mixed: bool = False                                              # rows of other jumpers, or of none, too
    jumped: list[Any] = field(default_factory=list)                  # after settle: the states whose request jumped
    # ids of requests whose last output token's K/V a forward already queued computes (the overlap stepper's
    # next step: its row there); a jump that keeps that token counts it computed (runtime/jump_forward.py)
    queued: frozenset[int] = frozenset()

    def add(self, req: Any, tok: int, reason: Optional[FinishReason]) -> None:
        """Gather one row (req.grammar set, tok >= 0)."""
        g = req.grammar
        if g.done:                  # completed at an earlier token (overlap: one step behind)
            if reason is not None:
                self.ended.append((req, reason))
            return
        if reason is not None or tok in g.stops:
            self.flagged.append(len(self.reqs))
        if g.jumper is not self.jumper:
            self._other_jumper(g.jumper)
        self.reqs.append(req)
        self.toks.append(tok)
        self.reasons.append(reason)
        self.states.append(g)

    def _other_jumper(self, jumper: Any) -> None:
        """A row whose jumper is not the rows' so far (the first one with a jumper, or a swap)."""
        if self.jumper is None and not self.reqs:
            self.jumper = jumper
        else:
            self.mixed = True
            if self.jumper is None:
                self.jumper = jumper
        self.jumping = True

    def completing(self) -> set[int]:
        """ids of the gathered GrammarStates whose token is one of their stop ids: their grammar
        completes with it (unless refused), so their matcher must not fill a next mask."""
        states, toks = self.states, self.toks
        return {id(states[k]) for k in self.flagged if toks[k] in states[k].stops}

    def settle(self, context_length: Optional[int],
               accepted: Optional[AcceptJob] = None) -> list[tuple[Any, FinishReason]]:
        """Accept every gathered token (``accepted``: already being accepted in a worker), jump
        forward where the request goes on; the requests that finish, with their reasons (stop: the
        grammar completed; abort: a refused token)."""
        out = self.ended
        toks, reasons, states = self.toks, self.reasons, self.states
        if accepted is not None:
            refused: Any = accepted.refused(states)
        elif not self.reqs:
            return out
        else:
            refused = _accept(states, [s.handle for s in states], toks) or ()
        if not self.reqs:
            return out
        check = self.flagged if not refused else sorted(set(self.flagged).union(refused))
        gone: set[int] = set()       # rows whose request finishes
        for k in check:              # without a refused token or a jumper only the flagged rows change
            reason = states[k].settle(toks[k], k not in refused, reasons[k])
            if reason is not None:
                out.append((self.reqs[k], reason))
                gone.add(k)
        if self.jumping:
            self._jump(gone, context_length)
        return out

    def _jump(self, gone: set[int], context_length: Optional[int]) -> None:
        """Rows that go on jump forward where their grammar forces text (runtime/jump_forward.py)."""
        reqs, states = self.reqs, self.states
        if gone:
            keep = [k for k in range(len(reqs)) if k not in gone]
            reqs, states = [reqs[k] for k in keep], [states[k] for k in keep]
        if not self.mixed:
            self.jumped = self.jumper.jump_rows(reqs, states, context_length, self.queued)
            return
        for req, state in zip(reqs, states):      # the engine swapped its jumper between requests
            if state.jumper is not None and state.jumper.jump(req, state, context_length):
                self.jumped.append(state)


def live_rows(seqs: list[Any], skip: frozenset[int] = frozenset()) -> tuple[list[int], list[Any], bool]:
    """(rows, their GrammarStates, greedy) of the seqs whose request has a grammar not completed yet
    (one pass), less the states whose id is in ``skip`` (they complete with the token being accepted);
    ``greedy``: every other seq's grammar completed and every such row, skipped ones too, samples the
    argmax of its masked logits. A completed grammar's request finished when it accepted its stop token
    (overlap: its row was scheduled before): its row's token is never read, whatever its mask row
    holds, so such rows keep a step on the masked-argmax path."""
    rows: list[int] = []
    states: list[Any] = []
    greedy = True
    for i, s in enumerate(seqs):
        req = s.req
        g = req.grammar
        if g is None:
            greedy = False
        elif not g.done:
            if greedy and not _argmax_row(g, req):
                greedy = False
            if skip and id(g) in skip:
                continue
            rows.append(i)
            states.append(g)
    return rows, states, greedy


def greedy_grammar(seqs: list[Any]) -> bool:
    """Every seq's request has a grammar, and each one not completed yet samples the argmax of its masked
    logits: the step's ``live_rows`` will say ``greedy`` whenever its bitmask is filled (a grammar that
    completes meanwhile keeps that), so its LM head may wait for the bitmask (runtime/greedy_heads.py)."""
    for s in seqs:
        g = s.req.grammar
        if g is None or not (g.done or _argmax_row(g, s.req)):
            return False
    return bool(seqs)


def _argmax_row(g: Any, req: Any) -> bool:
    """The request's row samples the argmax of its masked logits (plain greedy, nothing else to apply):
    the grammar's cached answer, else asked now. ``live_rows`` and ``greedy_grammar`` share it, so the
    masked heads' choice at forward time and the fill's ``greedy`` at sampling agree."""
    return g.plain if g.plain is not None else g.plain_greedy(req)


def fill_bitmask(batch_matcher: Any, states: list[Any], bitmask: Any, rows: list[int]) -> Optional[list[Any]]:
    """Fill ``rows`` of an int32 [>= B, ceil(vocab/32)] host bitmask from the states' matchers with
    xgrammar's thread pool (``batch_matcher``: a BatchGrammarMatcher; GIL released while it fills);
    -> the matchers' FFI handles it used (the step's accept takes them again), or None."""
    handle = getattr(batch_matcher, "_handle", None)
    handles = [s.handle for s in states]   # built while the worker holds the GIL: one comprehension
    if handle is None or None in handles:
        batch_matcher.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, indices=rows)
        return None
    handle.batch_fill_next_token_bitmask(handles, bitmask, rows, False)   # the wrapper would build the list again
    return handles
