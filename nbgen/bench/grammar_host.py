"""Host cost of a constrained step's grammar work, without a model: ``python -m nbgen.bench.grammar_host``.

``--rows`` requests (default 256) with the JSON schema of ``bench.grammar`` (or ``--extract``: the
nested schema of ``bench.grammar_extract``) are driven through valid outputs of their schema,
tokenized by the real tokenizer (default: the embedded model's), one token per row per step; a row
that completes its output starts a new one. Each step times, in microseconds:

- ``fill``: the step's bitmask filled (``Constraints.fill_async`` + wait, xgrammar's threads);
- ``mask``: the bitmask applied to [rows, vocab] float32 logits (``Constraints.apply``);
- ``accept_per_row``: every row's matcher accepts its token by one call each (``GrammarState.on_token``);
- ``accept_batched``: the same tokens gathered and accepted by one call (``StepGrammar.settle``,
  runtime/grammar_batch.py), on a second set of matchers in the same states;
- ``accept_worker``: as the overlap stepper does, on a third set: the accept started in the fill
  worker (``Constraints.accept_async``), the rows gathered meanwhile, then ``settle`` reads it;
- ``jump_search``: ``find_jump_forward_string`` on every row (what jump-forward asks each step).

With ``--jump-forward`` the rows are requests of the engine's jump-forward path instead: each step a
row takes the first token of the rest of its output text, ``StepGrammar.settle`` accepts the step's
tokens and jumps forward where the grammar forces text (runtime/jump_forward.py), so the states are
those a jump-forward run meets; it times ``fill`` and ``settle`` (accepts, searches and jumps) per
step, and counts the rows searched and the tokens jumped.

Medians and minima over ``--steps`` steps are printed (and written with ``--json``); the minima are
the steady numbers on a busy host. ``--clock thread`` times with the calling thread's CPU time
instead of wall time: steadier on a shared host for the single-threaded parts (accept, settle),
while the fill and the mask then count only this thread's share of their work.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from nbgen.bench import grammar_extract
from nbgen.bench.grammar import SCHEMA
from nbgen.bench.report import add_json_option, write_json
from nbgen.core.batch import SeqWork
from nbgen.core.finish import FinishReason
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.models.embedded import default_model_path
from nbgen.runtime.constraints import Constraints
from nbgen.runtime.grammar import GrammarState
from nbgen.runtime.grammar_batch import AcceptJob, StepGrammar
from nbgen.runtime.grammar_rewrite import fast_json_grammar
from nbgen.runtime.jump_forward import JumpForward

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}

WORDS = ("the capital of france is paris and it has many museums rivers bridges people live there "
         "since an old town with about two million inhabitants").split()


def answer_record(i: int) -> dict[str, Any]:
    """A valid output of ``bench.grammar``'s SCHEMA (deterministic per i)."""
    r = random.Random(i)
    return {"answer": " ".join(r.choice(WORDS) for _ in range(r.randint(5, 40))),
            "confidence": round(r.random(), 2), "keywords": [r.choice(WORDS) for _ in range(r.randint(0, 5))]}


def extract_record(i: int) -> dict[str, Any]:
    """A valid output of ``bench.grammar_extract``'s SCHEMA for its i-th profile."""
    ge = grammar_extract
    city, country = ge.CITIES[(i * 3) % len(ge.CITIES)]
    return {"name": ge.NAMES[i % len(ge.NAMES)], "age": 20 + (i * 7) % 50,
            "address": {"city": city, "country": country},
            "job": {"employer": ge.EMPLOYERS[i % len(ge.EMPLOYERS)], "role": ge.ROLES[i % 5], "since": 1990 + i % 30},
            "skills": [ge.SKILLS[(i + k) % len(ge.SKILLS)] for k in range(1 + i % 3)],
            "status": ge.STATUS[i % 3], "rating": (i % 10) / 2}


