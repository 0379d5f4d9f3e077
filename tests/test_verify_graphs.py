"""Chain verify steps in CUDA graphs (runtime/verify_graphs.py) and their padded layout
(runtime/verify_layout.py).

CPU: a padded verify step (rows of different draft counts, padding rows) run through the torch backend
with the layout's page tables and write slots gives the real rows the hidden states of the unpadded
step, and changes the KV pool only at the real tokens' slots and on the scratch page.
GPU (``-m gpu``): NGRAM, STANDALONE and EAGLE / EAGLE3 with verify graphs against the same engine with
``disable_cuda_graph=True`` (greedy, bf16: identical up to forks at near-ties, logprobs close), at
batch 1 and in a mixed batch; the graphs are replayed.
"""
from __future__ import annotations

import random

import pytest
import torch

import nbgen
from nbgen.attention.base import KVCacheSpec
from nbgen.attention.torch_backend import TorchAttentionBackend
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.config import EngineConfig
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.models.loader import load_model
from nbgen.runtime.pages import SCRATCH_PAGE
from nbgen.runtime.verify_graphs import VerifyGraphRunner
from nbgen.runtime.verify_layout import VerifyLayout, verify_layout
from tests.tiny_models import assert_close_runs

PAGE = 4


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory) -> str:
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tiny_llama6")), num_hidden_layers=6)


def _seq(rid: str, ids: list[int], start: int, pages: list[int]) -> SeqWork:
    return SeqWork(Request(rid, ids, SamplingParams()), ids[start:], start, pages, True)


def _padded_seqs(lay: VerifyLayout, seqs: list[SeqWork]) -> list[SeqWork]:
    """The layout's rows as seqs for the torch backend (its page tables; write slots: ``lay.slots``)."""
    out = []
    for i in range(lay.bs):
        s = seqs[i] if i < len(seqs) else None
        toks = lay.ids[i * lay.q: (i + 1) * lay.q].tolist()
        req = s.req if s is not None else Request(f"pad{i}", toks, SamplingParams())
        out.append(SeqWork(req, toks, s.start_pos if s is not None else 0, lay.row_pages(i), True))
    return out


