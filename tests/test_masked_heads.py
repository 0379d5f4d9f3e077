"""Masked greedy heads (runtime/greedy_heads.py): which decode steps defer their LM head to the masked head's
graph (host logic, with fakes on the CPU), the static device bitmask the fill worker copies into, and on CUDA
the masked heads' ids against the sampler's masked argmax over the plain and shared-prefix graphs."""
from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

from nbgen.runtime.cuda_graphs import CudaGraphRunner
from nbgen.runtime.decode_staging import Staged
from nbgen.runtime.fill_worker import DeviceBitmask, FillJob
from nbgen.runtime.grammar_batch import greedy_grammar
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.step_handles import Forwarded


def _seq(grammar=None):
    return SimpleNamespace(req=SimpleNamespace(grammar=grammar, params=None))


def _grammar(done=False, plain=True):
    g = SimpleNamespace(done=done, plain=plain)
    g.plain_greedy = lambda req: plain
    return g


def test_greedy_grammar_selects_all_constrained_greedy_steps():
    """Every row has a grammar and every live one is plain greedy; a completed grammar's row counts (its token
    is never read) whatever its request asks; a row without grammar or a live non-greedy one excludes the step."""
    assert greedy_grammar([_seq(_grammar()), _seq(_grammar(done=True, plain=False))])
    assert not greedy_grammar([_seq(_grammar()), _seq(None)])
    assert not greedy_grammar([_seq(_grammar()), _seq(_grammar(plain=False))])
    assert not greedy_grammar([])
    unset = _grammar()
    unset.plain = None                       # plain_greedy's answer not cached yet: asked
    assert greedy_grammar([_seq(unset)])


def test_device_bitmask_copy_in_clears_bits_past_the_tokenizer():
    """Rows [n, w] land in the first n rows; the bits of ids >= vocab in the last word are cleared (xgrammar
    may leave them set), words past w and rows past n are left as they were (zero)."""
    bm = DeviceBitmask(4, 150, torch.device("cpu"))       # 5 words a row
    assert bm.words.shape == (4, 5) and bm.fits(4, 5) and not bm.fits(5, 5) and not bm.fits(4, 6)
    rows = torch.full((2, 3), -1, dtype=torch.int32)      # a tokenizer of 70 ids: 3 words, 6 bits in the last
    out = bm.copy_in(rows, 70)
    assert out.shape == (2, 5)
    assert (bm.words[:2, :2] == -1).all() and (bm.words[:2, 2] == 0b111111).all()
    assert (bm.words[:2, 3:] == 0).all() and (bm.words[2:] == 0).all()
    bm.copy_in(torch.full((1, 2), 5, dtype=torch.int32), 64)   # a multiple of 32: nothing cleared
    assert bm.words[0, :2].tolist() == [5, 5]
    bm.mark_read()                                        # host tensors: nothing to record


def test_fill_job_into_copies_fills_and_refuses_rows_that_do_not_fit():
    """A fill is copied into the static buffer; rows that do not fit are refused (the step then computes
    its logits)."""
    host = torch.randint(-2**31, 2**31 - 1, (8, 2), dtype=torch.int32)
    target = DeviceBitmask(4, 64, torch.device("cpu"))
    job = FillJob([0, 1, 2], host, None, vocab=64, greedy=True)
    assert job.into(target, 3) and torch.equal(target.words[:3], host[:3])
    assert not job.into(target, 5)
    assert torch.equal(job.on_device(2, torch.device("cpu")), host[:2])


class _Graphs:
    """The decode graphs' part the runner's deferred head uses."""

    def __init__(self) -> None:
        self.heads = SimpleNamespace(bitmask=DeviceBitmask(8, 64, torch.device("cpu")))
        self.hidden = torch.randn(8, 4)
        self.masked: list[int] = []

    def masked_ids(self, staged: Staged) -> torch.Tensor:
        self.masked.append(staged.bs)
        return torch.arange(staged.n)

    def padded_output(self, staged: Staged) -> torch.Tensor:
        return self.hidden[: staged.bs]

    def sampling_output(self, staged: Staged) -> torch.Tensor:
        return CudaGraphRunner.sampling_output(self, staged)


