"""CPU: the steps that carry jump-forward's forced rows. The scheduler puts a jump's rows at its request's place
among the decode rows (so the sampling rows keep their order from step to step); a decode graph step with such
rows is staged with its sampling rows first, so its LM head reads the graph's leading rows and the greedy /
masked heads serve it (runtime/cuda_graphs.py ``stage(sampling_first=True)``, runtime/runner.py's forward path);
a jump that keeps the token just sampled counts its K/V computed where the queued next step computes it."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nbgen.core.batch import StepOutput
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.runtime.cuda_graphs import CudaGraphRunner
from nbgen.runtime.decode_staging import HostStep, Staged
from nbgen.runtime.grammar import GrammarState
from nbgen.runtime.grammar_batch import StepGrammar
from nbgen.runtime.jump_forward import JumpForward
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.step_inputs import sampling_rows_first

def _seq(name: str, sample: bool) -> SimpleNamespace:
    return SimpleNamespace(name=name, sample=sample)


def test_sampling_rows_first_keeps_each_part_in_order():
    seqs = [_seq("f1", False), _seq("f2", False), _seq("a", True), _seq("g1", False), _seq("b", True)]
    out, lead = sampling_rows_first(seqs)
    assert [s.name for s in out] == ["a", "b", "f1", "f2", "g1"] and lead == 2
    every = [_seq("a", True), _seq("b", True)]
    assert sampling_rows_first(every) == (every, 0)          # nothing to move: the batch's own list
    none = [_seq("f", False)]
    assert sampling_rows_first(none) == (none, 0)


class _Staging:
    """DecodeStaging's part ``stage`` calls: records the seqs it is asked to write."""

    def __init__(self) -> None:
        self.bs_of = [next(b for b in (1, 2, 4, 8) if b >= n) for n in range(9)]
        self.written: list[list[str]] = []

    def write(self, buf, seqs, ids, cascade, lead=0) -> HostStep:
        self.written.append([s.name for s in seqs])
        self.lead = lead
        return HostStep(len(seqs), self.bs_of[len(seqs)], 0, False, None)


def _graphs(variant=None) -> CudaGraphRunner:
    g = object.__new__(CudaGraphRunner)
    g.staging, g.variant, g.cascade_graphs, g.cascade_steps = _Staging(), variant, {}, 0
    g._ring = SimpleNamespace(next=lambda: ([None], [np.zeros(1)]), done=lambda: None)
    g._send = lambda st, step: None
    return g


def test_stage_puts_the_sampling_rows_first_only_when_asked():
    """The forward path's staging moves the sampling rows to the front (``Staged.lead``); the synchronous
    path, explicit ids (draft steps) and graph variants (LoRA rows staged in batch order) keep the order."""
    seqs = [_seq("f1", False), _seq("a", True), _seq("f2", False), _seq("b", True)]
    batch = SimpleNamespace(seqs=seqs)
    g = _graphs()
    st = g.stage(batch, sampling_first=True)
    assert g.staging.written[-1] == ["a", "b", "f1", "f2"] and st.lead == 2 and st.sampled == 2 and st.n == 4
    assert g.staging.lead == 2                               # the shared-prefix plan covers those rows
    st = g.stage(batch)
    assert g.staging.written[-1] == ["f1", "a", "f2", "b"] and st.lead == 0 and st.sampled == 4
    st = g.stage(batch, [1, 2, 3, 4], sampling_first=True)
    assert g.staging.written[-1] == ["f1", "a", "f2", "b"] and st.lead == 0
    g = _graphs(variant=SimpleNamespace(wanted=lambda b: False))
    assert g.stage(batch, sampling_first=True).lead == 0 and g.staging.written[-1] == ["f1", "a", "f2", "b"]


class _Replay:
    """The decode graphs' part the runner's forward path uses, over an [8, 4] output whose row k holds k."""

    def __init__(self, masked: bool) -> None:
        self.out = torch.arange(8, dtype=torch.float32)[:, None].repeat(1, 4)
        self.masked = masked
        self.staged: list[bool] = []

    def stage(self, batch, sampling_first=False) -> Staged:
        self.staged.append(sampling_first)
        lead = sum(s.sample for s in batch.seqs)
        return Staged(len(batch.seqs), 8, False, lead=lead if lead < len(batch.seqs) else 0)

    def can_run(self, batch, n_prev=0) -> bool:
        return True

    def replay(self, staged, prev=None):
        return self.out[: staged.n]

    def greedy_ids(self, staged, seqs):
        return None

    def masked_head(self, staged, seqs) -> bool:
        return self.masked

    def padded_output(self, staged):
        return self.out

    def sampling_output(self, staged):
        return CudaGraphRunner.sampling_output(self, staged)


