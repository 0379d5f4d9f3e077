"""The piecewise graphs' decode rows (runtime/mixed_decode.py): what a step stages into the static page
tables the captured Triton decode kernel reads (on the CPU, with a plain staging ring), and the kernel's
attention over them with the padding rows under the Triton interpreter; the engine paths are GPU tests
(tests/test_gpu.py: piecewise graphs against eager steps, mixed steps split or whole)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import nbgen
from nbgen.kernels.triton_decode import TritonDecodeWrapper
from nbgen.runtime import mixed_decode
from nbgen.runtime.pages import SCRATCH_PAGE
from tests.tiny_models import GREEDY_SP, CountingRing, gpu_generate, run_under_triton_interpreter


def _rows(monkeypatch, num_pages: int = 64, max_context: int = 256, hq: int = 8, hkv: int = 2, D: int = 64,
          P: int = 16, **backend) -> mixed_decode.MixedDecodeRows:
    monkeypatch.setattr(mixed_decode, "StagingRing", CountingRing)
    spec = SimpleNamespace(page_size=P, num_pages=num_pages, device=torch.device("cpu"), num_q_heads=hq, head_dim=D)

    def wrapper(indptr, indices, last, order):
        return TritonDecodeWrapper(hq, hkv, D, P, torch.device("cpu"), indptr, indices, last, order)

    be = SimpleNamespace(spec=spec, make_decode_wrapper=wrapper, **backend)
    return mixed_decode.MixedDecodeRows(be, 512, max_context)


def _tables(m: mixed_decode.MixedDecodeRows, B: int) -> tuple[list[int], ...]:
    w = m.wrapper
    return (w.indptr[: B + 1].tolist(), w.last[:B].tolist(), w.order[:B].tolist())


def test_a_steps_decode_rows_then_padding_rows_on_the_scratch_page(monkeypatch) -> None:
    m = _rows(monkeypatch)
    assert m.rows(8) == 8 and m.rows(4096) == mixed_decode.MAX_ROWS
    # three decode rows of 21, 16 and 33 tokens (2, 1 and 3 pages)
    indptr, indices = np.array([0, 2, 3, 6], np.int32), np.array([10, 11, 20, 30, 31, 32], np.int32)
    last = np.array([5, 16, 1], np.int32)
    assert m.stage(8, indptr, indices, last)
    ip, ls, order = _tables(m, 8)
    assert ip == [0, 2, 3, 6, 7, 8, 9, 10, 11]
    assert ls == [5, 16, 1, 1, 1, 1, 1, 1]
    assert order == [2, 0, 1, 3, 4, 5, 6, 7]            # longest first, then the padding rows
    assert m.wrapper.indices[:11].tolist() == [10, 11, 20, 30, 31, 32] + [SCRATCH_PAGE] * 5
    assert m.staged == 1


def test_a_step_without_decode_rows_stages_padding_only(monkeypatch) -> None:
    m = _rows(monkeypatch)
    assert m.stage(4, np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
    assert _tables(m, 4) == ([0, 1, 2, 3, 4], [1, 1, 1, 1], [0, 1, 2, 3])
    assert m.staged == 0                                  # padding only: not a step the graphs attended


def test_idle_puts_every_bucket_back_on_its_own_scratch_rows(monkeypatch) -> None:
    """After a staged step of a large bucket, a step at a smaller bucket without staged decode rows must not
    read the large step's row order (rows past its own bucket): idle() restages all rows as padding, once."""
    m = _rows(monkeypatch)
    ring = CountingRing.made[-1]                         # m's ring
    start = ring.handed
    # 40 decode rows at bucket 64, the longest last: longest-first order starts with row 39
    lens = np.ones(40, np.int32)
    lens[39] = 3
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert m.stage(64, indptr, np.arange(indptr[-1], dtype=np.int32) % 60, np.full(40, 16, np.int32))
    assert _tables(m, 8)[2][0] == 39                     # bucket 8 would read row 39's tables
    m.idle()
    for B in (8, 64, mixed_decode.MAX_ROWS):
        ip, ls, order = _tables(m, B)
        assert order == list(range(B)) and ip == list(range(B + 1)) and ls == [1] * B
    assert m.wrapper.indices[: mixed_decode.MAX_ROWS].tolist() == [SCRATCH_PAGE] * mixed_decode.MAX_ROWS
    assert ring.handed - start == 2                 # the step's tables, then the idle ones
    m.idle()                                             # already idle: nothing queued
    assert ring.handed - start == 2