def _runner() -> ModelRunner:
    r = object.__new__(ModelRunner)
    r.graphs = _Graphs()
    r.model = SimpleNamespace(compute_logits=lambda h: h @ torch.ones(4, 6))
    r._forwards = 1
    return r


def _fwd(n: int = 3, order: int = 1) -> Forwarded:
    return Forwarded(SimpleNamespace(), [object()] * n, None, order=order, head=Staged(n, 8, False))


def test_deferred_head_takes_the_masked_head_only_for_greedy_fills():
    """A deferred step with a greedy fill whose rows reach the static bitmask replays its masked head (no
    logits); without a fill, with a non-greedy one or rows that do not fit, its logits are computed then
    (padded rows, cut to its rows) for the sampler; a step without a deferred head is not touched."""
    r = _runner()
    host = torch.zeros(16, 2, dtype=torch.int32)
    fwd = _fwd()
    res = r._masked_head(fwd, FillJob([0, 1, 2], host, None, vocab=64, greedy=True))
    assert res is not None and res.token_ids.tolist() == [0, 1, 2] and fwd.logits is None and r.graphs.masked == [8]
    for fill in (None, FillJob([0], host, None, vocab=64, greedy=False),
                 FillJob([0], torch.zeros(16, 6, dtype=torch.int32), None, vocab=64 * 3, greedy=True)):   # too wide
        fwd = _fwd()
        assert r._masked_head(fwd, fill) is None
        assert fwd.logits is not None and fwd.logits.shape == (3, 6)
    assert r.graphs.masked == [8]
    plain = Forwarded(SimpleNamespace(), [object()], None, order=1)
    assert r._masked_head(plain, None) is None and plain.logits is None


def test_deferred_head_must_be_sampled_before_the_next_forward():
    """A later forward may have replayed the graph whose output rows the head reads: an internal error."""
    with pytest.raises(AssertionError):
        _runner()._masked_head(_fwd(order=0), None)


def test_graphs_masked_head_needs_heads_every_row_and_no_variant():
    g = object.__new__(CudaGraphRunner)
    g.heads = object()
    seqs = [_seq(_grammar()) for _ in range(3)]
    assert g.masked_head(Staged(3, 4, False), seqs)
    assert not g.masked_head(Staged(4, 4, False), seqs)                  # a forced row: rows != seqs
    assert not g.masked_head(Staged(3, 4, False, variant=True), seqs)    # LoRA graphs: no heads
    assert not g.masked_head(Staged(3, 4, False), seqs[:2] + [_seq(None)])
    g.heads = None
    assert not g.masked_head(Staged(3, 4, False), seqs)


def test_graphs_heads_serve_steps_whose_sampling_rows_lead():
    """A step staged with its sampling rows first (jump-forward's forced rows after them): the masked head
    serves it when those rows are exactly its sampling seqs; its ids are the leading rows of ``prev``, from the
    plain head of padded(S) rows (those rows copied into that graph's output: the LM head over as many rows as
    an eager step's), or from its own graph's head where no smaller head exists."""
    g = object.__new__(CudaGraphRunner)
    ran: list[tuple[int, bool]] = []
    g.heads = SimpleNamespace(run_masked=lambda bs, cascade: ran.append((bs, cascade)),
                              graphs={(4, False): None, (8, False): None, (8, True): None})
    g.prev = torch.arange(16)
    g.variant = None
    g.outputs = {4: torch.zeros(4, 2), 8: torch.arange(16.0).view(8, 2)}
    g.cascade_outputs = {8: torch.arange(16.0).view(8, 2) + 100}
    g.graphs, g.cascade_graphs = {}, {}
    seqs = [_seq(_grammar()) for _ in range(3)]
    lead = Staged(7, 8, False, cascade=True, lead=3)       # 3 sampling rows, then 4 forced rows
    assert lead.sampled == 3 and Staged(7, 8, False).sampled == 7
    assert g.masked_head(lead, seqs)
    assert not g.masked_head(Staged(7, 8, False, lead=2), seqs)
    assert g.masked_ids(lead).tolist() == [0, 1, 2] and ran == [(4, False)]
    assert torch.equal(g.outputs[4], g.cascade_outputs[8][:4])          # the replayed graph's leading rows
    g.masked_ids(Staged(7, 8, False, lead=5))                            # padded(5) = 8: the graph's own head
    g.masked_ids(Staged(3, 4, False))                                    # every row samples
    assert ran[1:] == [(8, False), (4, False)]
    del g.heads.graphs[4, False]
    g.masked_ids(lead)                                                   # no smaller head: its own
    assert ran[-1] == (8, True)


