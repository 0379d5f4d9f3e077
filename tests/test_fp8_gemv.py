"""The fp8 GEMV (kernels/fp8_gemv.py) against the torch reference (models/fp8_linear.reference_matmul):
under TRITON_INTERPRET=1 on the CPU for 1-16 rows, ragged N and K, bias, bf16 / fp16 / fp32 outputs, the
residual-add epilogue, both split-K reductions; on CUDA (marked gpu) with x rounded in the kernel from
arbitrary values, and a CUDA-graph replay equal to the eager call."""
from __future__ import annotations

import pytest
import torch

from nbgen.bench import fp8_kernels
from nbgen.kernels import fp8_gemv
from nbgen.kernels.fp8_gemv import GemvConfig
from nbgen.models.fp8_linear import Fp8Weight, fp8_linear, quantize_groups, reference_matmul
from tests.tiny_models import run_under_triton_interpreter


def test_split_for_fills_the_sms() -> None:
    assert fp8_gemv.split_for(256, 8, 0, 132) == 1              # waves 0: never split
    assert fp8_gemv.split_for(1792, 8, 4, 132) == 1             # gate|up's tiles alone fill the SMs
    assert fp8_gemv.split_for(256, 8, 4, 132) == 3              # 768 >= 4 * 132 programs
    assert fp8_gemv.split_for(256, 2, 4, 132) == 2              # at most one step per program


def test_sweep_grid_and_pasteable_winners() -> None:
    for rows in (1, 2, 4, 8):
        for quick in (False, True):
            cfgs = fp8_kernels.gemv_variants(rows, quick)
            assert len(set(cfgs)) == len(cfgs) and any(c.waves == 0 for c in cfgs) and any(c.waves for c in cfgs)
            for c in cfgs:   # 16-byte vectors, accumulators that fit in registers
                b = fp8_kernels.tile_bytes(c.block_n, c.groups, c.num_warps)
                assert 16 <= b <= 64 and rows * b <= fp8_kernels.MAX_ACC, c
    assert fp8_kernels.gemv_variants(16, False) == []     # 16 rows: no tile fits, the tile kernel's table
    a, b = fp8_kernels.gemv_variants(1, True)[:2]
    totals = {1: {str(a): [3.0, 4.0], str(b): [2.0, 4.0], "None": [9.0, 9.0]},
              4: {str(a): [5.0, 5.0], str(b): [1.0]}, 16: {"None": [7.0, 8.0]}}
    table = fp8_kernels.winners_table(totals, {1: 12.0, 4: 20.0, 16: 15.0}, 2)
    # b ran only one shape at 4 rows
    assert eval(table.replace("CONFIGS = ", ""), {"GemvConfig": GemvConfig}) == {1: b, 4: a, 16: None}
    assert "2.00x bf16" in table


