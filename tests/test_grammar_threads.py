"""The fill worker and the loop thread never touch a matcher at the same time (CPU, overlap stepper).

Under overlap scheduling a step's accepts and the next bitmask fill run in the fill worker
(runtime/constraints.py) while the loop thread walks rows, rolls back tokens it did not keep and
jumps forward (runtime/grammar_batch.py, runtime/jump_forward.py). xgrammar's matchers are not
thread-safe: a matcher changed while the worker fills its row crashes the process or fills a wrong
mask. Here every worker fill holds its rows' matchers a little longer (a wider window, not a
synchronisation) and every matcher call the loop thread makes checks that no fill holds that
matcher; the extraction workload runs with jump-forward (its requests jump in waves, so whole
staged steps go stale) and token by token, the accepts split over the worker and its side thread,
every output valid.
"""
from __future__ import annotations

import json
import tempfile
import threading
from typing import Any

import pytest

from nbgen.bench import grammar_extract
from nbgen.bench.grammar_replay import tiny_model
from nbgen.engine import Engine
from nbgen.models.embedded import default_model_path
from nbgen.runtime import constraints as constraints_mod
from nbgen.runtime import fill_worker as fill_worker_mod
from nbgen.runtime import grammar as grammar_mod
from nbgen.runtime.overlap import OverlapStepper

pytest.importorskip("xgrammar")

N = 48      # > BATCH_FILL_MIN: the fills run in the worker