def test_sampling_output_is_the_leading_rows_padded_to_a_graph_size():
    """The LM head of a step whose sampling rows lead reads a view of the graph's first rows, padded to the
    graph batch size of the sampling rows (no gather), never past the graph's own rows."""
    g = _Graphs()
    g.hidden = torch.randn(448, 4)
    out = CudaGraphRunner.sampling_output(g, Staged(414, 448, False, lead=250))
    assert out.shape == (256, 4) and out.data_ptr() == g.hidden.data_ptr()
    assert CudaGraphRunner.sampling_output(g, Staged(300, 300, False, lead=290)).shape == (300, 4)
    assert CudaGraphRunner.sampling_output(g, Staged(5, 8, False)).shape == (8, 4)


def test_deferred_head_logits_of_a_leading_step_cover_its_sampling_rows():
    """Without a greedy fill a deferred step whose sampling rows lead computes its logits over those rows."""
    r = _runner()
    fwd = Forwarded(SimpleNamespace(), [object()] * 3, None, order=1, head=Staged(6, 8, False, lead=3))
    assert r._masked_head(fwd, None) is None
    assert fwd.logits.shape == (3, 6)
    assert torch.equal(fwd.logits, (r.graphs.hidden[:3] @ torch.ones(4, 6)))


@pytest.mark.gpu
def test_masked_heads_same_ids_as_the_sampler(gpu_model_dir):
    """The masked heads' ids equal ``Constraints.masked_argmax`` (the sampler's greedy constrained path) over
    the same hidden rows, for plain and shared-prefix graphs of several sizes, with rows allowing one token,
    many, none (id 0: the grammar refuses it, the request aborts) and all (tail bits past a tokenizer of
    V - 37 ids set, then cleared); the heads' capture memory stays small."""
    import nbgen

    rng = random.Random(3)
    with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=64) as eng:
        runner = eng.loop.runner

        @torch.inference_mode()      # the graphs' static buffers are inference tensors
        def check() -> list[tuple[int, bool]]:
            g, V = runner.graphs, runner.vocab_size
            heads, tok = g.heads, V - 37
            w = -(-tok // 32)
            assert heads is not None
            seen = []
            for cascade, outs in ((False, g.outputs), (True, g.cascade_outputs)):
                for bs in sorted(outs):
                    hidden = outs[bs]
                    hidden.copy_(torch.randn_like(hidden) * 3)
                    host = torch.zeros(bs, w, dtype=torch.int32)
                    one = {}
                    for r in range(bs):
                        kind = r % 4
                        if kind == 0:
                            one[r] = t = rng.randrange(tok)
                            host[r, t // 32] = torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
                        elif kind == 1:
                            host[r] = torch.randint(-2**31, 2**31 - 1, (w,), dtype=torch.int32)
                        elif kind == 3:
                            host[r] = -1
                    host = host.pin_memory()
                    heads.bitmask.copy_in(host, tok)
                    g.masked_ids(Staged(bs, bs, False, cascade=cascade))
                    got = g.prev[:bs].clone()
                    heads.bitmask.mark_read()
                    logits = runner.model.compute_logits(hidden)
                    ref = runner.sampler.constraints.masked_argmax(logits, FillJob(list(range(bs)), host, None, tok, True))
                    assert torch.equal(got, ref), (bs, cascade)
                    assert all(got[r].item() == t for r, t in one.items())
                    assert all(got[r].item() == 0 for r in range(2, bs, 4))
                    assert int(got.max()) < tok
                    seen.append((bs, cascade))
            return seen

        seen = eng.loop.call(check)
        assert any(c for _bs, c in seen) and any(not c for _bs, c in seen), seen
        g = runner.graphs
        bound = g.heads.bitmask.words.numel() * 4 + g.max_bs * runner.vocab_size * 2 + 64 * 2**20
        assert 0 <= g.heads_memory_bytes <= bound, (g.heads_memory_bytes, bound)


@pytest.mark.gpu
@pytest.mark.skipif(not os.environ.get("NBGEN_TEST_GRAMMAR_MODEL"), reason="needs NBGEN_TEST_GRAMMAR_MODEL (+ _TOKENIZER)")
def test_engine_greedy_constrained_steps_same_outputs_with_masked_heads(monkeypatch):
    """Greedy JSON / regex requests (48 rows, plain graphs) under overlap: with the masked heads their steps
    replay the heads' graphs, without them (``masked_head`` off) the sampler's masked argmax runs over the
    steps' logits; the same ids and finish reasons, and completed grammars' rows (scheduled one step ahead)
    change nothing. A prompt-prefix-sharing second batch runs the shared-prefix graphs' masked heads. Both runs
    are overlapped and batched alike, so the same rounding."""
    pytest.importorskip("xgrammar")
    from nbgen.runtime.greedy_heads import GreedyHeads
    from tests.tiny_models import grammar_engine

    schema = json.dumps({"type": "object", "additionalProperties": False, "required": ["name", "n"],
                         "properties": {"name": {"type": "string", "maxLength": 8},
                                        "n": {"type": "integer", "minimum": 0, "maximum": 999}}})
    regexes = [r"\d{3}-\d{4}", r"(Mon|Tues|Fri)day", r"#[0-9a-f]{6}"]
    sps = [{"temperature": 0.0, "max_new_tokens": 12 + i % 9,
            **({"json_schema": schema} if i % 2 else {"regex": regexes[i % 3]})} for i in range(48)]
    replays: list[tuple[int, bool]] = []
    run_masked = GreedyHeads.run_masked

    def spy(self, bs, cascade):
        replays.append((bs, cascade))
        run_masked(self, bs, cascade)

    monkeypatch.setattr(GreedyHeads, "run_masked", spy)
    with grammar_engine(device="cuda", mem_fraction_static=0.4) as eng:
        shared = "Record: " * 400
        prompts = [eng.apply_chat_template([{"role": "user", "content": f"Item {i}"}]) for i in range(48)]
        prompts += [shared + f"item {i}" for i in range(16)]
        sps = sps + sps[:16]

        def run() -> list[tuple]:
            assert eng.flush_cache()
            eng.generate(shared, {"max_new_tokens": 1}, use_tqdm=False)     # the shared prefix cached
            outs = eng.generate(prompts[:48], sps[:48], use_tqdm=False)
            outs += eng.generate(prompts[48:], sps[48:], use_tqdm=False)
            return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs]

        # every grammar compiled first: both runs then admit their requests at once, so their steps match
        eng.generate(prompts[:6], [{**sp, "max_new_tokens": 1} for sp in sps[:6]], use_tqdm=False)
        heads = run()
        assert replays, "no step took the masked head"
        assert any(c for _bs, c in replays) and any(not c for _bs, c in replays), replays
        monkeypatch.setattr(CudaGraphRunner, "masked_head", lambda self, staged, seqs: False)
        n = len(replays)
        plain = run()
        assert len(replays) == n
    assert heads == plain
    assert any(f["type"] == "stop" for _ids, f in heads)
