"""Which wrapper a step's prompt chunks are planned on (attention/prefill_plans.py) and what the flashinfer
backend's forward runs for them, without flashinfer: stand-in flashinfer wrappers record their plans; nbgen's
Triton decode and chunk attention wrappers are the real ones on the CPU (their kernels under the Triton
interpreter). e4m3 pages with causal chunks of at most EXTEND_MAX_TOKENS tokens -> the Triton chunk
attention; model-dtype pages, a draft tree or more tokens -> flashinfer; the leading decode rows keep the
Triton decode kernel or the piecewise graphs. GPU (``gpu``): the engine through mixed steps over e4m3 pages
against the same engine with the Triton chunk attention off."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nbgen.attention import kv_quant, prefill_plans
from nbgen.attention.base import KVCacheSpec
from nbgen.attention.flashinfer_backend import FlashInferBackend, FlashInferMetadata
from nbgen.attention.page_tables import DecodeTables, page_tables
from nbgen.attention.prefill_plans import PlanFence, PrefillPlans, extend_wrapper
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from tests.test_triton_extend import reference_extend
from tests.tiny_models import assert_close_runs, gpu_generate, run_under_triton_interpreter

FP8 = torch.float8_e4m3fn
HQ, HKV, D, P, PAGES = 8, 2, 64, 4, 256
gpu = pytest.mark.gpu


class _Recorder:
    """A flashinfer prefill wrapper stand-in: records its plans."""

    def __init__(self) -> None:
        self.plans: list[tuple] = []

    def plan(self, qo: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last: torch.Tensor,
             *a: object, **kw: object) -> None:
        self.plans.append((qo.tolist(), kw.get("causal"), "custom_mask" in kw))


def _backend(fp8: bool, scales: tuple[float, float] = (1.0, 1.0)) -> FlashInferBackend:
    """The backend's planning and forward state on the CPU: what ``prepare`` / ``forward`` read."""
    pytest.importorskip("triton")
    from nbgen.kernels.triton_decode import TritonDecodeWrapper

    cpu = torch.device("cpu")
    spec = KVCacheSpec(2, PAGES, P, HQ, HKV, D, torch.float16, cpu, kv_dtype=FP8 if fp8 else None,
                       k_scale=scales[0], v_scale=scales[1])
    be = FlashInferBackend.__new__(FlashInferBackend)
    be.spec, be.scale, be.triton_decode = spec, D ** -0.5, True
    be.k_cache = [torch.zeros(PAGES, HKV, P, D, dtype=spec.cache_dtype) for _ in range(2)]
    be.v_cache = [torch.zeros(PAGES, HKV, P, D, dtype=spec.cache_dtype) for _ in range(2)]
    be.kv_scales = [spec.scales(i) for i in range(2)]
    be._fi_scales = [{}, {}]
    be._tx_scales = [{"k_scale": ks, "v_scale": vs} for ks, vs in be.kv_scales]
    be.triton_wrapper = TritonDecodeWrapper(HQ, HKV, D, P, cpu)
    be.tables = DecodeTables(P)
    be.fence = PlanFence(cpu)
    plans = be.prefill = PrefillPlans.__new__(PrefillPlans)
    plans.spec, plans.fence, plans.ready = spec, be.fence, lambda: True
    plans.causal, plans.masked, plans.standin = _Recorder(), _Recorder(), _Recorder()
    plans.extend = extend_wrapper(spec, True)
    return be