class EagerPaddedVerify(VerifyGraphRunner):
    """The verify graphs' interface, with ``run`` executing the padded layout eagerly through the torch
    backend (CPU): the speculative stepper's handling of a padded step, without CUDA."""

    def __init__(self, runner, q: int) -> None:          # noqa: D107 - no capture on the CPU
        self.runner, self.owner, self.q, self.replays = runner, runner.graphs, q, 0
        self.model, self.backend = runner.model, runner.backend
        self.batch_sizes = [1, 2, 4, 8, 16]
        self.max_bs = 16
        self.rows = {"drafts": 0, "none": 0}    # verify rows run, with and without drafts

    def run(self, batch: ScheduledBatch, patch=None) -> tuple[torch.Tensor, list[int]]:
        n, P = len(batch.seqs), batch.page_size
        lay = verify_layout(batch.seqs, self.q, next(b for b in self.batch_sizes if b >= n), P)
        meta = self.backend.prepare(ScheduledBatch(_padded_seqs(lay, batch.seqs), P))
        meta.slot_mapping = torch.as_tensor(lay.slots)
        self.replays += 1
        for s in batch.seqs:
            self.rows["drafts" if s.q_len > 1 else "none"] += 1
        ids = torch.as_tensor(lay.ids).clone()
        if patch is not None:                 # drafts still on the device (runtime/spec_draft_graphs.py)
            patch(ids)
        return self.model(ids, torch.as_tensor(lay.positions), meta), [i * self.q for i in range(n)]


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"])
def test_padded_verify_steps_in_engine(deep_llama_dir, tmp_path, algo):
    """fp32 CPU: an engine whose decode steps all run as padded verify steps (EagerPaddedVerify: rows with
    and without drafts) gives the plain engine's greedy and seeded-sampling outputs and logprobs."""
    from nbgen.models.eagle import save_random_head
    from tests.tiny_models import make_copy_head

    kw: dict = {"speculative_algorithm": algo}
    if algo == "STANDALONE":
        kw.update(speculative_draft_model_path=deep_llama_dir, speculative_num_steps=3)
    elif algo == "EAGLE":
        kw.update(speculative_draft_model_path=make_copy_head(deep_llama_dir, str(tmp_path / "h")),
                  speculative_num_steps=3)
    elif algo == "EAGLE3":
        kw.update(speculative_draft_model_path=save_random_head(deep_llama_dir, str(tmp_path / "h"), True, 200),
                  speculative_num_steps=3)
    else:
        kw["speculative_num_draft_tokens"] = 5
    prompts = [[7] * 12, [9, 9, 9, 3, 3, 3, 3, 9, 9, 9], [40, 41, 42, 43, 44] * 4, [100, 7, 200, 9, 150]]
    sps = [{"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True},
           {"temperature": 0.8, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 11}] * 2
    outs = []
    for spec in (False, True):
        with nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu", random_seed=0, **(kw if spec else {})) as eng:
            if spec:
                stepper = eng.loop._spec
                stepper.verify_graphs = fake = EagerPaddedVerify(stepper.runner, stepper.spec.num_draft_tokens)
            outs.append(eng.generate(input_ids=prompts, sampling_params=sps, return_logprob=True))
    assert [o["output_ids"] for o in outs[0]] == [o["output_ids"] for o in outs[1]]
    for a, b in zip(*outs):          # the verify rows' logits themselves, not only their argmax
        la = [lp for lp, _t, _s in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _t, _s in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
    assert fake.rows["drafts"] > 0 and fake.rows["none"] > 0     # uniform steps: rows without drafts padded too


def _reference_layout(seqs: list[SeqWork], q: int, bs: int, P: int) -> dict[str, list[int]]:
    """verify_layout's rules spelled out row by row."""
    ids, pos, slots, indptr, indices, last = [], [], [], [0], [], []
    for i in range(bs):
        s = seqs[i] if i < len(seqs) else None
        a, toks = (s.start_pos, s.token_ids) if s is not None else (0, [])
        ids += toks + [0] * (q - len(toks))
        pos += list(range(a, a + len(toks))) + [0] * (q - len(toks))
        slots += [s.pages[p // P] * P + p % P for p in range(a, a + len(toks))] + [SCRATCH_PAGE * P] * (q - len(toks))
        real, total = -(-(a + len(toks)) // P), -(-(a + q) // P)
        indices += (s.pages[:real] if s is not None else []) + [SCRATCH_PAGE] * (total - real)
        indptr.append(indptr[-1] + total)
        last.append(a + q - (total - 1) * P)
    return {"ids": ids, "positions": pos, "slots": slots, "kv_indptr": indptr, "kv_indices": indices,
            "last_page_len": last, "qo_indptr": [i * q for i in range(bs + 1)]}


def test_verify_layout_rules():
    rng = random.Random(0)
    for P in (1, 4, 16):
        for _ in range(40):
            n = rng.randint(0, 8)
            bs, q = max(n, 1) + rng.randint(0, 3), rng.randint(2, 6)
            seqs = []
            for i in range(n):
                a, k = rng.randint(0, 40), rng.randint(1, q)
                pages = [rng.randint(1, 999) for _ in range(-(-(a + k) // P) + rng.randint(0, 2))]
                seqs.append(SeqWork(Request(str(i), [1] * (a + k), SamplingParams()),
                                    [rng.randint(0, 99) for _ in range(k)], a, pages, True))
            got, want = verify_layout(seqs, q, bs, P), _reference_layout(seqs, q, bs, P)
            for name, values in want.items():
                assert getattr(got, name).tolist() == values, name


def test_padded_verify_layout_matches_unpadded(tiny_llama_dir):
    loaded = load_model(EngineConfig(model_path=tiny_llama_dir, dtype="float32", device="cpu"), torch.device("cpu"))
    cfg = loaded.hf_config
    spec = KVCacheSpec(num_layers=cfg.num_hidden_layers, num_pages=64, page_size=PAGE,
                       num_q_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=torch.float32,
                       device=torch.device("cpu"))
    backend = TorchAttentionBackend(spec, use_cpu_kernels=False)
    g = torch.Generator().manual_seed(3)
    q, bs = 5, 6
    # (prompt length, verify tokens): full rows, rows ending mid-page and at a page end, one with no drafts
    shapes = [(9, 5), (6, 3), (3, 1), (12, 2), (13, 4)]
    seqs, next_page = [], 1
    for i, (n, k) in enumerate(shapes):
        ids = torch.randint(0, 300, (n + k,), generator=g).tolist()
        pages = list(range(next_page, next_page + -(-(n + k) // PAGE) + 1))   # one spare page, as a draft loan
        next_page += len(pages)
        seqs.append((ids, n, pages))

    def run(batch: ScheduledBatch, ids: list[int], pos: list[int], slots=None) -> torch.Tensor:
        meta = backend.prepare(batch)
        if slots is not None:
            meta.slot_mapping = torch.as_tensor(slots)
        with torch.no_grad():
            return loaded.model(torch.tensor(ids), torch.tensor(pos), meta)

    prefill = ScheduledBatch([_seq(str(i), ids[:n], 0, pages) for i, (ids, n, pages) in enumerate(seqs)], PAGE)
    run(prefill, [t for s in prefill.seqs for t in s.token_ids], [p for s in prefill.seqs for p in range(s.q_len)])
    noise = [torch.randn_like(c) for c in backend.k_cache + backend.v_cache]
    for c, z in zip(backend.k_cache + backend.v_cache, noise):     # stale data past every prompt
        for ids, n, pages in seqs:
            slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(n, len(pages) * PAGE)])
            c[:, slots] = z[:, slots]
    before = [c.clone() for c in backend.k_cache + backend.v_cache]

    verify = ScheduledBatch([_seq(str(i), ids, n, pages) for i, (ids, n, pages) in enumerate(seqs)], PAGE)
    want = run(verify, [t for s in verify.seqs for t in s.token_ids],
               [p for s in verify.seqs for p in range(s.start_pos, s.kv_len)])
    after_plain = [c.clone() for c in backend.k_cache + backend.v_cache]
    for c, b in zip(backend.k_cache + backend.v_cache, before):
        c.copy_(b)

    lay = verify_layout(verify.seqs, q, bs, PAGE)
    padded = _padded_seqs(lay, verify.seqs)
    for i, s in enumerate(padded):
        assert lay.kv_indptr[i + 1] - lay.kv_indptr[i] == -(-(s.start_pos + q) // PAGE)
        assert (lay.kv_indptr[i + 1] - lay.kv_indptr[i] - 1) * PAGE + lay.last_page_len[i] == s.start_pos + q
    got = run(ScheduledBatch(padded, PAGE), lay.ids.tolist(), lay.positions.tolist(), lay.slots)
    rows = [i * q + j for i, s in enumerate(verify.seqs) for j in range(s.q_len)]
    torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-5)
    # the pool: written at the real tokens' slots (as the unpadded step writes them) and on the scratch page only
    real = {pages[p // PAGE] * PAGE + p % PAGE for ids, n, pages in seqs for p in range(n, len(ids))}
    scratch = set(range(SCRATCH_PAGE * PAGE, (SCRATCH_PAGE + 1) * PAGE))
    for c, a, b in zip(backend.k_cache + backend.v_cache, after_plain, before):     # [Hkv, slots, D]
        changed = set((c != b).any(-1).any(0).nonzero().flatten().tolist())
        assert changed - scratch <= real and real <= changed
        idx = torch.tensor(sorted(real))
        torch.testing.assert_close(c[:, idx], a[:, idx], atol=1e-5, rtol=1e-5)


# ---- GPU ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
GREEDY = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(2, 512) for _ in range(rng.choice([8, 21, 40]))] * rng.choice([2, 3]) for _ in range(n)]


def graphs_on_off(model_dir: str, prompts: list[list[int]], **kw) -> tuple[list[dict], list[dict], dict]:
    """(outputs with graphs, outputs with disable_cuda_graph=True, the graph run's stats()) of a bf16 CUDA
    engine with ``kw`` (the speculative settings), greedy with the top-2 logprobs."""
    runs, stats = [], {}
    for off in (False, True):
        with nbgen.Engine(model_dir, device="cuda", dtype="bfloat16", disable_cuda_graph=off, random_seed=0,
                          cuda_graph_max_bs=16, **kw) as eng:
            runs.append(eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                                     top_logprobs_num=2, use_tqdm=False))
            if not off:
                stats = eng.stats()
    return runs[0], runs[1], stats


NEAR_TIE = 0.25   # top-2 logprob gap below which bf16 kernels of different tilings may pick either token


def fork_gaps(a: list[dict], b: list[dict]) -> list[float]:
    """Where two greedy runs fork: the larger of the two runs' top-2 logprob gaps at the fork (each run
    picked its own top token, so a real near-tie shows a small gap in both)."""
    gaps = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x["output_ids"], y["output_ids"])) if p != q), None)
        if n is not None:
            tops = [o["meta_info"]["output_top_logprobs"][n] for o in (x, y)]
            gaps.append(max(t[0][0] - t[1][0] for t in tops))
    return gaps


def _mixed(model_dir: str, **kw) -> None:
    """Batch 1, and a mixed batch of 12 requests of different lengths (prefill chunks share the first
    steps with verify rows: eager; then every step a uniform verify step: graph replays). bf16 through
    different attention kernels (the graph's padded rows against the eager ragged ones): greedy outputs
    identical but for forks at near-ties, logprobs close up to them (tests/tiny_models.assert_close_runs)."""
    for prompts in (_prompts(1), _prompts(12)):
        on, off, stats = graphs_on_off(model_dir, prompts, **kw)
        assert stats.get("spec_verify_graph_steps", 0) > 0, stats
        assert_close_runs(on, off)
        gaps = fork_gaps(on, off)
        assert all(g < NEAR_TIE for g in gaps), gaps
        assert sum(o["meta_info"]["spec_proposed_drafts"] for o in on) > 0


@gpu
def test_verify_graphs_ngram(gpu_model_dir):
    _mixed(gpu_model_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)


@gpu
def test_verify_graphs_standalone(gpu_model_dir):
    _mixed(gpu_model_dir, speculative_algorithm="STANDALONE", speculative_draft_model_path=gpu_model_dir,
           speculative_num_steps=3)


@gpu
@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_verify_graphs_eagle(gpu_model_dir, tmp_path, algo, request):
    from nbgen.models.eagle import save_random_head
    from tests.tiny_models import make_gpu_model

    if algo == "EAGLE3":
        family = request.node.callspec.params["gpu_model_dir"]
        gpu_model_dir = make_gpu_model(family, str(tmp_path / "deep"), layers=6)
    head = save_random_head(gpu_model_dir, str(tmp_path / "head"), algo == "EAGLE3")
    _mixed(gpu_model_dir, speculative_algorithm=algo, speculative_draft_model_path=head, speculative_num_steps=3)
