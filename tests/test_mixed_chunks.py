"""The piecewise graphs' chunk attention (runtime/mixed_chunks.py): what a step stages into the static tables
the captured Triton chunk attention reads (on the CPU, with a plain staging ring), the refusals, and the
captured-form launch (fixed grid, split count 1) under the Triton interpreter over e4m3 pages: chunk rows
after decode rows against the fp32 causal reference, every other row untouched. The backend's routing of
such steps is in tests/test_extend_routing.py; the engine path is its GPU test."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nbgen.attention import kv_quant, prefill_plans
from nbgen.runtime import mixed_chunks, mixed_decode
from nbgen.runtime.pages import SCRATCH_PAGE
from tests.tiny_models import CountingRing, run_under_triton_interpreter

FP8 = torch.float8_e4m3fn
HQ, HKV, D, P = 8, 2, 64, 4          # 4 q heads a kv head: 64-row tiles hold 16 chunk tokens


def _backend(mp: pytest.MonkeyPatch, num_pages: int = 256, caches: tuple = ((), ()), scales: tuple = ()):
    """What MixedChunkRows / MixedDecodeRows read of a flashinfer backend, on the CPU."""
    from nbgen.kernels.triton_decode import TritonDecodeWrapper
    from nbgen.kernels.triton_extend import TritonExtendWrapper

    mp.setattr(mixed_chunks, "StagingRing", CountingRing)
    mp.setattr(mixed_decode, "StagingRing", CountingRing)
    cpu = torch.device("cpu")
    spec = SimpleNamespace(page_size=P, num_pages=num_pages, device=cpu, num_q_heads=HQ, head_dim=D)

    def decode_wrapper(indptr, indices, last, order):
        return TritonDecodeWrapper(HQ, HKV, D, P, cpu, indptr, indices, last, order)

    return SimpleNamespace(spec=spec, make_decode_wrapper=decode_wrapper, k_cache=list(caches[0]),
                           v_cache=list(caches[1]), kv_scales=list(scales),
                           prefill=SimpleNamespace(extend=TritonExtendWrapper(HQ, HKV, D, P, cpu)))


def _chunks(mp: pytest.MonkeyPatch, max_context: int = 256, **kw) -> mixed_chunks.MixedChunkRows:
    pytest.importorskip("triton")
    return mixed_chunks.MixedChunkRows(_backend(mp, **kw), 512, max_context)


def _tab(m: mixed_chunks.MixedChunkRows, B: int, nb: int) -> tuple[list[int], ...]:
    """(qo_indptr [B+2], kv_indptr [B+2], last [B+1], seq [nb], first [nb]) of the static tables."""
    S, t = mixed_chunks.MAX_SEQS, m.tab.tolist()
    seq0 = 3 * S + 5
    return (t[: B + 2], t[S + 2: S + 4 + B], t[2 * S + 4: 2 * S + 5 + B], t[seq0: seq0 + nb],
            t[seq0 + m.blocks: seq0 + m.blocks + nb])


def test_a_steps_chunks_then_the_padding_sequence_and_blocks(monkeypatch) -> None:
    m = _chunks(monkeypatch)
    assert m.tokens == 16 and m.batch == mixed_chunks.MAX_SEQS + 1
    assert m.rows(64) == (64 + 16 * 15) // 16 and m.rows(4) == 4 and m.blocks == m.rows(512) == m.rows(8192)
    # after 3 decode rows: 21 tokens after 30 cached (51 keys: 13 pages, 3 in the last), 9 fresh ones (3 pages)
    qo, kvp, idx, last = [0, 21, 30], [0, 13, 16], list(range(100, 116)), [3, 1]
    assert m.stage(64, 3, qo, kvp, idx, last)
    ip, kp, ls, seq, first = _tab(m, 2, m.rows(64))
    assert ip == [3, 24, 33, 33]                   # the bucket's rows; the padding sequence has none
    assert kp == [0, 13, 16, 17] and ls == [3, 1, 0]
    # blocks longest prefix first: (seq 0, token 16) sees 47 keys, (0, 0) 31, (1, 0) 1; the rest on sequence 2
    assert seq == [0, 0, 1] + [2] * (m.rows(64) - 3)
    assert first == [16, 0, 0] + [0] * (m.rows(64) - 3)
    assert m.indices[:17].tolist() == idx + [SCRATCH_PAGE]
    assert m.staged == 1


def test_idle_puts_every_block_on_the_padding_sequence_once(monkeypatch) -> None:
    m = _chunks(monkeypatch)
    ring = CountingRing.made[-1]
    handed = ring.handed                         # the constructor staged the padding-only tables
    m.idle()
    assert ring.handed == handed              # nothing staged since: nothing to clear
    assert m.stage(512, 0, [0, 40], [0, 10], list(range(1, 11)), [4])
    m.idle()
    ip, kp, ls, seq, first = _tab(m, 0, m.blocks)
    assert ip == [0, 0] and kp == [0, 1] and ls == [0]
    assert seq == [0] * m.blocks and first == [0] * m.blocks
    assert m.indices[0].item() == SCRATCH_PAGE
    m.idle()
    assert ring.handed == handed + 2 and m.staged == 1


@pytest.mark.parametrize("what", ["sequences", "pages", "tokens", "bucket"])
def test_chunks_that_do_not_fit_are_refused_and_nothing_is_staged(monkeypatch, what) -> None:
    m = _chunks(monkeypatch, num_pages=8, max_context=64)     # cap: min(16 * 17, 2 * 8 + 16) + 1 = 33 pages
    assert m.cap == 33
    before = m.tab.clone(), m.indices.clone()
    S = mixed_chunks.MAX_SEQS
    if what == "sequences":                                   # 17 one-page chunks of 2 tokens
        n = S + 1
        args = (64, 0, list(range(0, 2 * n + 1, 2)), list(range(n + 1)), [1] * n, [2] * n)
    elif what == "pages":                                     # 33 pages and the scratch page: 34
        args = (512, 0, [0, 4], [0, 33], list(range(33)), [4])
    elif what == "tokens":                                    # one token past EXTEND_MAX_TOKENS
        n = prefill_plans.EXTEND_MAX_TOKENS + 1
        args = (1024, 0, [0, n], [0, 1], [1], [4])
    else:                                                     # 2 decode rows + 31 chunk rows in a bucket of 32
        args = (32, 2, [0, 31], [0, 8], list(range(8)), [3])
    assert not m.stage(*args)
    assert torch.equal(m.tab, before[0]) and torch.equal(m.indices, before[1]) and m.staged == 0


def _interpreted() -> None:
    """A bucket of 48 rows: 3 decode rows, then chunks of 21 (after 30 cached), 9 and 3 (after 13) tokens
    over a layer's e4m3 pages (scales 0.5 / 2), then padding rows; q rows strided as in the fused qkv buffer.
    The captured form alone writes the chunk rows (equal to the fp32 causal reference) and nothing else;
    after the decode rows' kernel, as in a piece, both row sets equal the reference; ``idle`` stores
    nothing; a second step at another bucket re-stages."""
    from tests.test_triton_extend import _tables, reference_extend

    mp = pytest.MonkeyPatch()
    ks, vs = 0.5, 2.0
    for step, (T, decodes, chunks) in enumerate(((48, [37, 20, 6], [(30, 21), (0, 9), (13, 3)]),
                                                 (32, [9], [(70, 17)]))):
        seqs = [(n - 1, 1) for n in decodes] + chunks
        lens, qo, ip, idx, last, pages = _tables(np.random.default_rng(step), seqs, P)
        g = torch.Generator().manual_seed(step)
        k8 = kv_quant.store(torch.randn(pages, HKV, P, D, generator=g) * 2, ks, FP8)
        v8 = kv_quant.store(torch.randn(pages, HKV, P, D, generator=g) * 2, vs, FP8)
        be = _backend(mp, num_pages=pages, caches=([k8], [v8]), scales=[(ks, vs)])
        m = mixed_chunks.MixedChunkRows(be, 512, 512)
        dec = mixed_decode.MixedDecodeRows(be, 512, 512)
        d, n = len(decodes), qo[-1]
        c = ip[d]
        assert m.stage(T, d, [x - qo[d] for x in qo[d:]], (ip[d:] - c).tolist(), idx[c: ip[-1]].tolist(),
                       last[d:].tolist())
        assert dec.stage(T, ip[: d + 1], idx[:c], last[:d])
        qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g).half()
        q = qkv[:, : HQ * D]
        ref = reference_extend(q[:n].view(n, HQ, D), k8, v8, qo, ip, idx, lens, ks, vs)
        tol = 2 ** -7 * ref.abs() + 2e-2 * vs
        out = torch.full((T, HQ * D), float("nan"), dtype=torch.float16)
        m.attend(0, T, q, out)                                   # the captured form alone
        o = out.view(T, HQ, D).float()
        assert bool(o[:d].isnan().all()) and bool(o[n:].isnan().all()), step
        err = (o[d:n] - ref[d:]).abs()
        assert bool((err <= tol[d:]).all()), (step, err.max().item())
        out.fill_(float("nan"))
        dec.attend(0, q[: dec.rows(T)], out[: dec.rows(T)])      # as a piece ends: decode rows, then chunks
        m.attend(0, T, q, out)
        err = (out[:n].view(n, HQ, D).float() - ref).abs()
        assert bool((err <= tol).all()), (step, err.max().item())
        m.idle()
        out.fill_(float("nan"))
        m.attend(0, T, q, out)
        assert bool(out.isnan().all()), step
    mp.undo()


def test_captured_chunk_attention_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_mixed_chunks as t; t._interpreted()")
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_model_dir", ["llama"], indirect=True)
def test_gpu_chunks_attended_inside_the_piecewise_graphs(gpu_model_dir, monkeypatch):
    """An fp8-KV engine through mixed steps (chunked prefill beside running decodes), its chunks attended
    inside the piecewise graphs, against the same engine with every step's chunks refused (the eager Triton
    chunk attention). The captured form runs one split, the eager one the planned split count, so sums
    differ in the last bits: teacher-forced prompt logprobs close (a wrong table shows at once as large
    errors on most positions); free-running tokens close up to near-tie forks, with and without overlap."""
    import random
    import statistics

    import nbgen
    from tests.tiny_models import GREEDY_SP, assert_close_prompt_logprobs, assert_close_runs

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 40, 300, 700, 90, 1000, 17, 260)]
    kw = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, chunked_prefill_size=128,
              kv_cache_dtype="fp8_e4m3")

    def run() -> tuple[list[dict], list[dict], list[list[int]], int, int]:
        with nbgen.Engine(gpu_model_dir, **kw) as eng:
            assert eng.get_server_info()["piecewise_cuda_graph_tokens"]
            tf = eng.generate(input_ids=prompts, sampling_params={**GREEDY_SP, "max_new_tokens": 4},
                              return_logprob=True, logprob_start_len=0, use_tqdm=False)
            eng.flush_cache()
            out = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, use_tqdm=False)
            eng.flush_cache()
            overlap = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False)  # overlap path
            pieces = eng.loop.runner.prefill_graphs
            return tf, out, [o["output_ids"] for o in overlap], pieces.chunks.staged, pieces.whole_replays

    tf_on, on, on_overlap, staged, whole = run()
    assert staged >= 10 and whole == staged, (staged, whole)    # every staged step on its bucket's one graph
    monkeypatch.setattr(mixed_chunks, "MAX_SEQS", 0)          # no step fits: its chunks run eagerly
    tf_off, off, off_overlap, none, whole = run()
    assert none == 0 and whole == 0
    assert_close_prompt_logprobs(tf_on, tf_off, prompts, "captured vs eager chunks")
    assert_close_runs(on, off)
    # the overlap path: where each sequence first differs (a broken table forks nearly every one at once)
    forks = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(on_overlap, off_overlap)]
    print(f"overlap path, first differing token per sequence: {forks}")
    assert sum(f >= 1 for f in forks) >= 0.85 * len(forks) and statistics.mean(forks) >= 8, forks


def test_whole_step_graphs_only_where_a_staged_step_can_land() -> None:
    """A bucket gets its pieces as one graph only where a staged step fits: decode rows (at most the decode
    kernel's rows) plus chunk tokens (at most the chunk attention's) above the bucket below."""
    from types import SimpleNamespace

    from nbgen.runtime.prefill_graphs import PrefillGraphRunner

    r = PrefillGraphRunner.__new__(PrefillGraphRunner)
    r.buckets = [32, 64, 128, 256, 384, 512, 768, 1024, 1280]
    r.decodes = SimpleNamespace(max_rows=256)
    r.chunks = SimpleNamespace(max_chunk_tokens=512)
    assert r._whole_buckets() == {32, 64, 128, 256, 384, 512, 768}
    r.chunks = SimpleNamespace(max_chunk_tokens=128)       # 256 + 128 = 384 tokens at most: the 384 bucket
    assert r._whole_buckets() == {32, 64, 128, 256, 384}
    r.chunks = None
    assert r._whole_buckets() == set()