def _runner(masked: bool) -> ModelRunner:
    r = object.__new__(ModelRunner)
    r.graphs, r.peers, r.lora, r.vision, r.on_gpu = _Replay(masked), None, None, None, True
    r._last_tokens, r._forwards = None, 0
    r.model = SimpleNamespace(compute_logits=lambda h: h.clone())
    r.to_device = lambda values: (_ for _ in ()).throw(AssertionError("no row list goes to the device"))
    return r


def test_forward_of_a_step_with_forced_rows_reads_the_leading_rows():
    """A forced-row step's logits are the graph's leading rows (padded to a graph size, cut to its sampling
    rows; no row list uploaded, no gather), or its LM head is deferred to the masked head."""
    seqs = [_seq("f1", False), _seq("a", True), _seq("f2", False), _seq("b", True), _seq("c", True)]
    batch = SimpleNamespace(seqs=seqs, is_decode_only=True)
    r = _runner(masked=False)
    fwd = r.forward(batch)
    assert r.graphs.staged == [True] and fwd.head is None
    assert [s.name for s in fwd.seqs] == ["a", "b", "c"]
    assert fwd.logits[:, 0].tolist() == [0.0, 1.0, 2.0]      # graph rows 0..2: the sampling rows, in order
    r = _runner(masked=True)
    fwd = r.forward(batch)
    assert fwd.logits is None and fwd.head is not None and fwd.head.lead == 3


def test_forced_rows_sit_at_their_requests_place_among_the_decodes():
    """A jump's rows come where its request's decode row would (running order), so the step's sampling rows
    are in the same order as in a step without jumps (the shared-prefix plan over them is reused); prompt
    chunks still follow the one-token rows."""
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, forced_token_rows=16))
    reqs = [Request(r, [1, 2, 3], SamplingParams(max_new_tokens=20)) for r in "abc"]
    for r in reqs:
        sched.add(r)
    sched.update(sched.schedule(), StepOutput([7, 7, 7], [None] * 3, [None] * 3))   # prefills sample 7
    plain = [s.req.rid for s in sched.schedule().seqs if s.sample]
    reqs[1].output_ids.extend([8, 9])                                              # b jumps
    late = Request("d", list(range(1, 12)), SamplingParams(max_new_tokens=4))
    sched.add(late)
    batch = sched.schedule()
    assert [(s.req.rid, s.q_len, s.sample) for s in batch.seqs] == [
        ("a", 1, True), ("b", 1, False), ("b", 1, False), ("b", 1, True), ("c", 1, True), ("d", 11, True)]
    assert [s.req.rid for s in batch.seqs if s.sample][:3] == plain == ["a", "b", "c"]

VOCAB = list('{}":, abcdemnrt') + ['{"', '"name": "'] + ["</s>"]
EOS = len(VOCAB) - 1


@pytest.fixture(scope="module")
def compiled():
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)


def test_a_kept_token_with_queued_kv_counts_computed(compiled):
    """A jump that keeps the token just sampled, of a request whose next row (queued by the overlap stepper
    before the jump) computes that token's K/V, counts it computed: the forced rows start after it. Where
    the jump re-encodes that token (a merge across the boundary, here ``{`` + ``"`` -> ``{"``) or no row
    computes it, nothing is counted."""
    class CharTok:                       # one character per token: the sampled token is always kept
        def encode(self, text, add_special_tokens=False):
            return [VOCAB.index(c) for c in text]

        def decode(self, ids, clean_up_tokenization_spaces=False):
            return "".join(VOCAB[i] for i in ids)

    class MergingTok(CharTok):           # the longest piece first: '{' + '"name": "' starts with '{"'
        def encode(self, text, add_special_tokens=False):
            out, k = [], 0
            while k < len(text):
                piece = max((v for v in VOCAB[:EOS] if text.startswith(v, k)), key=len)
                out.append(VOCAB.index(piece))
                k += len(piece)
            return out

    brace = VOCAB.index("{")
    for tok, replaced in ((CharTok(), False), (MergingTok(), True)):
        jumper = JumpForward(tok)
        step, reqs = StepGrammar(), []
        for i in range(4):
            req = Request(f"r{i}", [1, 2], SamplingParams(max_new_tokens=40))
            req.stop_ids = frozenset([EOS])
            req.grammar = GrammarState(compiled, req.stop_ids, len(VOCAB), jumper)
            req.output_ids = [brace]
            req.num_computed = len(req.prompt_ids)           # the sampled "{" has no K/V counted yet
            step.add(req, brace, None)
            reqs.append(req)
        step.queued = frozenset(id(r) for r in reqs[:2])      # rows 0, 1: a queued forward computes "{"
        assert step.settle(None) == [] and len(step.jumped) == 4
        assert "".join(VOCAB[t] for t in reqs[0].output_ids) == '{"name": "'
        assert [r.num_computed for r in reqs] == [2, 2, 2, 2] if replaced else [3, 3, 2, 2]