def _grid_x(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """x [m, k] whose per-group rounding to e4m3 is exact (values on the grid, a 448 in every group,
    power-of-2 scales): the interpreter's float -> e4m3 cast can drop a rounding carry, so under it the
    kernel's own rounding of x is checked where no rounding happens (arbitrary x: the GPU test)."""
    q = (torch.randn(m, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    q[:, ::128] = 448.0
    s = 2.0 ** torch.randint(-8, 2, (m, -(-k // 128))).float()
    return (q * s.repeat_interleave(128, 1)[:, :k]).to(dtype)


def _check(m: int, n: int, k: int, cfg: GemvConfig, x_dtype: torch.dtype, out_dtype: torch.dtype,
           bias: bool, accumulate: bool) -> None:
    x = _grid_x(m, k, x_dtype)
    w = torch.randn(n, k)
    b = torch.randn(n).to(x_dtype) if bias else None
    fw = Fp8Weight(*quantize_groups(w))
    want = reference_matmul(*quantize_groups(x), fw, b, torch.float32)
    into = None
    if accumulate:
        into = torch.randn(m, n).to(out_dtype)
        want = want + into.float()
    got = fp8_gemv.fp8_gemv(x, fw.q, fw.scale, b, out_dtype, cfg, accumulate=into)
    assert got.dtype == out_dtype and got.shape == (m, n)
    if accumulate:
        assert got.data_ptr() == into.data_ptr()
    # fp32 sums in another order, then one rounding to out_dtype
    tol = want.abs().max() * (1e-5 if out_dtype == torch.float32 else 2 ** -7)
    assert (got.float() - want.to(out_dtype).float()).abs().max() <= tol, (m, n, k, cfg, out_dtype)


def _kernel_check() -> None:
    """Run under TRITON_INTERPRET=1 (see the test below)."""
    torch.manual_seed(0)
    no_split = GemvConfig(16, 2, 0, "last", 4, 1)
    last = GemvConfig(8, 1, 64, "last", 4, 1)           # 40 / 8 tiles, split over all 3 groups
    atomic = GemvConfig(32, 1, 64, "atomic", 4, 1)      # 37 / 32 tiles, split over both groups of K 200
    assert fp8_gemv.split_for(5, 3, 64, 132) == 3 and fp8_gemv.split_for(2, 2, 64, 132) == 2
    for m in (1, 2, 3, 4, 7, 8, 9, 16):                  # row counts around each BLOCK_M, the split kernel
        _check(m, 40, 300, last, torch.float32, torch.float32, m % 2 == 1, False)
    for m in (1, 5, 16):
        _check(m, 37, 200, no_split, torch.bfloat16, torch.bfloat16, True, False)
        _check(m, 37, 200, atomic, torch.float16, torch.float16, True, False)
        _check(m, 40, 300, last, torch.bfloat16, torch.bfloat16, False, True)
        _check(m, 40, 300, no_split, torch.float16, torch.float16, True, True)
        _check(m, 37, 200, atomic, torch.bfloat16, torch.bfloat16, True, True)   # adds with "last"
    for m, cfg in fp8_gemv.CONFIGS.items():              # the table's launch shapes
        if cfg is not None:
            _check(m, 50, 520, cfg, torch.bfloat16, torch.bfloat16, True, False)


def test_fp8_gemv_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_fp8_gemv as t; t._kernel_check()")
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 13, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (200, 576), (37, 300)])
def test_gpu_fp8_gemv_equals_the_reference(m: int, n: int, k: int) -> None:
    torch.manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda")
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    fw = Fp8Weight(*quantize_groups(w))
    want = reference_matmul(*quantize_groups(x), fw, b, torch.float32)
    cfgs = [c for c in fp8_kernels.gemv_variants(m, True) if c.waves == 0 or c.block_n == 16]
    cfgs += [GemvConfig(8, 2, 8, "atomic", 4, 1)] + ([fp8_gemv.pick_config(m)] if fp8_gemv.pick_config(m) else [])
    for cfg in cfgs:
        got = fp8_gemv.fp8_gemv(x, fw.q, fw.scale, b, torch.bfloat16, cfg).float()
        assert (got - want).abs().max() <= 2 ** -7 * want.abs().max(), cfg
    # fp32 out: only the summation order differs from the reference; one x value rounded to another
    # e4m3 neighbour than torch rounds it would move y by ~3e-4 of its largest value
    got32 = fp8_gemv.fp8_gemv(x, fw.q, fw.scale, b, torch.float32, cfgs[0])
    assert (got32 - want).abs().max() <= 5e-5 * want.abs().max()
    into = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    want_acc = (want + into.float()).bfloat16().float()
    fp8_gemv.fp8_gemv(x, fw.q, fw.scale, b, torch.bfloat16, cfgs[0], accumulate=into)
    assert (into.float() - want_acc).abs().max() <= 2 ** -6 * want_acc.abs().max()
    assert fp8_gemv.usable(x) == (fp8_gemv.pick_config(m) is not None)
    graph_x = x.clone()
    fp8_linear(graph_x, fw, b)                             # compile before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fp8_linear(graph_x, fw, b)
    for _ in range(3):                                     # the split counters re-arm between replays
        g.replay()
        assert torch.equal(out, fp8_linear(x, fw, b))
