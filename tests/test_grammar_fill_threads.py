"""xgrammar's fill threads (``NBGEN_GRAMMAR_THREADS``, kernels/envs.py) and the fill's rows.

The default is half the cores, at most 4; the setting is read at every batch fill, so a change
applies to the next fill, whose masks equal one fill per row at any thread count. ``live_rows``
leaves out the states of a skip set (rows whose grammar completes with the token being accepted)
in its one pass, while their greediness still counts for the step.
"""
from __future__ import annotations

import json
import random
import string
from types import SimpleNamespace

import pytest
import torch

from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.kernels import envs
from nbgen.runtime.constraints import BATCH_FILL_MIN, Constraints
from nbgen.runtime.grammar import GrammarState
from nbgen.runtime.grammar_batch import live_rows

xgr = pytest.importorskip("xgrammar")

VOCAB = list(string.ascii_lowercase + '0123 .,:"{}[]') + ['"name": "', '"n": ', 'ab', '",', "</s>"]
EOS = len(VOCAB) - 1
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)


def _seq(state, temperature: float = 0.0) -> SimpleNamespace:
    req = Request("r", [1], SamplingParams(temperature=temperature))
    req.grammar = state
    return SimpleNamespace(req=req)


def _state(compiled) -> GrammarState:
    return GrammarState(compiled, frozenset([EOS]), len(VOCAB))


@pytest.mark.parametrize("cores,env,want", [(16, None, 4), (64, None, 4), (6, None, 3), (2, None, 1),
                                            (1, None, 1), (16, "8", 8), (2, "3", 3), (16, "0", 1)])
def test_default_threads_half_the_cores_at_most_four(monkeypatch, cores, env, want):
    monkeypatch.setattr(envs.os, "cpu_count", lambda: cores)
    if env is None:
        monkeypatch.delenv("NBGEN_GRAMMAR_THREADS", raising=False)
    else:
        monkeypatch.setenv("NBGEN_GRAMMAR_THREADS", env)
    assert envs.grammar_threads() == want


