"""The LoRA slot kernels (``kernels/lora_sgmv.py``) at several tilings against ``lora_reference``,
under TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen when Triton loads).

Covered: 1 / 2 / 3 shards; shard bounds a column block straddles and bounds it never straddles
(the expand computes only the shards a block touches); empty slots and base rows; segments that
are not a multiple of BM; column groups of several blocks (the last one ragged); a shrink split over
K (atomic sums) and a shrink in one K block (stores); the baseline that computes every shard; fp32
and fp16 (the interpreter's tl.dot misreads bf16 operands, so bf16 runs in
``test_lora_kernels.py``'s GPU test, at every tiling of the sweep's baseline and the tables).
"""
from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch

from tests.tiny_models import run_under_triton_interpreter


def _segments(slot: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """perm / seg_start / seg_len of rows assigned to slots (-1: a base row)."""
    order = torch.argsort(slot, stable=True)
    perm = order[slot[order] >= 0].int()
    counts = torch.bincount(slot[slot >= 0], minlength=S).int()
    return (perm if perm.numel() else torch.zeros(1, dtype=torch.int32)), (torch.cumsum(counts, 0) - counts).int(), counts


def _cases(device: str = "cpu", dtypes: tuple = ((torch.float32, 1e-4), (torch.float16, 1e-2)),
           expand_cfgs: Optional[list] = None) -> None:
    from nbgen.kernels.lora_sgmv import lora_reference, lora_sgmv
    from nbgen.kernels.lora_sgmv_configs import ExpandConfig, ShrinkConfig

    expand_cfgs = expand_cfgs or [ExpandConfig(),                     # BN 64, one block per program
                                  ExpandConfig(bm=32, bn=32, niter=3),  # groups of 3 blocks, ragged at the end
                                  ExpandConfig(bm=64, bn=16, niter=2),
                                  ExpandConfig(bn=32, all_shards=True)]  # the baseline: every shard, select
    shrink_cfgs = [ShrinkConfig(ksplit=64, bk=32), ShrinkConfig(bm=32, ksplit=1024)]   # split K | one K block
    g = torch.Generator().manual_seed(0)
    # (T, K, shard sizes, R, S): bounds 48 / 88 straddle 32-column blocks, 64 / 96 never do at BN <= 32;
    # segments of 1..40 rows (not multiples of BM); slot 2 of the first case has no row
    cases = ((40, 96, [48, 40], 8, 4), (23, 64, [64, 32, 32], 16, 3), (30, 80, [48, 40, 24], 4, 3),
             (9, 72, [80], 8, 2), (1, 64, [32, 16, 16], 8, 2))
    for dtype, tol in dtypes:
        for i, (T, K, sizes, R, S) in enumerate(cases):
            nshard, N = len(sizes), sum(sizes)
            bounds = (sizes[0] if nshard > 1 else N, sizes[0] + sizes[1] if nshard > 2 else N)
            x = torch.randn(T, K, generator=g).to(device, dtype)
            a = (torch.randn(S, nshard * R, K, generator=g) * 0.1).to(device, dtype)
            b = (torch.randn(S, N, R, generator=g) * 0.3).to(device, dtype)
            sc = (torch.rand(S, generator=g) * 2 + 0.5).to(device)
            slot = torch.randint(-1, S, (T,), generator=g)
            if i == 0:
                slot[slot == 2] = 3                                      # an empty slot between full ones
            perm, start, counts = (v.to(device) for v in _segments(slot, S))
            slot = slot.to(device)
            y = torch.randn(T, N, generator=g).to(device, dtype)
            want = y.clone()
            lora_reference(x, want, a, b, sc, perm, start, counts, bounds, nshard)
            assert (want.float() - y.float()).abs().max() > 0.1 or not (slot >= 0).any()   # the adapters add something
            for j, ec in enumerate(expand_cfgs):
                got = y.clone()
                lora_sgmv(x, got, a, b, sc, perm, start, counts, bounds, nshard,
                          shrink_cfg=shrink_cfgs[j % 2], expand_cfg=ec)
                err = (got.float() - want.float()).abs().max().item()
                assert err <= tol * max(1.0, want.float().abs().max().item()), (dtype, i, ec, err)
                assert torch.equal(got[slot < 0], y[slot < 0])              # base rows untouched
    print("SGMV_CONFIGS_OK")


def test_sgmv_configs_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_lora_sgmv_configs as t; t._cases()")
    assert "SGMV_CONFIGS_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_tables_cover_every_bucket() -> None:
    """Every (rows, width) bucket has a config; BN / BM are tl.dot-sized powers of two."""
    pytest.importorskip("triton")
    from nbgen.kernels import lora_sgmv_configs as k

    assert [k.rows_bucket(r) for r in (1, k.SMALL_ROWS, k.SMALL_ROWS + 1, k.LARGE_ROWS, k.LARGE_ROWS + 1)] == \
        ["small", "small", "large", "large", "prefill"]
    assert {rb for rb, _ in k.SHRINK_TABLE} == {rb for rb, _ in k.EXPAND_TABLE} == {"small", "large", "prefill"}
    for rows in (1, k.SMALL_ROWS, k.SMALL_ROWS + 1, 4096):
        for width in (896, k.WIDE_N - 1, k.WIDE_N, 28672):
            e, s = k.expand_config(rows, width), k.shrink_config(rows, width)
            for v in (e.bm, e.bn, s.bm, s.bk):
                assert v >= 16 and v & (v - 1) == 0
            assert e.niter >= 1 and s.ksplit % s.bk == 0 and not e.all_shards


def _sweep_smoke() -> None:
    """The GPU sweep's code path end to end on tiny shapes (fp16, interpreter; a fake timer): every
    candidate passes the reference check, and the winners come out in the tables' syntax."""
    import time

    from nbgen.bench import lora_kernels as lk
    from nbgen.kernels import lora_sgmv_configs as k

    k.WIDE_N, k.DEEP_K, k.SMALL_ROWS = 96, 128, 16
    lk.SHAPES = {"qkv": (64, [32, 16, 16]), "o": (64, [32]), "gate_up": (64, [64, 64]), "down": (128, [32])}
    lk.EXPAND_GRID = {"bm": (16,), "bn": (32, 64), "niter": (1, 2)}
    lk.SHRINK_GRID = {"bm": (16,), "bk": (32,), "ksplit": (64, 16384)}
    lk.LAUNCH_GRID = {"warps": (4,), "stages": (1, 2)}
    lk.TOP = 1

    def cpu_us(fn: "Callable[[], None]") -> float:
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)
    lk.us_per_call = cpu_us
    res = lk.kernel_times((40, 8, 12), slots=3, rank=8, sweep=True, shapes=tuple(lk.SHAPES), device="cpu",
                          dtype=torch.float16)          # 8 and 12 rows: one "small" bucket, swept together
    assert all("best_shrink" in r and "best_expand" in r for res_rows in res["rows"].values()
               for r in res_rows.values())
    assert set(res["best"]) == {f"{kind}:{rb}:{w}" for rb in ("small", "large")
                                for kind, ws in (("shrink", ("narrow", "deep")), ("expand", ("narrow", "wide")))
                                for w in ws}
    print("SWEEP_SMOKE_OK")


