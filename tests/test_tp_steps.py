"""Tensor parallelism's step protocol (runtime/tp_step.py) on the CPU (gloo): tp 2 and tp 4 against tp 1 in
fp32, token for token, over chunked prefill, prefix-cache hits, prompt and output logprobs, n > 1, stop
strings, a grammar, an abort mid-run; with rank 0's overlap stepper forced on (on the CPU it is off: steps
are synchronous there, but the protocol is the same: placeholders, sampled ids broadcast, dropped stages).
Plus the lite batch's page lists (tails, rewrites, forgetting) against the batches rank 0 encoded."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import nbgen
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.tp_step import StepEncoder, StepReplica, TPStep
from tests.test_tp import tp_workers

PROMPTS = ["Hello there, how are you today?", "def add(a, b):", "The quick brown fox jumps over",
           "Hello there, how are you doing?"]
GREEDY = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def overlap_on_cpu(monkeypatch):
    """Rank 0's runner overlaps on the CPU too (the workers follow whatever rank 0 sends); counts the
    placeholder ids sent to the workers (step N+1 scheduled before step N's ids were read)."""
    init, seqs = ModelRunner.__init__, StepEncoder.seqs
    seen = {"placeholders": 0}

    def patched(self, *a, **kw):
        init(self, *a, **kw)
        self.overlap = True

    def counting(self, batch):
        wire, forget = seqs(self, batch)
        seen["placeholders"] += sum(t < 0 for w in wire for t in w[3])
        return wire, forget

    monkeypatch.setattr(ModelRunner, "__init__", patched)
    monkeypatch.setattr(StepEncoder, "seqs", counting)
    return seen


def scenario(model_dir: str, tp: int) -> tuple[list, list[float]]:
    """Everything compared between tp sizes, from one engine: token ids and texts (equal), logprobs
    (within 1e-4)."""
    got: list = []
    lps: list[float] = []
    with nbgen.Engine(model_dir, dtype="float32", device="cpu", tp_size=tp, random_seed=0,
                      chunked_prefill_size=8, page_size=4) as eng:
        if tp > 1:
            assert len(tp_workers()) == tp - 1
        lp = eng.generate(PROMPTS, GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                          use_tqdm=False)
        got.append([o["output_ids"] for o in lp])
        for o in lp:
            m = o["meta_info"]
            lps += [t[0] for t in m["output_token_logprobs"]] + [t[0] for t in m["input_token_logprobs"][1:]]
            got.append([[t[1] for t in top] for top in m["output_top_logprobs"]])
        again = eng.generate(PROMPTS, GREEDY, use_tqdm=False)          # prefix-cache hits, no logprobs
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
        got.append([o["output_ids"] for o in again])
        samples = eng.generate(PROMPTS[:2], {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.9, "n": 3,
                                             "sampling_seed": 11, "ignore_eos": True}, use_tqdm=False)
        got.append([o["output_ids"] for o in samples])
        text = again[2]["text"]
        stop = text[len(text) // 2: len(text) // 2 + 2]
        stopped = eng.generate(PROMPTS[2], {**GREEDY, "stop": [stop]}, use_tqdm=False)
        assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
        got.append((stopped["text"], stopped["output_ids"]))
        gram = eng.generate(PROMPTS[1], {"max_new_tokens": 12, "temperature": 0, "regex": "[a-z]+ [0-9]{2}"},
                            use_tqdm=False)
        got.append((gram["text"], gram["meta_info"]["finish_reason"]["type"]))
        stream = eng.generate(PROMPTS[0], {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
                              stream=True)
        first = next(stream)
        eng.abort(first["meta_info"]["id"])
        rest = list(stream)
        last = rest[-1] if rest else first
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        after = eng.generate(PROMPTS, GREEDY, use_tqdm=False)           # the engine serves on, same tokens
        assert [o["output_ids"] for o in after] == got[0]
    assert tp_workers() == []
    return got, lps


_REF: dict[str, tuple[list, list[float]]] = {}


def check_against_tp1(model_dir: str, tp: int) -> None:
    if model_dir not in _REF:
        _REF[model_dir] = scenario(model_dir, 1)
    ref, ref_lps = _REF[model_dir]
    got, lps = scenario(model_dir, tp)
    assert got == ref
    assert len(lps) == len(ref_lps) > 50
    assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4


def test_tp_steps_match_tp1(tiny_llama_dir):
    check_against_tp1(tiny_llama_dir, 2)


@pytest.mark.parametrize("family,tp", [("qwen3", 2), ("llama", 4)])
def test_tp_overlap_steps_match_tp1(family, tp, request, overlap_on_cpu):
    # the reference may be overlapped too: the same tokens as without overlap, by design
    check_against_tp1(request.getfixturevalue(f"tiny_{family}_dir"), tp)
    assert overlap_on_cpu["placeholders"] > 20


def _req(rid: str, plen: int) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, prompt_ids=list(range(plen)), rope_delta=0)


class _Recorder:
    """A runner stand-in that keeps the batches a replica rebuilds."""

    graphs = None

    def __init__(self) -> None:
        self.batches: list[ScheduledBatch] = []

    def forward(self, batch: ScheduledBatch) -> None:
        self.batches.append(batch)


def test_lite_batches_carry_the_page_lists():
    """Page tails after a decode step, whole lists after prompt steps and after a list was replaced or
    rewritten, forgotten requests: the replica's lists equal rank 0's at every step, and decode steps
    send tails only (the replica extends one list object per request)."""
    rng = random.Random(0)
    enc, rec = StepEncoder(), _Recorder()
    rep = StepReplica(rec)
    reqs = {f"r{i}": (_req(f"r{i}", 5), [rng.randrange(1, 999) for _ in range(3)]) for i in range(400)}
    pos = {rid: 0 for rid in reqs}
    tails = forgotten = 0
    obj: dict[str, list] = {}        # the replica's list object per request, as last seen
    for step in range(12):
        live = rng.sample(sorted(reqs), 40) if step % 3 else sorted(reqs)    # many requests: forgetting runs
        seqs = []
        for rid in live:
            req, pages = reqs[rid]
            if step == 7 and rid == live[0]:        # a new list object (preemption): sent whole
                pages = list(pages)
                reqs[rid] = (req, pages)
            if pos[rid] < 5:                        # prompt chunk
                seqs.append(SeqWork(req, [1] * 5, 0, pages, True))
                pos[rid] = 5
            else:
                if rng.random() < 0.5:
                    pages.append(rng.randrange(1, 999))
                seqs.append(SeqWork(req, [-1], pos[rid], pages, True))
                pos[rid] += 1
        wire, forget = enc.seqs(ScheduledBatch(seqs, 4))
        tails += sum(w[7] for w in wire)
        forgotten += len(forget)
        rep.run(TPStep("forward", wire, 4, forget))
        got = rec.batches[-1]
        assert [s.pages for s in got.seqs] == [s.pages for s in seqs]
        assert [(s.req.rid, len(s.req.prompt_ids), s.token_ids, s.start_pos) for s in got.seqs] == \
            [(s.req.rid, len(s.req.prompt_ids), s.token_ids, s.start_pos) for s in seqs]
        for a, w in zip(got.seqs, wire):
            if w[7]:                                # a tail: appended to the list the replica has
                assert a.pages is obj[a.req.rid]
            obj[a.req.rid] = a.pages
    assert tails > 100 and forgotten > 0
    assert rep.tracked() == enc.tracked()      # the replica keeps what rank 0 tracks, no more (no leak)


def test_tp2_embeddings_match_tp1(tiny_llama_dir):
    """Embedding steps run the "hidden" message (pooling on rank 0 over the all-reduced states)."""
    vecs = []
    for tp in (1, 2):
        with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", tp_size=tp, is_embedding=True,
                          chunked_prefill_size=8) as eng:
            vecs.append([o["embedding"] for o in eng.encode(PROMPTS)])
    assert len(vecs[1]) == len(PROMPTS) and len(vecs[1][0]) == 64
    assert max(abs(a - b) for x, y in zip(*vecs) for a, b in zip(x, y)) <= 1e-5


def test_a_dead_worker_fails_steps_not_the_engine(tiny_llama_dir):
    """A worker killed between steps: the next requests end as aborts naming the lost workers (no hang),
    and shutdown leaves no process behind."""
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", tp_size=2) as eng:
        assert eng.generate(PROMPTS[0], GREEDY, use_tqdm=False)["meta_info"]["completion_tokens"] == 14
        (worker,) = tp_workers()
        worker.kill()
        worker.wait(30)
        for _ in range(2):
            out = eng.generate(PROMPTS[0], GREEDY, use_tqdm=False)
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert "tensor-parallel" in out["meta_info"]["finish_reason"]["message"]
    assert tp_workers() == []
