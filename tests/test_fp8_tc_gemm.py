"""The per-feature fp8 GEMM on tensor cores (kernels/fp8_tc_gemm.py) and the quantizers fused into the
kernels before it (a folded norm's column scale in ``quant_rowwise``; ``silu_mul_scaled_quant``): under
TRITON_INTERPRET=1 against the torch reference, and (marked gpu) on CUDA: the reference's tolerance for
every launch shape of the table, the residual-add epilogue, the fused quantizers' bytes equal to the
unfused launches', a folded fp8 MLP equal to its unfused sequence, in and out of a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from nbgen.kernels import fp8_quant, fp8_tc_gemm
from nbgen.kernels.silu_scaled import silu_mul_scaled, silu_mul_scaled_quant
from nbgen.models.fp8_scaled import (quantize_activation, quantize_weight, reference_matmul, scaled_accumulate,
                                     scaled_folded_mlp, scaled_linear)
from tests.tiny_models import run_under_triton_interpreter


def _one_step(got: torch.Tensor, want: torch.Tensor, share: float = 0.9) -> bool:
    """e4m3 values mostly equal, the others one rounding step off (the interpreter's fp32 -> e4m3 cast
    rounds some ties away from even and may lose a carry into the next power of two; exact bytes are
    checked on the GPU)."""
    g, w = got.float(), want.float()
    near = ((g - w).abs() <= w.abs() / 8 + 2 ** -9) | (g == w / 2)
    return bool(near.all()) and (g == w).float().mean() > share


def _interpreter_check() -> None:
    """Run under TRITON_INTERPRET=1 (see the module docstring)."""
    torch.manual_seed(0)
    for m, n, k, bk in ((5, 40, 64, 32), (33, 70, 96, 64), (17, 16, 256, 64)):
        x = torch.randn(m, k) * 3
        w = quantize_weight(torch.randn(n, k))
        xq, sa = quantize_activation(x)
        b = torch.randn(n)
        want = reference_matmul(xq, sa, w, b, torch.float32)
        for bm, bn in ((16, 32), (32, 16)):
            cfg = fp8_tc_gemm.TcConfig(bm, bn, bk, 4, 1, group_m=2)
            got = fp8_tc_gemm.fp8_tc_gemm(xq, sa, w.q, w.scale_row, b, torch.float32, cfg=cfg)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            y0 = torch.randn(m, n)
            y = fp8_tc_gemm.fp8_tc_gemm(xq, sa, w.q, w.scale_row, b, out=y0.clone(), accumulate=True, cfg=cfg)
            torch.testing.assert_close(y, y0 + want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for m, k in ((3, 2100), (fp8_quant.ONE_PROGRAM_ROWS + 4, 300)):     # a program per block / per row
        x = torch.randn(m, k, dtype=torch.bfloat16) * 5
        g = (torch.rand(k) + 0.5).to(torch.bfloat16)
        xq, sa = quantize_activation(x.float() * g.float())
        q2, s2 = fp8_quant.quant_rowwise(x, g)
        assert torch.equal(s2, sa) and _one_step(q2, xq), (m, k)
    for t in (3, 260):      # a program per block / per row
        h = torch.randn(t, 64, dtype=torch.bfloat16)
        gu = torch.randn(t, 2 * 600, dtype=torch.bfloat16) * 4
        r = torch.rsqrt(h.float().pow(2).sum(-1, keepdim=True) / 64 + 1e-5)
        gate, up = ((gu.float() * r).to(torch.bfloat16).float()).chunk(2, dim=-1)
        act = (gate / (1 + torch.exp(-gate)) * up).to(torch.bfloat16)     # the kernel's formula in torch
        q, s = silu_mul_scaled_quant(gu, h, 1e-5)
        # the interpreter rounds to bf16 and e4m3 its own way (exact bytes are checked on the GPU): the
        # row scales within a few bf16 steps of act's, the values within an e4m3 step (or a lost carry)
        want_s = act.float().abs().amax(1, keepdim=True) / 448
        torch.testing.assert_close(s, want_s, rtol=2 ** -5, atol=0)
        got, want = q.float() * s, act.float()
        near = ((got - want).abs() <= want.abs() / 8 + s * 2 ** -6) | ((got - want / 2).abs() <= want.abs() / 16)
        assert bool(near.all()) and ((got - want).abs() <= want.abs() / 16 + s * 2 ** -6).float().mean() > 0.9, t


def test_tc_gemm_and_fused_quantizers_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_fp8_tc_gemm as t; t._interpreter_check()")
    assert res.returncode == 0, res.stderr[-3000:]


def _within_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 output within its rounding of the fp32 reference (plus the GEMM's summation order)."""
    got = got.float()
    return bool(((got - want).abs() <= 2 ** -7 * want.abs() + 1e-3 * want.abs().max()).all())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 64, 200, 300, 1000])
@pytest.mark.parametrize("n,k", [(1536, 4096), (208, 576), (4096, 14336)])
def test_gpu_tc_gemm_equals_the_reference(m: int, n: int, k: int) -> None:
    torch.manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = quantize_weight(torch.randn(n, k, device="cuda"))
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    xq, sa = fp8_quant.quant_rowwise(x)
    want = reference_matmul(xq, sa, w, b, torch.float32)
    for cfg in set(fp8_tc_gemm.CONFIGS.values()):
        assert _within_bf16(fp8_tc_gemm.fp8_tc_gemm(xq, sa, w.q, w.scale_row, b, cfg=cfg), want), cfg
    y0 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    into = y0.clone()
    assert scaled_accumulate(x, w, into)                   # the residual add in the GEMM's epilogue
    assert torch.equal(into, y0 + scaled_linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [17, 64, 300])
def test_gpu_fused_quantizers_match_the_separate_launches(t: int) -> None:
    torch.manual_seed(t)
    h = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    g = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
    xq, sa = quantize_activation(h.float() * g.float())          # the torch reference's bytes
    q, s = fp8_quant.quant_rowwise(h, g)
    assert torch.equal(s, sa) and torch.equal(q.view(torch.uint8), xq.view(torch.uint8))
    gu = torch.randn(t, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 3
    want_q, want_s = fp8_quant.quant_rowwise(silu_mul_scaled(gu, h, 1e-5))
    q, s = silu_mul_scaled_quant(gu, h, 1e-5)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [17, 300])
def test_gpu_folded_mlp_equals_its_unfused_sequence(t: int) -> None:
    torch.manual_seed(t)
    hid, inter = 1024, 2816
    gate_up = quantize_weight(torch.randn(2 * inter, hid, device="cuda") / 30)
    gate_up.col_scale = (torch.rand(hid, device="cuda") + 0.5).to(torch.bfloat16)
    down = quantize_weight(torch.randn(hid, inter, device="cuda") / 50)
    h = torch.randn(t, hid, device="cuda", dtype=torch.bfloat16)
    want = h + scaled_linear(silu_mul_scaled(scaled_linear(h, gate_up), h, 1e-5), down)
    got = h.clone()
    assert scaled_folded_mlp(got, gate_up, down, 1e-5)
    assert torch.equal(got, want)
    static = h.clone()
    scaled_folded_mlp(static.clone(), gate_up, down, 1e-5)     # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scaled_folded_mlp(static, gate_up, down, 1e-5)
    graph.replay()
    assert torch.equal(static, want)
