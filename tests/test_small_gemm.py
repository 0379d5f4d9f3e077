"""Decode-size matmul kernels (nbgen.kernels.small_gemm, CUDA only): against fp32 references and, end to
end, against the cuBLAS + separate SiLU path on random models."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import assert_close_runs, gpu_generate, gpu_prompts

gpu = pytest.mark.gpu
ULP = 2.0 ** -8          # bf16 relative rounding step (8 significant bits)


def _within_rounding(y: torch.Tensor, ref: torch.Tensor, ulps: float = 1.0) -> None:
    """y (bf16) is ref (fp32, exact up to summation order) rounded once: |y - ref| <= ulps * ULP * |ref|,
    plus a tiny absolute slack for fp32 summation-order noise near zero."""
    err = (y.float() - ref).abs()
    bound = ulps * ULP * ref.abs() + 1e-5 * ref.abs().max()
    assert bool((err <= bound).all()), (err - bound).max().item()


@gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 24, 32])
@pytest.mark.parametrize("N,K,bias", [(6144, 4096, False), (1000, 1000, True), (4096, 14336, False)])
def test_small_gemm_is_one_rounding_of_the_exact_product(M, N, K, bias):
    from nbgen.kernels import small_gemm as sg

    g = torch.Generator(device="cuda").manual_seed(M * N)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    b = torch.randn(N, device="cuda", generator=g).bfloat16() if bias else None
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    y = sg.small_gemm(x, w, b)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    _within_rounding(y, ref)
    # cuBLAS rounds the same exact value: nearly every element is bit-identical
    same = (y == F.linear(x, w, b)).float().mean().item()
    assert same > 0.95, same


@gpu
@pytest.mark.parametrize("M", [1, 3, 8, 32])
def test_silu_mul_epilogue(M):
    from nbgen.kernels import small_gemm as sg

    g = torch.Generator(device="cuda").manual_seed(7)
    N, K = 2 * 1536, 1024
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()
    gate_up = F.linear(x.float(), w.float()).bfloat16().float()   # unfused path: matmul output in bf16
    ref = F.silu(gate_up[:, : N // 2]) * gate_up[:, N // 2:]
    y = sg.small_gemm(x, w, silu_mul=True)
    assert y.shape == (M, N // 2)
    # gate/up may round differently from cuBLAS's (one ulp) before the activation
    _within_rounding(y, ref, ulps=4.0)
    assert (y == ref.bfloat16()).float().mean().item() > 0.9


@gpu
def test_pdl_launch_gives_the_same_bits(monkeypatch):
    """Programmatic dependent launch only changes when programs start, never what they compute."""
    from nbgen.kernels import small_gemm as sg
    from nbgen.kernels import pdl

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(6144, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    assert pdl.enabled(x.device) == (torch.cuda.get_device_capability()[0] >= 9)
    with_pdl = sg.small_gemm(sg.small_gemm(x, w)[:, :4096].contiguous(), w)   # a dependent chain
    monkeypatch.setattr(pdl, "_ok", {x.device.index or 0: False})          # plain launches (pre-Hopper)
    assert not pdl.enabled(x.device)
    plain = sg.small_gemm(sg.small_gemm(x, w)[:, :4096].contiguous(), w)
    assert torch.equal(with_pdl, plain)


@gpu
def test_engine_small_gemm_path_matches_cublas_path(gpu_model_dir, monkeypatch):
    """Decode through the streaming kernel (batch <= MAX_ROWS, in graphs) agrees with the cuBLAS +
    flashinfer SiLU path on the same random weights."""
    from nbgen.kernels import small_gemm as sg

    prompts = gpu_prompts(12)                        # batch 12 shrinking: graphs of 16, 8, 4, 2, 1 rows
    fused = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    monkeypatch.setattr(sg, "MAX_ROWS", 0)
    plain = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    assert_close_runs(fused, plain)


class _FakeKernel:
    """Stands in for a Triton kernel: records launches, raises ``fault`` on PDL launches."""

    def __init__(self, fault: Exception) -> None:
        self.fault, self.calls = fault, []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append(kw.get("USE_PDL"))
            if kw.get("launch_pdl"):
                raise self.fault
        return run


@pytest.mark.parametrize("fault,pdl_stays_on", [
    (type("OutOfResources", (Exception,), {})("out of resource: shared memory"), True),
    (TypeError("launch_pdl is not a launch option"), False),
])
def test_pdl_fallback_only_for_pdl_refusals(monkeypatch, fault, pdl_stays_on):
    """A kernel config over the SM's limits raises as it is and leaves PDL on for every other kernel; a
    Triton that refuses the PDL launch itself switches PDL off and the kernel runs once, plainly."""
    from nbgen.kernels import pdl

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_ok", {0: True})            # as if enabled on a Hopper
    k = _FakeKernel(fault)
    if pdl_stays_on:
        with pytest.raises(type(fault)):
            pdl.launch(k, (1,), (), dev)
        assert k.calls == [True] and pdl.enabled(dev)
    else:
        pdl.launch(k, (1,), (), dev)
        assert k.calls == [True, False] and not pdl.enabled(dev)
