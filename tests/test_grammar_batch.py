"""A step's grammar tokens accepted in one call (runtime/grammar_batch.py), on a small synthetic
vocabulary (no model): the batched accept agrees with one accept per row along random walks with
refused tokens and rows finishing mid-batch; the scheduler finishes and aborts constrained rows as
before; jump-forward is not asked where max_new_tokens leaves no room for a jump."""
from __future__ import annotations

import json
import random
import string
from types import SimpleNamespace

import pytest
import torch

from nbgen.core.batch import StepOutput
from nbgen.core.request import Request, Status
from nbgen.core.sampling import SamplingParams
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.runtime.grammar import GrammarState
from nbgen.runtime.grammar_batch import BATCH_ACCEPT_MIN, StepGrammar, accept_tokens, live_rows
from nbgen.runtime.scheduler import Scheduler

xgr = pytest.importorskip("xgrammar")

CHARS = list(string.ascii_lowercase + '0123 .,:"{}[]')
PIECES = ['ab', 'abc', 'abd', 'ab"', 'ab ', 'a,', 'ba', 'bad', 'ca', 'ca"', '",', '"}', '"]', ', "', '":',
          '{"', '12', '1.', '"name": "', '"tags": ["', '"n": ', 'ok', 'ok"', 'true', 'false']
VOCAB = CHARS + PIECES + ["</s>"]
EOS = len(VOCAB) - 1
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "n"],
          "properties": {"name": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string", "enum": ["ok", "bad", "abc"]}},
                         "n": {"type": "integer"}}}


@pytest.fixture(scope="module")
def info():
    return xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])


@pytest.fixture(scope="module")
def compiled(info):
    return xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)


def _state(compiled) -> GrammarState:
    return GrammarState(compiled, frozenset([EOS]), len(VOCAB))


def _allowed(state: GrammarState) -> list[int]:
    bm = xgr.allocate_token_bitmask(1, len(VOCAB))
    state.fill(bm, 0)
    return [t for t in range(len(VOCAB)) if (bm[0, t // 32] >> (t % 32)) & 1]


def _mask(state: GrammarState) -> torch.Tensor:
    bm = xgr.allocate_token_bitmask(1, len(VOCAB))
    state.fill(bm, 0)
    return bm


@pytest.mark.parametrize("rows", [2, 24])   # below BATCH_ACCEPT_MIN: per row; above: one call
def test_batched_accept_equals_per_row_accept(compiled, rows):
    assert (rows >= BATCH_ACCEPT_MIN) == (rows == 24)
    rng = random.Random(rows)
    ref = [SimpleNamespace(grammar=_state(compiled)) for _ in range(rows)]
    bat = [SimpleNamespace(grammar=_state(compiled)) for _ in range(rows)]
    refused = finished = 0
    for _step in range(80):
        toks = []
        for r in ref:
            allowed = _allowed(r.grammar)
            # mostly an allowed token (the stop id where the grammar may end); now and then any token
            toks.append(rng.randrange(len(VOCAB)) if rng.random() < 0.15 else
                        (EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)))
        want = [r.grammar.on_token(t, None) for r, t in zip(ref, toks)]
        step = StepGrammar()
        for r, t in zip(bat, toks):
            step.add(r, t, None)
        got = dict((id(req), reason) for req, reason in step.settle(None))
        for k, (r, b) in enumerate(zip(ref, bat)):
            w, g = want[k], got.get(id(b))
            assert (w is None) == (g is None) and (w is None or w.to_dict() == g.to_dict()), (k, toks[k], w, g)
            assert r.grammar.done == b.grammar.done
            if w is not None and w.type == "abort":
                refused += 1          # a refused token leaves the matcher as it was: same masks below
            if w is not None:         # the row finished mid-batch: a new request takes its place
                finished += w.type == "stop"
                r.grammar, b.grammar = _state(compiled), _state(compiled)
            assert torch.equal(_mask(r.grammar), _mask(b.grammar))
    assert refused > 0 and finished > 0


def test_accept_tokens_reports_each_refused_row(compiled):
    states = [_state(compiled) for _ in range(8)]
    toks = [VOCAB.index('{"')] * 8
    toks[3] = VOCAB.index("a")          # not JSON's first character
    toks[6] = EOS                        # the grammar cannot end yet
    before = _mask(states[3])
    assert accept_tokens(states, toks) == [True, True, True, False, True, True, False, True]
    assert torch.equal(_mask(states[3]), before)
    assert accept_tokens(states[:2], [VOCAB.index("n"), VOCAB.index("x")]) == [True, False]   # per row


def _scheduler_with(compiled, n: int) -> tuple[Scheduler, list[Request]]:
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4))
    reqs = []
    for i in range(n):
        req = Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=50, json_schema=json.dumps(SCHEMA)))
        req.stop_ids = frozenset([EOS])
        req.grammar = _state(compiled)
        sched.add(req)
        reqs.append(req)
    return sched, reqs