class Rows:
    """``n`` requests' GrammarStates walking through token sequences (a finished one restarts)."""

    def __init__(self, compiled: Any, seqs: list[list[int]], eos: int, vocab: int, n: int) -> None:
        self.compiled, self.seqs, self.eos, self.vocab = compiled, seqs, eos, vocab
        self.pos = [(7 * i) % len(seqs[i % len(seqs)]) for i in range(n)]   # staggered starts
        # greedy requests with nothing else to apply (what the sampler's checks read)
        self.reqs = [SimpleNamespace(grammar=self._state(), params=SamplingParams(temperature=0.0),
                                     logprobs=SimpleNamespace(return_logprob=False), logit_processor=None)
                     for _ in range(n)]
        for i, req in enumerate(self.reqs):     # catch up with the staggered position
            for t in self.seqs[i % len(seqs)][: self.pos[i]]:
                assert req.grammar.accept(t)

    def _state(self) -> GrammarState:
        return GrammarState(self.compiled, frozenset([self.eos]), self.vocab)

    def tokens(self) -> list[int]:
        """Each row's next token (the end of its output: the stop id)."""
        out = []
        for i, p in enumerate(self.pos):
            seq = self.seqs[i % len(self.seqs)]
            out.append(seq[p] if p < len(seq) else self.eos)
        return out

    def advance(self) -> None:
        for i, req in enumerate(self.reqs):
            self.pos[i] += 1
            if req.grammar.done:
                req.grammar, self.pos[i] = self._state(), 0


def settle_step(reqs: list[Request], toks: list[int],
                accepting: Optional[AcceptJob] = None) -> list[tuple[Any, FinishReason]]:
    """One step's tokens gathered and settled as the loop does (``StepGrammar``; ``accepting``: the
    accept already running in the fill worker) -> the requests that finished, with their reasons."""
    step = StepGrammar()
    for req, t in zip(reqs, toks):
        step.add(req, t, None)
    return step.settle(None, accepting)


class JumpRows:
    """``n`` requests with jump-forward walking through output texts: each step a row takes the first
    token of the rest of its text; a request whose grammar completed starts the next text."""

    def __init__(self, compiled: Any, tok: Any, texts: list[str], eos: int, n: int) -> None:
        self.compiled, self.tok, self.texts, self.eos = compiled, tok, texts, eos
        self.jumper = JumpForward(tok)
        self._first: dict[tuple[int, int], int] = {}     # (text, char position) -> its next token
        self.text = [(7 * i) % len(texts) for i in range(n)]
        self.reqs = [self._request(i) for i in range(n)]

    def _request(self, i: int) -> Request:
        req = Request(f"r{i}", [0], SamplingParams(temperature=0.0, max_new_tokens=1 << 20))
        req.stop_ids = frozenset([self.eos])
        req.grammar = GrammarState(self.compiled, req.stop_ids, len(self.tok), self.jumper)
        return req

    def sample(self) -> list[int]:
        """Append each row's next token to its output (as the scheduler's update does) -> the tokens."""
        toks = []
        for i, req in enumerate(self.reqs):
            text, pos = self.texts[self.text[i]], len(self.tok.decode(req.output_ids))
            key = (self.text[i], pos)
            if key not in self._first:
                ids = self.tok.encode(text[pos:], add_special_tokens=False)
                self._first[key] = ids[0] if ids else self.eos
            req.output_ids.append(self._first[key])
            req.num_computed = len(req.prompt_ids) + len(req.output_ids) - 1
            toks.append(req.output_ids[-1])
        return toks

    def advance(self) -> None:
        for i, req in enumerate(self.reqs):
            if req.grammar.done:
                self.text[i] = (self.text[i] + 1) % len(self.texts)
                self.reqs[i] = self._request(i)