@pytest.mark.parametrize("what", ["rows", "pages"])
def test_decode_rows_that_do_not_fit_are_refused_and_nothing_is_staged(monkeypatch, what) -> None:
    m = _rows(monkeypatch, num_pages=8, max_context=64)     # cap: min(256 * 5, 2 * 8 + 256) = 272 pages
    before = m.wrapper.indptr.clone(), m.wrapper.indices.clone()
    if what == "rows":                                       # 5 rows at bucket 4
        indptr, indices, last = np.arange(6, dtype=np.int32), np.arange(5, dtype=np.int32), np.ones(5, np.int32)
        assert not m.stage(4, indptr, indices, last)
    else:                                                    # 2 rows holding 271 pages: 271 + 254 padding > 272
        indptr = np.array([0, 200, 271], np.int32)
        assert not m.stage(256, indptr, np.zeros(271, np.int32), np.ones(2, np.int32))
    assert torch.equal(m.wrapper.indptr, before[0]) and torch.equal(m.wrapper.indices, before[1])
    assert m.staged == 0


def _interpreted() -> None:
    """A bucket of 12 rows: 3 decode rows of a layer's e4m3 pages (scales 0.5 / 2) and 9 other rows (prompt
    tokens and padding, on the scratch page); q rows strided as in the fused qkv buffer. The decode rows
    equal the fp32 attention of their dequantized pages; a second step with other rows re-stages."""
    import pytest as _pytest

    from nbgen.attention import kv_quant
    from tests.test_fp8_kv import _paged, reference_decode

    mp = _pytest.MonkeyPatch()
    hq, hkv, D, P, T = 4, 2, 32, 4, 12
    for step, lens in enumerate(([5, 17, 40], [9, 2])):
        kc, vc, indptr, indices, last = _paged(lens, hkv, D, P, torch.float16, "cpu", seed=step)
        k8, v8 = kv_quant.store(kc, 0.5, kv_quant.FP8), kv_quant.store(vc, 2.0, kv_quant.FP8)
        m = _rows(mp, num_pages=kc.shape[0], hq=hq, hkv=hkv, D=D, P=P,
                  k_cache=[k8], v_cache=[v8], kv_scales=[(0.5, 2.0)])
        assert m.stage(T, indptr.numpy(), indices.numpy(), last.numpy())
        qkv = torch.randn(T, (hq + 2 * hkv) * D).half()
        out = torch.zeros(T, hq * D).half()
        m.attend(0, qkv[:, : hq * D], out)             # q: a strided view, as the pieces pass it
        d = len(lens)
        ref = reference_decode(qkv[:d, : hq * D].view(d, hq, D), k8, v8, indptr, indices, lens, 0.5, 2.0)
        err = (out[:d].view(d, hq, D).float() - ref).abs()
        assert bool((err <= 2 ** -7 * ref.abs() + 4e-2).all()), (step, err.max().item())
        assert torch.isfinite(out).all()                 # the other rows read the scratch page
    mp.undo()


def test_staged_decode_rows_attend_their_pages_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_mixed_decode as t; t._interpreted()")
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_a_prefill_after_staged_decode_rows_reads_its_own_rows(gpu_model_dir) -> None:
    """48 decoding requests beside a long prompt's chunks: mixed steps stage 48 decode rows longest first.
    A later prefill step alone (bucket 32, nothing staged) must give its captured kernel rows 0..31 in order
    on the scratch page, not the first 32 of the last staged order (rows past its bucket): such a step
    faulted on the GPU. Its output must equal the same prompt's on a fresh engine."""
    rng = random.Random(5)
    short = [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 60))] for _ in range(48)]
    long = [rng.randrange(2, 512) for _ in range(1500)]
    late = [[rng.randrange(2, 512) for _ in range(20)]]
    with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", chunked_prefill_size=256) as eng:
        eng.generate(input_ids=short + [long], sampling_params={**GREEDY_SP, "max_new_tokens": 64}, use_tqdm=False)
        dec = eng.loop.runner.prefill_graphs.decodes
        assert dec.staged > 0
        after = eng.generate(input_ids=late, sampling_params=GREEDY_SP, use_tqdm=False)
        B = dec.rows(32)
        assert dec.wrapper.order[:B].tolist() == list(range(B))
        assert dec.wrapper.indptr[: B + 1].tolist() == list(range(B + 1))
        assert set(dec.wrapper.indices[:B].tolist()) == {SCRATCH_PAGE}
    assert after[0]["output_ids"] == gpu_generate(gpu_model_dir, late)[0]["output_ids"]