def test_scheduler_update_finishes_and_aborts_constrained_rows(compiled):
    """One update: rows go on, one completes its grammar mid-batch, one samples a refused token
    (aborted, the others unaffected); the next step schedules only the rows that went on."""
    sched, reqs = _scheduler_with(compiled, 6)
    start = VOCAB.index('{"')
    batch = sched.schedule()                                   # the prompts: each samples '{"'
    sched.update(batch, StepOutput([start] * 6, [None] * 6, [None] * 6))
    # drive r1 to where the grammar can end
    for piece in ['name": "', 'ab"', ', "', 'tags": ["', 'ok"', '], "', 'n": ', '1', '}']:
        assert reqs[1].grammar.force([VOCAB.index(c) for c in piece] if piece not in VOCAB else [VOCAB.index(piece)])
    batch = sched.schedule()
    rows = {s.req.rid: i for i, s in enumerate(batch.seqs)}
    toks = [VOCAB.index("n")] * len(batch.seqs)               # '{"n' is a valid prefix ("n" key)
    toks[rows["r1"]] = EOS
    toks[rows["r4"]] = VOCAB.index("}")                        # refused: '{"}' is not JSON
    changed = sched.update(batch, StepOutput(toks, [None] * len(toks), [None] * len(toks)))
    assert {r.rid for r in changed} == {r.rid for r in reqs}
    assert reqs[1].status is Status.FINISHED and reqs[1].finish_reason.to_dict()["type"] == "stop"
    assert reqs[4].status is Status.FINISHED and reqs[4].finish_reason.to_dict()["type"] == "abort"
    assert "not allowed by the grammar" in reqs[4].finish_reason.to_dict()["message"]
    for i in (0, 2, 3, 5):
        assert reqs[i].status is Status.RUNNING and reqs[i].output_ids[-1] == VOCAB.index("n")
    assert {s.req.rid for s in sched.schedule().seqs} == {"r0", "r2", "r3", "r5"}


def test_no_jump_without_room(compiled):
    """A request whose max_new_tokens leaves room for fewer than MIN_JUMP tokens is searched with the
    step's other rows but does not jump (such a jump would be cut to nothing); with room it does."""
    from nbgen.runtime.jump_forward import MIN_JUMP, JumpForward

    class Tok:                                    # one character a token (VOCAB)
        def encode(self, text, add_special_tokens=False):
            return [VOCAB.index(c) for c in text]

        def decode(self, ids, clean_up_tokenization_spaces=False):
            return "".join(VOCAB[i] for i in ids)

    for room in (MIN_JUMP - 1, MIN_JUMP):
        jf = JumpForward(tokenizer=Tok())
        state = _state(compiled)          # one request's grammar (it keeps the request's limits)
        assert state.force([VOCAB.index(c) for c in '{"name": "ab"'])
        req = Request("r", [1, 2], SamplingParams(max_new_tokens=4 + room))   # room = max_new - len(out) - 1
        req.output_ids = [VOCAB.index(c) for c in 'ab"']
        req.num_computed = len(req.prompt_ids) + len(req.output_ids) - 1
        assert jf.jump(req, state, None) == (room >= MIN_JUMP), room
        assert jf.num_searches == 1 and len(req.output_ids) == 3 + (room if room >= MIN_JUMP else 0)