def jump_forward_steps(rows: JumpRows, cons: Constraints, steps: int,
                       clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Per step: the bitmask fill at the rows' states, then ``settle`` (accepts and jumps) in us; the
    searches asked and the tokens jumped."""
    times: dict[str, list[float]] = {"fill": [], "settle": [], "searched": [], "jumped": []}
    jumper = rows.jumper
    for _ in range(steps):
        seqw = [SeqWork(req, [0], 0, [], True) for req in rows.reqs]
        t0 = clock()
        job = cons.fill_async(seqw)
        job.wait()
        t1 = clock()
        toks = rows.sample()
        searched, jumped = jumper.num_searches, jumper.num_tokens
        t2 = clock()
        ended = settle_step(rows.reqs, toks)
        t3 = clock()
        assert all(r.type == "stop" for _, r in ended), ended
        for k, v in (("fill", t1 - t0), ("settle", t3 - t2)):
            times[k].append(1e6 * v)
        times["searched"].append(jumper.num_searches - searched)
        times["jumped"].append(jumper.num_tokens - jumped)
        rows.advance()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the embedded model)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--extract", action="store_true", help="the nested schema of bench.grammar_extract")
    ap.add_argument("--jump-forward", action="store_true",
                    help="rows with jump-forward: time the fill and settle (accepts, searches, jumps)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall time, or the calling thread's CPU time (steadier on a busy host)")
    add_json_option(ap, "the medians")
    args = ap.parse_args()
    clock = CLOCKS[args.clock]

    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer or default_model_path())
    vocab = len(tok)
    comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    schema, record = (grammar_extract.SCHEMA, extract_record) if args.extract else (SCHEMA, answer_record)
    fast = fast_json_grammar(json.dumps(schema), any_whitespace=False)
    compiled = (comp.compile_json_schema(json.dumps(schema), any_whitespace=False) if fast is None
                else comp.compile_grammar(fast))
    texts = [json.dumps(record(i), separators=(", ", ": ")) for i in range(64)]
    seqs = [tok.encode(t, add_special_tokens=False) for t in texts]
    eos = tok.eos_token_id
    cons = Constraints(vocab, torch.device("cpu"))
    if args.jump_forward:
        times = jump_forward_steps(JumpRows(compiled, tok, texts, eos, args.rows), cons, args.steps, clock)
        _report(times, args, "jump-forward")
        return
    per_row = Rows(compiled, seqs, eos, vocab, args.rows)
    batched = Rows(compiled, seqs, eos, vocab, args.rows)
    worker = Rows(compiled, seqs, eos, vocab, args.rows)
    logits = torch.randn(args.rows, vocab)
    keys = ("fill", "mask", "accept_per_row", "accept_batched", "jump_search", "accept_worker")
    times: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(args.steps):
        seqw = [SeqWork(req, [0], 0, [], True) for req in batched.reqs]
        t0 = clock()
        job = cons.fill_async(seqw)                  # the mask the step samples under
        job.wait()
        t1 = clock()
        cons.apply(logits, seqw, job)                # in place; its cost does not depend on the values
        t2 = clock()
        toks = per_row.tokens()
        assert toks == batched.tokens()
        for req, t in zip(per_row.reqs, toks):
            assert req.grammar.on_token(t, None) is None or t == eos
        t3 = clock()
        ended = settle_step(batched.reqs, toks)
        t4 = clock()
        assert all(r.type == "stop" for _, r in ended), ended
        for req in batched.reqs:                     # what jump-forward asked every row
            if not req.grammar.done:
                req.grammar.matcher.find_jump_forward_string()
        t5 = clock()
        wseq = [SeqWork(req, [0], 0, [], True) for req in worker.reqs]
        wjob = cons.fill_async(wseq)
        wjob.wait()
        t6 = clock()
        accepting = cons.accept_async(wjob, toks)
        ended = settle_step(worker.reqs, toks, accepting)
        t7 = clock()
        assert all(r.type == "stop" for _, r in ended), ended
        for k, v in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t7 - t6)):
            times[k].append(1e6 * v)
        per_row.advance()
        batched.advance()
        worker.advance()
    _report(times, args, "token by token")


def _report(times: dict[str, list[float]], args: argparse.Namespace, mode: str) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    print(f"grammar host work per step, {args.rows} rows, {'extract' if args.extract else 'answer'} schema, "
          f"{mode}, {args.steps} steps, median / min (us; searched, jumped: rows, tokens): "
          + ", ".join(f"{k} {med[k]:.0f} / {low[k]:.0f}" for k in times))
    write_json(args.json, {"rows": args.rows, "extract": args.extract, "mode": mode, "median_us": med, "min_us": low})


if __name__ == "__main__":
    main()