def test_thread_setting_applies_at_the_next_fill(monkeypatch, compiled):
    """Each batch fill reads the setting: a changed value builds xgrammar's batch matcher with the new
    count (an unchanged one reuses it), and every fill's rows equal per-row fills at the walk's states."""
    made: list[int] = []
    real = xgr.BatchGrammarMatcher

    class Counted(real):
        def __init__(self, max_threads="auto") -> None:
            made.append(max_threads)
            super().__init__(max_threads)
    monkeypatch.setattr(xgr, "BatchGrammarMatcher", Counted)
    rng = random.Random(3)
    n = BATCH_FILL_MIN + 3
    cons = Constraints(len(VOCAB), torch.device("cpu"))
    seqs = [_seq(_state(compiled)) for _ in range(n)]
    ref = xgr.allocate_token_bitmask(n, len(VOCAB))
    for threads in ("1", "2", "2", "1"):
        monkeypatch.setenv("NBGEN_GRAMMAR_THREADS", threads)
        job = cons.fill_async(seqs)
        job.wait()
        for k, s in enumerate(seqs):
            s.req.grammar.fill(ref, k)
        assert job.rows == list(range(n))
        assert torch.equal(job.bitmask[:n], ref)
        for k, s in enumerate(seqs):               # one allowed token each: the next fill sees new states
            words = ref[k].tolist()
            allowed = [t for t in range(len(VOCAB)) if (words[t // 32] >> (t % 32)) & 1 and t != EOS]
            assert s.req.grammar.accept(rng.choice(allowed))
    assert made == [1, 2, 1]


def test_live_rows_skip_leaves_states_out_in_one_pass(compiled):
    """Skipped states are no rows; the step stays greedy only if they are greedy too."""
    states = [_state(compiled) for _ in range(4)]
    done = _state(compiled)
    done.done = True
    seqs = [_seq(states[0]), _seq(done), _seq(states[1]), _seq(states[2]), _seq(states[3])]
    rows, got, greedy = live_rows(seqs, frozenset({id(states[1]), id(states[3])}))
    assert (rows, got, greedy) == ([0, 3], [states[0], states[2]], True)
    assert live_rows(seqs) == ([0, 2, 3, 4], states, True)
    sampled = _state(compiled)
    rows, got, greedy = live_rows(seqs + [_seq(sampled, temperature=0.7)], frozenset({id(sampled)}))
    assert rows == [0, 2, 3, 4] and greedy is False
    assert live_rows(seqs, frozenset(id(s) for s in states)) == ([], [], True)


def _allowed(state: GrammarState) -> list[int]:
    bm = xgr.allocate_token_bitmask(1, len(VOCAB))
    state.fill(bm, 0)
    words = bm[0].tolist()
    return [t for t in range(len(VOCAB)) if (words[t // 32] >> (t % 32)) & 1]


@pytest.mark.parametrize("parts,extra", [(3, 5), (4, 0), (4, 70)])
def test_accept_split_in_parts_reports_refused_rows_of_every_part(monkeypatch, compiled, parts, extra):
    """FillWorker.accept over parts x SPLIT_ACCEPT_MIN (+ extra) rows runs them in ``parts`` threads at
    once (``ACCEPT_PARTS``): the refused positions of every part come back at their place in the step,
    every other matcher took its token, each side thread ran a part, and a job queued next runs after
    them all."""
    import threading

    from nbgen.runtime import fill_worker as fw

    monkeypatch.setattr(fw, "SPLIT_ACCEPT_MIN", 16)
    monkeypatch.setattr(fw, "ACCEPT_PARTS", parts)
    real, sides = fw.accept_handles, []

    def counted(handles, toks):
        if threading.current_thread().name.startswith("nbgen-grammar-side"):
            sides.append(len(handles))
        return real(handles, toks)
    monkeypatch.setattr(fw, "accept_handles", counted)
    n = parts * 16 + extra
    states = [_state(compiled) for _ in range(n)]
    brace, bad = VOCAB.index("{"), VOCAB.index("a")        # "a" cannot start a JSON object
    refuse = {0, n // parts + 1, n - 1, n // 2}
    toks = [bad if k in refuse else brace for k in range(n)]
    worker = fw.FillWorker(torch.device("cpu"))
    job = worker.accept([s.handle for s in states], toks)
    after = worker.submit(lambda: [VOCAB.index('"') in _allowed(s) for s in states])
    assert job.result() == refuse
    assert after.result() == [k not in refuse for k in range(n)]
    assert len(sides) == min(parts, n // 16) - 1 and sum(sides) == n - n // min(parts, n // 16)


def test_fill_from_rows_gathered_earlier_equals_a_fresh_gather(compiled):
    """``fill_async(live=...)``: rows gathered before the step's tokens arrived (the overlap stepper does it
    during the device wait), the skip set left out then, fill the same rows with the same masks as a fill
    that gathers them itself; with nothing to skip the gathered lists are used as they are."""
    rng = random.Random(5)
    n = BATCH_FILL_MIN + 6
    cons = Constraints(len(VOCAB), torch.device("cpu"))
    seqs = [_seq(_state(compiled)) for _ in range(n)]
    done = _state(compiled)
    done.done = True
    seqs[4] = _seq(done)
    for s in seqs:                                   # a different state each row
        g = s.req.grammar
        if not g.done:
            for _ in range(rng.randrange(3)):
                assert g.accept(rng.choice([t for t in _allowed(g) if t != EOS]))
    skip = frozenset({id(seqs[1].req.grammar), id(seqs[n - 1].req.grammar)})
    for sk in (skip, frozenset()):
        live = live_rows(seqs)
        a = cons.fill_async(seqs, sk, live=live)
        a.wait()
        got = (list(a.rows), a.greedy, a.bitmask[:n].clone())
        b = cons.fill_async(seqs, sk)
        b.wait()
        assert got[0] == b.rows and got[1] == b.greedy and torch.equal(got[2][b.rows], b.bitmask[:n][b.rows])
        want = [k for k in range(n) if k != 4 and id(seqs[k].req.grammar) not in sk]
        assert b.rows == want and a.states == b.states
    assert a.rows is live[0]