def test_rows_of_completed_grammars_keep_their_reason(compiled):
    """A row whose grammar completed at an earlier token (overlap: one step behind) is not accepted
    again; its own reason (a length cut) still ends it, also in a step without live rows."""
    from nbgen.core.finish import FinishReason

    done = SimpleNamespace(grammar=_state(compiled))
    done.grammar.done = True
    quiet = SimpleNamespace(grammar=_state(compiled))
    quiet.grammar.done = True
    step = StepGrammar()
    step.add(done, EOS, FinishReason.length())
    step.add(quiet, EOS, None)
    assert [(r, x.to_dict()["type"]) for r, x in step.settle(None)] == [(done, "length")]


def test_live_rows_stay_greedy_beside_completed_grammars(compiled):
    """A row whose grammar completed (its request finished; overlap scheduled it one step earlier) is
    no mask row and keeps the step on the masked-argmax path; a free or sampled row does not."""
    def seq(grammar, temperature=0.0):
        req = Request("r", [1], SamplingParams(temperature=temperature))
        req.grammar = grammar
        return SimpleNamespace(req=req)

    done = _state(compiled)
    done.done = True
    live = [seq(_state(compiled)), seq(done), seq(_state(compiled))]
    assert live_rows(live) == ([0, 2], [live[0].req.grammar, live[2].req.grammar], True)
    assert live_rows(live + [seq(None)])[2] is False
    assert live_rows(live + [seq(_state(compiled), temperature=0.7)])[2] is False
    assert live_rows([seq(done)]) == ([], [], True)


def test_worker_accept_equals_per_row_accept(compiled):
    """The overlap stepper's accept in the fill worker (``Constraints.accept_async`` read by
    ``StepGrammar.settle``) gives the per-row outcomes along random walks with refused tokens and
    rows finishing mid-batch; a row the step's walk skips (its request aborted or preempted after
    its mask was filled) gives its token back: its matcher is where it was."""
    from nbgen.runtime.constraints import BATCH_FILL_MIN, Constraints

    n = BATCH_FILL_MIN + 4
    rng = random.Random(7)
    cons = Constraints(len(VOCAB), torch.device("cpu"))

    def row(grammar):
        req = Request("r", [1], SamplingParams(temperature=0.0))
        req.grammar = grammar
        return SimpleNamespace(req=req)

    ref = [_state(compiled) for _ in range(n)]
    seqs = [row(_state(compiled)) for _ in range(n)]
    refused = finished = skipped = 0
    for _step in range(60):
        toks = []
        for r in ref:
            allowed = _allowed(r)
            toks.append(rng.randrange(len(VOCAB)) if rng.random() < 0.15 else
                        (EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)))
        fill = cons.fill_async(seqs)
        assert fill is not None and fill.future is not None
        fill.wait()
        job = cons.accept_async(fill, toks)
        assert job is not None
        skip = rng.randrange(n)                  # the walk skips this row: its token never counted
        step = StepGrammar()
        for k, (s, t) in enumerate(zip(seqs, toks)):
            if k != skip:
                step.add(s.req, t, None)
        got = dict((id(req), reason) for req, reason in step.settle(None, job))
        for k, (r, s) in enumerate(zip(ref, seqs)):
            if k == skip:
                skipped += 1
                assert torch.equal(_mask(r), _mask(s.req.grammar)) and not s.req.grammar.done
                continue
            w, g = r.on_token(toks[k], None), got.get(id(s.req))
            assert (w is None) == (g is None) and (w is None or w.to_dict() == g.to_dict()), (k, toks[k], w, g)
            refused += w is not None and w.type == "abort"
            if w is not None:
                finished += w.type == "stop"
                ref[k], seqs[k] = _state(compiled), row(_state(compiled))
            assert torch.equal(_mask(ref[k]), _mask(seqs[k].req.grammar))
    assert refused > 0 and finished > 0 and skipped == 60