def _batch(decodes: list[int], chunks: list[tuple[int, int]], tree: bool = False) -> ScheduledBatch:
    """Decode rows (cached tokens each) first, then chunks (cached, tokens); pages 1.. in order."""
    seqs, nxt = [], 1
    for i, (cached, n) in enumerate([(c, 1) for c in decodes] + chunks):
        k = -(-(cached + n) // P)
        pages, nxt = list(range(nxt, nxt + k)), nxt + k
        req = Request(str(i), [3] * max(cached + n, 1), SamplingParams())
        parents = list(range(-1, n - 1)) if tree and i >= len(decodes) else None
        seqs.append(SeqWork(req, [3] * n, cached, pages, True, tree_parents=parents))
    assert nxt <= PAGES
    return ScheduledBatch(seqs, P)


def _planned(be: FlashInferBackend, batch: ScheduledBatch, stage: bool = False) -> FlashInferMetadata:
    """``prepare`` of the step; ``stage``: the piecewise graphs take its decode rows."""
    return be.prepare(batch, slot_mapping=torch.zeros(batch.num_tokens, dtype=torch.long),
                      decode_stage=(lambda *t: True) if stage else None)


def test_small_e4m3_chunks_take_the_triton_chunk_attention() -> None:
    be = _backend(fp8=True)
    plans = be.prefill
    meta = _planned(be, _batch([40, 17], [(100, 60), (0, 9)]))
    assert meta.wrapper is plans.extend and plans.owns(meta.wrapper)
    assert meta.decode_rows == 2 and not meta.decodes_staged
    assert be.triton_wrapper.indptr[:3].tolist() == [0, 11, 16]          # the decode rows' own tables
    assert plans.extend.rows == 69 and plans.extend.batch == 2
    assert plans.extend.tab[:3].tolist() == [0, 60, 69]
    meta = _planned(be, _batch([40, 17], [(100, 60)]), stage=True)      # decode rows in the piecewise graphs
    assert meta.wrapper is plans.extend and meta.decode_rows == 2 and meta.decodes_staged
    meta = _planned(be, _batch([], [(100, prefill_plans.EXTEND_MAX_TOKENS - 100), (0, 100)]))  # no decodes, 512
    assert meta.wrapper is plans.extend and meta.decode_rows == 0
    plans.ready = lambda: False                       # flashinfer's prefill module still building
    assert _planned(be, _batch([40], [(100, 60)])).wrapper is plans.extend
    assert not (plans.causal.plans or plans.masked.plans or plans.standin.plans)


def test_other_steps_keep_flashinfer() -> None:
    be = _backend(fp8=True)
    plans = be.prefill
    meta = _planned(be, _batch([40], [(0, prefill_plans.EXTEND_MAX_TOKENS + 1)]))    # more tokens
    assert meta.wrapper is plans.causal and meta.decode_rows == 1
    assert plans.causal.plans == [([0, prefill_plans.EXTEND_MAX_TOKENS + 1], True, False)]
    meta = _planned(be, _batch([40], [(100, 5)], tree=True))                         # a draft tree
    assert meta.wrapper is plans.masked and plans.masked.plans[-1][2]
    plans.ready = lambda: False
    meta = _planned(be, _batch([], [(0, 600)]))
    assert meta.wrapper is plans.standin
    bf16 = _backend(fp8=False)                                                       # model-dtype pages
    assert bf16.prefill.extend is None
    assert _planned(bf16, _batch([40], [(100, 60)])).wrapper is bf16.prefill.causal
    assert plans.extend.planned is None                  # none of these steps planned the chunk attention


def test_extend_wrapper_only_for_e4m3_pages_and_the_triton_decode_kernel() -> None:
    pytest.importorskip("triton")
    cpu = torch.device("cpu")
    fp8 = KVCacheSpec(1, 8, P, HQ, HKV, D, torch.bfloat16, cpu, kv_dtype=FP8)
    assert extend_wrapper(fp8, True) is not None
    assert extend_wrapper(fp8, False) is None
    assert extend_wrapper(KVCacheSpec(1, 8, P, HQ, HKV, D, torch.bfloat16, cpu), True) is None
    assert extend_wrapper(KVCacheSpec(1, 8, P, 6, 2, 96, torch.bfloat16, cpu, kv_dtype=FP8), True) is None


def _staging(be: FlashInferBackend, batch: ScheduledBatch, decodes: bool,
             takes: bool) -> tuple[FlashInferMetadata, list]:
    """``prepare`` with the piecewise graphs' stages: decode rows taken when ``decodes``, chunks when ``takes``;
    -> (metadata, the chunk stage's calls)."""
    calls: list[tuple] = []

    def chunk_stage(*t: object) -> bool:
        calls.append(t)
        return takes

    meta = be.prepare(batch, slot_mapping=torch.zeros(batch.num_tokens, dtype=torch.long),
                      decode_stage=lambda *t: decodes, chunk_stage=chunk_stage)
    return meta, calls


def _launches(monkeypatch) -> list[str]:
    """Record (and skip) every kernel launch the backend's forward can make."""
    from nbgen.attention import flashinfer_backend
    from nbgen.kernels.triton_decode import TritonDecodeWrapper
    from nbgen.kernels.triton_extend import TritonExtendWrapper

    got: list[str] = []
    monkeypatch.setattr(TritonExtendWrapper, "launch", lambda self, *a, **kw: got.append("chunks"))
    monkeypatch.setattr(TritonDecodeWrapper, "run", lambda self, *a, **kw: got.append("decodes"))
    monkeypatch.setattr(flashinfer_backend, "write_kv", lambda *a, **kw: got.append("kv"))
    return got


def test_a_staged_step_is_attended_whole_by_the_graphs_and_its_forward_launches_nothing(monkeypatch) -> None:
    be = _backend(fp8=True)
    got = _launches(monkeypatch)
    batch = _batch([40, 17], [(100, 60), (0, 9)])
    meta, calls = _staging(be, batch, decodes=True, takes=True)
    assert meta.chunks_staged and meta.decodes_staged and meta.wrapper is be.prefill.extend
    assert be.prefill.extend.planned is None                       # no eager plan of the chunks
    assert calls == [(2, *page_tables(batch.seqs[2:], P))]          # d, the chunks' qo, kv_indptr, indices, last
    q = torch.randn(batch.num_tokens, HQ * D).half()
    out = torch.full_like(q, float("nan"))
    assert be.forward(0, q, q, q, meta, kv_written=True, out=out) is out
    assert got == [] and bool(out.isnan().all())
    with pytest.raises(ValueError, match="out="):
        be.forward(0, q, q, q, meta, kv_written=True)
    meta, calls = _staging(be, _batch([], [(100, 60)]), decodes=False, takes=True)   # no decode rows: d = 0
    assert meta.chunks_staged and calls[0][0] == 0 and calls[0][1] == [0, 60]


def test_steps_the_graphs_do_not_take_whole_run_eagerly(monkeypatch) -> None:
    be = _backend(fp8=True)
    got = _launches(monkeypatch)
    batch = _batch([40, 17], [(100, 60), (0, 9)])
    q = torch.randn(batch.num_tokens, HQ * D).half()
    meta, calls = _staging(be, batch, decodes=True, takes=False)                # the chunk tables do not fit
    assert len(calls) == 1 and not meta.chunks_staged and be.prefill.extend.planned is not None
    be.forward(0, q, q, q, meta, kv_written=True, out=torch.empty_like(q))
    assert got == ["chunks"]                                       # the decode rows are the graphs'
    got.clear()
    meta, calls = _staging(be, batch, decodes=False, takes=True)                # decode rows eager: chunks too
    assert not calls and not meta.chunks_staged
    be.forward(0, q, q, q, meta, kv_written=True, out=torch.empty_like(q))
    assert got == ["decodes", "chunks"]
    for b in (_batch([40], [(100, 5)], tree=True), _batch([40], [(0, prefill_plans.EXTEND_MAX_TOKENS + 1)])):
        meta, calls = _staging(be, b, decodes=True, takes=True)                 # a tree; more tokens
        assert not calls and not meta.chunks_staged and meta.wrapper is not be.prefill.extend
    bf16 = _backend(fp8=False)
    meta, calls = _staging(bf16, batch, decodes=True, takes=True)               # model-dtype pages
    assert not calls and not meta.chunks_staged and meta.wrapper is bf16.prefill.causal


def _interpreted() -> None:
    """A mixed step over e4m3 pages through the backend's prepare + forward (decode rows on the Triton
    decode kernel, chunks on the Triton chunk attention) against the fp32 causal reference."""
    ks, vs = 0.5, 2.0
    be = _backend(fp8=True, scales=(ks, vs))
    batch = _batch([37, 20, 6], [(30, 21), (0, 9), (13, 3)])
    meta = _planned(be, batch)
    assert meta.wrapper is be.prefill.extend and meta.decode_rows == 3
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        kc = kv_quant.store(torch.randn(PAGES, HKV, P, D, generator=g) * 2, ks, FP8)
        vc = kv_quant.store(torch.randn(PAGES, HKV, P, D, generator=g) * 2, vs, FP8)
        be.k_cache[layer].copy_(kc)
        be.v_cache[layer].copy_(vc)
        qkv = torch.randn(batch.num_tokens, (HQ + 2 * HKV) * D, generator=g).half()
        q = qkv[:, : HQ * D]                                   # a strided view of the fused projection
        out = torch.full((batch.num_tokens, HQ * D), float("nan"), dtype=torch.float16)
        o = be.forward(layer, q, None, None, meta, kv_written=True, out=out)
        assert o.data_ptr() == out.data_ptr()
        qo, kv_ptr, idx, _last = page_tables(batch.seqs, P)
        ref = reference_extend(q.view(-1, HQ, D), kc, vc, qo, np.array(kv_ptr), np.array(idx, dtype=np.int64),
                               [s.kv_len for s in batch.seqs], ks, vs)
        err = (o.view(-1, HQ, D).float() - ref).abs()
        assert bool((err <= 2 ** -7 * ref.abs() + 2e-2 * vs).all()), (layer, err.max().item())
    # the decode rows staged in the piecewise graphs: forward leaves their rows alone, the chunks' rows again
    staged = _planned(be, batch, stage=True)
    assert staged.wrapper is be.prefill.extend and staged.decodes_staged
    out.fill_(float("nan"))
    be.forward(1, q, None, None, staged, kv_written=True, out=out)
    assert bool(out[:3].isnan().all())
    err = (out[3:].view(-1, HQ, D).float() - ref[3:]).abs()
    assert bool((err <= 2 ** -7 * ref[3:].abs() + 2e-2 * vs).all()), err.max().item()


def test_mixed_step_forward_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_extend_routing as t; t._interpreted()")
    assert res.returncode == 0, res.stderr[-3000:]


@gpu
@pytest.mark.parametrize("gpu_model_dir", ["llama"], indirect=True)
def test_gpu_mixed_steps_on_the_chunk_attention(gpu_model_dir, monkeypatch):
    """An fp8-KV engine through mixed steps (chunked prefill beside running decodes): the tokens and
    logprobs of the Triton chunk attention against flashinfer's prefill of the same steps."""
    from nbgen.kernels.triton_extend import TritonExtendWrapper
    from nbgen.runtime.mixed_chunks import MixedChunkRows

    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 40, 300, 700, 90, 1000)]
    runs = []
    plan, stage = TritonExtendWrapper.plan, MixedChunkRows.stage

    def spy(self, *a, **kw):
        runs.append(1)
        return plan(self, *a, **kw)

    def stage_spy(self, *a, **kw):     # the steps the piecewise graphs attend whole
        took = stage(self, *a, **kw)
        runs.extend([1] * took)
        return took

    monkeypatch.setattr(TritonExtendWrapper, "plan", spy)
    monkeypatch.setattr(MixedChunkRows, "stage", stage_spy)
    triton = gpu_generate(gpu_model_dir, prompts, logprobs=True, chunked_prefill_size=128,
                          kv_cache_dtype="fp8_e4m3")
    assert len(runs) >= 5, runs                     # steps on the chunk attention (eager or in the graphs)
    monkeypatch.setattr(prefill_plans, "EXTEND_MAX_TOKENS", 0)
    runs.clear()
    flashinfer = gpu_generate(gpu_model_dir, prompts, logprobs=True, chunked_prefill_size=128,
                              kv_cache_dtype="fp8_e4m3")
    assert not runs
    assert_close_runs(triton, flashinfer)
