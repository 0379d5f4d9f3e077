"""The shared-prefix decode attention (kernels/triton_cascade.py: level 0 over each chunk's shared pages,
level 1 = the split-KV decode kernel over the rest with the merge) against nbgen's plain decode
kernel and the fp32 reference, on page tables whose rows share leading pages, with the tables laid
out by runtime/cascade_graphs.py exactly as a graph replay reads them.

CPU: under TRITON_INTERPRET=1 (fp16 queries, small heads; bf16 and e4m3 pages). GPU (``gpu``): bf16
Qwen3-0.6B / Llama-8B heads at W-prefix-like sizes, and e4m3 pages."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nbgen.attention import kv_quant
from nbgen.attention.cascade_plan import plan_shared
from nbgen.attention.base import KVCacheSpec
from tests.test_fp8_kv import reference_decode
from tests.tiny_models import run_under_triton_interpreter

FP8 = torch.float8_e4m3fn


def _shared_tables(rng: random.Random, prefixes: list[int], rows: int, own: tuple[int, int], P: int):
    """Page tables: row i takes prefix i % len(prefixes) (token lengths, whole pages; 0: none) then
    own[0]..own[1] tokens of its own pages; pages scattered over the pool (page 0 unused)."""
    n_pref = [p // P for p in prefixes]
    lens = [prefixes[i % len(prefixes)] + rng.randint(*own) for i in range(rows)]
    own_pages = [-(-n // P) - n_pref[i % len(prefixes)] for i, n in enumerate(lens)]
    total = sum(n_pref) + sum(own_pages)
    perm = iter((np.random.default_rng(rng.randrange(1 << 30)).permutation(total) + 1).tolist())
    pref_pages = [[next(perm) for _ in range(k)] for k in n_pref]
    tables = [pref_pages[i % len(prefixes)] + [next(perm) for _ in range(own_pages[i])] for i in range(rows)]
    indptr = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum([len(t) for t in tables], out=indptr[1:])
    last = np.array([n - (len(t) - 1) * P for n, t in zip(lens, tables)], dtype=np.int32)
    return lens, indptr, np.asarray([p for t in tables for p in t], dtype=np.int32), last, total + 1


def check_cascade(device: str, dtype: torch.dtype, cases: list, fp8: bool, shapes: tuple = ()) -> None:
    """``shapes``: (Level0, Level1) launch shapes checked besides the defaults (None: the default)."""
    from nbgen.kernels.triton_cascade import Level1
    from nbgen.kernels.triton_decode import TritonDecodeWrapper, longest_first
    from nbgen.runtime.cascade_graphs import MAX_CHUNKS, CascadeTables

    dev = torch.device(device)
    for i, (hq, hkv, D, P, prefixes, rows, own) in enumerate(cases):
        rng = random.Random(i)
        lens, ip, idx, last, pages = _shared_tables(rng, prefixes, rows, own, P)
        g = torch.Generator().manual_seed(i)
        kc = (torch.randn(pages, hkv, P, D, generator=g) * 2).to(dtype)
        vc = (torch.randn(pages, hkv, P, D, generator=g) * 2).to(dtype)
        ks, vs = (0.5, 2.0) if fp8 else (1.0, 1.0)
        if fp8:
            kc, vc = kv_quant.store(kc, ks, FP8), kv_quant.store(vc, vs, FP8)
        kc, vc = kc.to(dev), vc.to(dev)
        q = torch.randn(rows, hq, D, generator=g).to(dtype).to(dev)
        spec = KVCacheSpec(1, pages, P, hq, hkv, D, dtype, dev)
        tables = CascadeTables(SimpleNamespace(spec=spec), rows)
        plan = plan_shared(ip, idx, rows, tables.R, MAX_CHUNKS)
        assert plan is not None and plan.chunk_len.sum() >= rows // 2
        region = np.zeros(tables.size, dtype=np.int32)
        tables.fill(region, plan, rows, rows)
        on = [torch.from_numpy(a).to(dev) for a in (ip, idx, last, longest_first(ip, last, P, plan.skip))]
        w = tables.wrapper(torch.from_numpy(region).to(dev), rows, *on)
        plain = TritonDecodeWrapper(hq, hkv, D, P, dev)
        plain.plan(*(torch.from_numpy(a) for a in (ip, idx, last)))
        for _ in range(2):                 # a second replay over the same buffers
            out = w.run(q, (kc, vc), k_scale=ks, v_scale=vs)
        ref = reference_decode(q.cpu(), kc.cpu(), vc.cpu(), torch.from_numpy(ip), torch.from_numpy(idx), lens, ks, vs)
        base = plain.run(q, (kc, vc), k_scale=ks, v_scale=vs).float().cpu()
        tol = 2 ** -7 * ref.abs() + 2e-2 * vs
        err, err_plain = (out.float().cpu() - ref).abs(), (base - ref).abs()
        assert bool((err <= tol).all()), (i, err.max().item(), err_plain.max().item())
        assert err.mean() <= 2 * err_plain.mean() + 1e-4, (i, err.mean().item(), err_plain.mean().item())
        # rows in no chunk: the plain kernel's sums, bit for bit where level 1 runs its launch shape
        alone = torch.from_numpy(plan.chunk < 0)
        default = w.level0, w.level1
        if alone.any():
            w.level1 = Level1()
            same = w.run(q, (kc, vc), k_scale=ks, v_scale=vs).cpu()[alone]
            assert torch.equal(same, plain.run(q, (kc, vc), k_scale=ks, v_scale=vs).cpu()[alone])
            w.level1 = default[1]
        for lv0, lv1 in shapes:       # other launch shapes: the same sums up to float rounding
            w.level0, w.level1 = lv0 or default[0], lv1 or default[1]
            other = w.run(q, (kc, vc), k_scale=ks, v_scale=vs).float().cpu()
            assert bool(((other - ref).abs() <= tol).all()), (i, w.level0, w.level1)
            assert (other - out.float().cpu()).abs().max() <= 2 ** -6 * ref.abs().max(), (i, w.level0, w.level1)
        w.level0, w.level1 = default


CPU_CASES = [
    # hq, hkv, D, P, prefix tokens per group, rows, own tokens
    (4, 2, 16, 4, [40, 64], 6, (1, 9)),
    (6, 2, 32, 4, [300, 0, 24], 9, (2, 20)),       # shared runs over several splits; rows in no chunk
    (4, 4, 16, 8, [96], 5, (1, 8)),                # group 1 (64 rows a tile)
]


def _interpreted() -> None:
    from nbgen.kernels.triton_cascade import Level0, Level1

    shapes = ((Level0(2, 16, 4, 3, ahead=True), Level1(16, 4, 3, 2, ahead=True)),
              (None, Level1(32, 8, 2, 1)))
    check_cascade("cpu", torch.float16, CPU_CASES, fp8=False, shapes=shapes)
    check_cascade("cpu", torch.float16, CPU_CASES[:2], fp8=True)


def test_cascade_kernels_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_cascade_kernel as t; t._interpreted()")
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_cascade_matches_plain_decode(fp8):
    """Qwen3-0.6B heads (16/8) at W-prefix's shape (8 prefixes of 2,000 tokens, 256 rows), Llama-8B heads
    (32/8) with 3 prefixes and rows in no chunk, head size 64 with group 7."""
    cases = [(16, 8, 128, 16, [2000] * 8, 256, (50, 500)),
             (32, 8, 128, 16, [1024, 512, 0], 70, (1, 300)),
             (14, 2, 64, 16, [640, 160], 40, (1, 40))]
    from nbgen.kernels.triton_cascade import Level0, Level1

    shapes = ((Level0(8, 64, 8, 3, ahead=True), Level1(64, 4, 3, None, ahead=True)),
              (Level0(4, 32, 4, 4, ahead=True), Level1(None, 4, None, 1)))
    check_cascade("cuda", torch.bfloat16, cases, fp8, shapes=shapes)