def test_rows_of_two_jumpers_each_jump(compiled):
    """settle hands a step's rows that go on to their jumper in one ``jump_rows`` call; a row whose
    grammar has another jumper (the engine swapped its jumper between requests) jumps through its own:
    every request gets the text its grammar forces (``"name": "`` after ``{``), each jumper counts its own."""
    from nbgen.runtime.jump_forward import JumpForward

    class CharTok:                       # the synthetic vocabulary, one character per token
        def encode(self, text, add_special_tokens=False):
            return [VOCAB.index(c) for c in text]

        def decode(self, ids, clean_up_tokenization_spaces=False):
            return "".join(VOCAB[i] for i in ids)

    jumpers = [JumpForward(CharTok()), JumpForward(CharTok())]
    brace = VOCAB.index("{")
    step, reqs = StepGrammar(), []
    for i, jf in enumerate([0, 0, 1, 0, 1]):
        req = Request(f"r{i}", [1, 2], SamplingParams(max_new_tokens=40))
        req.stop_ids = frozenset([EOS])
        req.grammar = GrammarState(compiled, req.stop_ids, len(VOCAB), jumpers[jf])
        req.output_ids = [brace]
        req.num_computed = len(req.prompt_ids)
        step.add(req, brace, None)
        reqs.append(req)
    assert step.settle(None) == []
    forced = [VOCAB.index(c) for c in '"name": "']
    assert all(r.output_ids == [brace] + forced for r in reqs)
    assert [j.num_jumps for j in jumpers] == [3, 2] and [j.num_searches for j in jumpers] == [3, 2]
    assert all(VOCAB.index("a") in _allowed(r.grammar) for r in reqs)   # inside the name string now


def test_split_accept_reports_refused_rows_of_both_halves(compiled):
    """FillWorker.accept over 2 x SPLIT_ACCEPT_MIN rows runs half of them in its side thread: the
    refused positions of both halves come back (the side half's offset by the first half's size),
    every other matcher took its token, and a job queued next runs after both halves."""
    from nbgen.runtime.fill_worker import SPLIT_ACCEPT_MIN, FillWorker

    n = 2 * SPLIT_ACCEPT_MIN + 6
    states = [_state(compiled) for _ in range(n)]
    brace, bad = VOCAB.index("{"), VOCAB.index("a")        # "a" cannot start a JSON object
    refuse = {3, n // 2 + 5, n - 1}
    toks = [bad if k in refuse else brace for k in range(n)]
    worker = FillWorker(torch.device("cpu"))
    job = worker.accept([s.handle for s in states], toks)
    after = worker.submit(lambda: [VOCAB.index('"') in _allowed(s) for s in states])
    assert job.result() == refuse
    assert after.result() == [k not in refuse for k in range(n)]   # '"' follows "{" only where it was taken


def test_force_rows_takes_all_or_nothing_per_row(compiled):
    """force_rows: the rows' forced tokens in one batched call; a row with a refused token is put back
    as it was (its replaced last token accepted again), the other rows keep theirs."""
    from nbgen.runtime.grammar_batch import force_rows

    ids = {p: VOCAB.index(p) for p in VOCAB}
    states = [_state(compiled) for _ in range(3)]
    for s in states:
        assert s.accept(ids["{"])
    forced = [[ids['"name": "'], ids["a"]], [ids['"name": "'], ids["1"], ids["}"]], [ids['"'], ids["n"]]]
    ok = force_rows(states, forced, [None, None, ids["{"]])
    # row 1: "}" inside the name string is allowed (a string character); row 2 replaced "{" by '"': refused
    assert ok == [True, True, False]
    assert ids["b"] in _allowed(states[0]) and ids['"'] in _allowed(states[1])
    assert ids['"name": "'] in _allowed(states[2])            # back right after its "{"