def test_kernel_sweep_smoke_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_lora_sgmv_configs as t; t._sweep_smoke()")
    out = res.stdout
    assert "SWEEP_SMOKE_OK" in out and "WRONG" not in out, out[-3000:] + res.stderr[-3000:]
    assert "EXPAND_TABLE winners" in out and "('large', 'wide'): ExpandConfig(" in out, out[-3000:]
    assert "('gate_up', 8), ('gate_up', 12)" in out, out[-3000:]          # the small bucket's sweep saw both


@pytest.mark.gpu
def test_gpu_sgmv_configs_bf16() -> None:
    """bf16 on CUDA: the cases above at every tiling the sweep may pick (BM x BN x niter), the tables'
    configs and the first kernel's."""
    import itertools

    from nbgen.bench.lora_kernels import EXPAND_GRID
    from nbgen.kernels.lora_sgmv_configs import EXPAND_TABLE, ExpandConfig

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfgs = [ExpandConfig(bm=bm, bn=bn, niter=it) for bm, bn, it in itertools.product(*EXPAND_GRID.values())]
    cfgs += list(EXPAND_TABLE.values()) + [ExpandConfig(all_shards=True)]
    _cases("cuda", ((torch.bfloat16, 3e-2),), cfgs)


@pytest.mark.parametrize("make, name", [
    (lambda k: k.ExpandConfig(bn=48), "bn"), (lambda k: k.ExpandConfig(bm=8), "bm"),
    (lambda k: k.ExpandConfig(niter=0), "niter"), (lambda k: k.ShrinkConfig(bk=96), "bk"),
    (lambda k: k.ShrinkConfig(ksplit=96), "ksplit")])
def test_invalid_configs_name_the_parameter(make: Callable, name: str) -> None:
    from nbgen.kernels import lora_sgmv_configs as k

    with pytest.raises(ValueError, match=name):
        make(k)


def test_bench_lora_cases_put_the_main_engine_first():
    """``bench.lora --cases``: the --lora x --lora-rank engine first, then each listed one once."""
    import argparse

    from nbgen.bench.lora import lora_cases

    args = argparse.Namespace(lora=8, lora_rank=16, cases="8x8,8X64,8x16,1x16")
    assert lora_cases(args) == [(8, 16), (8, 8), (8, 64), (1, 16)]
    assert lora_cases(argparse.Namespace(lora=2, lora_rank=4, cases=None)) == [(2, 4)]