class Guard:
    """Matchers held by a worker fill, and the loop-thread matcher calls made while one held theirs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[int, int] = {}        # id(GrammarState) -> fills holding it
        self.clashes: list[str] = []
        self.fills = 0
        self.sides = 0                        # accepts split over the side thread
        self.widen = threading.Event()        # never set: its wait only widens the window

    def fill(self, real: Any) -> Any:
        def fill_bitmask(batch_matcher: Any, states: list, bitmask: Any, rows: list) -> None:
            with self.lock:
                self.fills += 1
                for s in states:
                    self.held[id(s)] = self.held.get(id(s), 0) + 1
            try:
                self.widen.wait(0.003)
                real(batch_matcher, states, bitmask, rows)
            finally:
                with self.lock:
                    for s in states:
                        self.held[id(s)] -= 1
        return fill_bitmask

    def check(self, state: Any, what: str) -> None:
        if threading.current_thread().name.startswith("nbgen-grammar-fill"):
            return                            # the worker's own calls are ordered with its fills
        with self.lock:
            if self.held.get(id(state)):
                self.clashes.append(what)


class Checked:
    """A matcher whose calls check the guard first (stands in for GrammarState.matcher)."""

    def __init__(self, matcher: Any, state: Any, guard: Guard) -> None:
        self._m, self._s, self._g = matcher, state, guard

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._m, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            self._g.check(self._s, name)
            return attr(*a, **k)
        return call


@pytest.fixture(scope="module")
def guarded():
    guard = Guard()
    init = grammar_mod.GrammarState.__init__

    def guarded_init(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        accept, search = self._accept, self.search

        def checked_accept(t: int, d: bool) -> Any:
            guard.check(self, "accept_token")
            return accept(t, d)

        def checked_search() -> str:
            guard.check(self, "find_jump_forward_string")
            return search()
        self.matcher = Checked(self.matcher, self, guard)
        self._accept, self.search = checked_accept, checked_search

    tok = default_model_path()
    mp = pytest.MonkeyPatch()
    mp.setattr(grammar_mod.GrammarState, "__init__", guarded_init)
    mp.setattr(constraints_mod, "fill_bitmask", guard.fill(constraints_mod.fill_bitmask))
    mp.setattr(fill_worker_mod, "SPLIT_ACCEPT_MIN", 16)      # N rows: the accepts split in two threads
    accept = fill_worker_mod.accept_handles

    def counted(handles: Any, toks: Any) -> Any:
        if threading.current_thread().name.startswith("nbgen-grammar-side"):
            guard.sides += 1
        return accept(handles, toks)
    mp.setattr(fill_worker_mod, "accept_handles", counted)
    with tempfile.TemporaryDirectory() as path:
        tiny_model(path, tok)
        eng = Engine(path, tokenizer_path=tok, device="cpu", dtype="float32", enable_jump_forward=True,
                     max_running_requests=N, chunked_prefill_size=16384, max_total_tokens=N * 300,
                     random_seed=0)
    loop = eng.loop
    loop.call(lambda: (setattr(loop, "_overlap", OverlapStepper.from_loop(loop)),
                       setattr(loop.scheduler.cfg, "forced_token_rows", 768)))
    yield eng, guard
    eng.shutdown()
    mp.undo()


@pytest.mark.parametrize("jump", [True, False])
def test_no_matcher_call_while_the_worker_fills_it(guarded, jump):
    eng, guard = guarded
    loop = eng.loop
    eng.generate("x", {"max_new_tokens": 1, "regex": "[ab]"})       # makes the grammar service
    service = loop.delivery.grammar
    jumper = service.jumper
    prompts = grammar_extract.prompts(eng, N)
    sp = {"temperature": 0.0, "max_new_tokens": 512, "json_schema": json.dumps(grammar_extract.SCHEMA)}
    try:
        loop.call(lambda: setattr(service, "jumper", jumper if jump else None))
        n0, fills0, sides0 = jumper.num_jumps, guard.fills, guard.sides
        guard.clashes.clear()
        outs = eng.generate(prompts, sp, use_tqdm=False)
    finally:
        loop.call(lambda: setattr(service, "jumper", jumper))
    assert guard.fills - fills0 > 10, "the worker never filled"
    assert guard.sides - sides0 > 10, "the accepts never split"
    assert (jumper.num_jumps > n0) == jump
    assert not guard.clashes, sorted(set(guard.clashes))
    check = grammar_extract.check(outs)
    assert check["valid"] == check["n"] == N, check


def test_rows_that_jumped_stay_out_of_the_next_fill_and_its_accepts(guarded, monkeypatch):
    """A step staged before some of its requests jumped forward: the fill started after the jumps
    leaves those requests' matchers out (their rows are stale: the token is never kept, the matcher
    is already past the forced text), so every filled row's request still ends where the row samples,
    and every accept job's matchers are exactly the rows its step's walk keeps (nothing to give back)."""
    from nbgen.runtime.constraints import Constraints
    from nbgen.runtime.grammar_batch import AcceptJob

    eng, _ = guarded
    loop = eng.loop
    eng.generate("x", {"max_new_tokens": 1, "regex": "[ab]"})
    jumper = loop.delivery.grammar.jumper
    fill_async, refused = Constraints.fill_async, AcceptJob.refused
    stale_rows: list[int] = []      # per fill: filled rows whose request's output moved past the row
    skipped: list[int] = []         # per fill: states left out beside the completing ones
    given_back: list[int] = []      # per accept job: matchers the walk did not keep

    def checked_fill(self: Any, seqs: Any, skip: frozenset = frozenset(), queued: bool = False,
                     live: Any = None) -> Any:
        job = fill_async(self, seqs, skip, queued, live)
        if job is not None:
            bad = 0
            for i in job.rows:
                s = seqs[i]
                at = s.start_pos + len(s.token_ids) - len(s.req.prompt_ids)   # where the row's token goes
                bad += len(s.req.output_ids) != at
            stale_rows.append(bad)
            skipped.append(len(skip))
        return job

    def checked_refused(self: Any, kept: list) -> Any:
        given_back.append(len(self.states) - len(kept))
        return refused(self, kept)

    monkeypatch.setattr(Constraints, "fill_async", checked_fill)
    monkeypatch.setattr(AcceptJob, "refused", checked_refused)
    n0 = jumper.num_jumps
    outs = eng.generate(grammar_extract.prompts(eng, N), {"temperature": 0.0, "max_new_tokens": 512,
                        "json_schema": json.dumps(grammar_extract.SCHEMA)}, use_tqdm=False)
    assert jumper.num_jumps - n0 > N, "the requests did not jump"
    assert len(stale_rows) > 10 and sum(skipped) > N, (len(stale_rows), sum(skipped))
    assert sum(stale_rows) == 0, stale_rows
    assert given_back and not any(given_back), given_back
    check = grammar_extract.check(outs)
    assert check["valid"] == check["n"] == N, check
