"""FP8 linears with one scale per output feature or per tensor (models/fp8_scaled.py): the reference
arithmetic against float64, the activation-scale rule, fp8 checkpoints loading into the forms their
scales allow, the quantize / output-scale Triton kernels (kernels/fp8_quant.py) under TRITON_INTERPRET=1.
GPU tests (marked gpu) compare cuBLAS's fp8 GEMM path with the reference (into a buffer, the residual add, a
folded norm's column scale in the quantizer), in and out of CUDA graphs."""
from __future__ import annotations

import pytest
import torch

import nbgen
from nbgen.core.config import EngineConfig
from nbgen.kernels import fp8_quant
from nbgen.models.fp8_linear import Fp8Weight, fp8_linear, quantize_linears
from nbgen.models.loader import load_model
from nbgen.models.fp8_scaled import (TENSORWISE_MAX_ROWS, Fp8ScaledWeight, quantize_activation, quantize_weight,
                                     reference_matmul, scaled_accumulate, scaled_linear, search_channel_scales)
from tests.tiny_models import (assert_close_runs, gpu_generate, gpu_prompts, make_tiny_model,
                               run_under_triton_interpreter)

F8 = torch.float8_e4m3fn


def _float64(x: torch.Tensor, w: Fp8ScaledWeight, b: torch.Tensor) -> torch.Tensor:
    """The recipe in float64 from first principles: amax scales per token, e4m3 rounding, exact products."""
    xd = x.double()
    amax = xd.abs().amax(1, keepdim=True)
    sa = (amax.float().clamp(min=1e-10) / 448).double()
    xq = (xd / sa).clamp(-448, 448).float().to(F8).double()
    return (xq * sa) @ (w.q.double() * w.scale_row.double().t()).t() + b.double()


def test_reference_matmul_equals_float64() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.logspace(-2, 1, 48)[:, None]     # features of very different sizes
    x, b = torch.randn(5, 256) * 3, torch.randn(48)
    fw = quantize_weight(w)
    assert fw.q.dtype == F8 and fw.scale_row.shape == (1, 48) and fw.scale is None
    xq, sa = quantize_activation(x)
    assert sa.shape == (5, 1)
    got = reference_matmul(xq, sa, fw, b, torch.float32).double()
    want = _float64(x, fw, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # quantized, and within e4m3's error of the float product
    y = scaled_linear(x, fw, b)
    exact = x @ w.t() + b
    assert 0 < (y - exact).norm() / exact.norm() < 0.05


def test_searched_channel_scales_beat_amax_and_round_trip() -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 512)
    s = search_channel_scales(w)
    amax = w.abs().amax(1) / 448
    assert ((s >= amax * (1 - 1e-6)) & (s < 2 * amax)).all()          # none clips, within one octave
    err = lambda sc: ((w / sc[:, None]).to(F8).float() * sc[:, None] - w).square().sum(1)   # noqa: E731
    assert (err(s) <= err(amax) * (1 + 1e-6)).all() and err(s).sum() < 0.97 * err(amax).sum()
    fw = quantize_weight(w)
    again = quantize_weight((fw.q.float() * fw.scale_row.t()).bfloat16(), fw.scale_row[0])  # a checkpoint's
    assert torch.equal(again.q.view(torch.uint8), fw.q.view(torch.uint8))
    one = quantize_weight(w, torch.tensor(0.01))                       # one scale: the tensorwise form
    assert one.scale is not None and float(one.scale) == pytest.approx(0.01) and one.scale_row.shape == (1, 64)


def test_activation_scales_per_token_keep_rows_independent() -> None:
    # a row's output does not depend on the other rows of its step (a large row leaves a small one
    # alone), one weight scale or one per feature, below and above TENSORWISE_MAX_ROWS rows
    torch.manual_seed(2)
    for w in (quantize_weight(torch.randn(32, 128), torch.tensor(0.005)), quantize_weight(torch.randn(32, 128))):
        for m in (2, TENSORWISE_MAX_ROWS + 1):
            x = torch.randn(m, 128)
            x[0] *= 1000
            y = scaled_linear(x, w)
            alone = torch.cat([scaled_linear(x[i:i + 1], w) for i in range(1, m)])
            torch.testing.assert_close(y[1:], alone, rtol=1e-5, atol=1e-5)    # fp32 summation order only
            xq, sa = quantize_activation(x)
            assert torch.equal(y, reference_matmul(xq, sa, w, None, torch.float32))


def test_quantize_linears_forms(tmp_path) -> None:
    # bf16 weights: the per-feature form; checkpoint scales constant along a row: per feature (one
    # value: tensorwise); scales varying along the columns (block-wise): the 1x128 group form
    path = make_tiny_model("llama", str(tmp_path / "m"), intermediate_size=384)      # down_proj: 3 groups
    model = load_model(EngineConfig(model_path=path, dtype="float32"), torch.device("cpu")).model
    layer = model.model.layers[0]
    down, o_proj, qkv = layer.mlp.down_proj, layer.self_attn.o_proj, layer.self_attn.qkv_proj
    n, k = down.weight.shape
    w_down = down.weight.data.clone()
    scales = {"model.layers.0.self_attn.qkv_proj": torch.full((qkv.weight.shape[0], 1), 0.01),
              "model.layers.0.self_attn.o_proj": torch.rand(o_proj.weight.shape[0], 1) + 0.01,
              "model.layers.0.mlp.down_proj": torch.rand(n, 3) * 0.01 + 0.001}
    assert quantize_linears(model, scales) == 4 * len(model.model.layers)
    assert isinstance(qkv.fp8, Fp8ScaledWeight) and float(qkv.fp8.scale) == pytest.approx(0.01)
    assert isinstance(o_proj.fp8, Fp8ScaledWeight) and o_proj.fp8.scale is None
    assert isinstance(layer.mlp.gate_up_proj.fp8, Fp8ScaledWeight) and layer.mlp.gate_up_proj.fp8.scale is None
    assert isinstance(down.fp8, Fp8Weight) and down.fp8.scale.shape == (n, 3)
    assert torch.equal(down.fp8.scale, scales["model.layers.0.mlp.down_proj"])
    x = torch.randn(3, k)
    y = fp8_linear(x, down.fp8)
    assert y.shape == (3, n) and (y - x @ w_down.t()).norm() < 0.1 * (x @ w_down.t()).norm()


def test_engine_fp8_weights_serve_and_batch(tiny_llama_dir: str) -> None:
    prompt = [5, 17, 42, 99, 3, 250]
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with nbgen.Engine(tiny_llama_dir, device="cpu", quantization="fp8") as eng:
        out = eng.generate(input_ids=[prompt, prompt[:3]], sampling_params=sp)
        assert all(len(o["output_ids"]) == 8 for o in out)
        alone = eng.generate(input_ids=prompt, sampling_params=sp)   # per-feature weights: per-token scales
        assert alone["output_ids"] == out[0]["output_ids"]


def _kernel_check() -> None:
    """Run under TRITON_INTERPRET=1: the quantizers' scales equal the reference's, their e4m3 values
    equal it except where the interpreter's fp32 -> e4m3 cast drops a rounding carry (31.5 becomes
    16, not 32; exact bytes are checked on the GPU), and the output scaling equals the reference's fp32 products."""
    torch.manual_seed(0)
    for m, k in ((1, 300), (3, 2100), (17, 64), (2, 4500)):
        x = torch.randn(m, k) * 5
        x[0, 7] = 80.0
        xq, sa = quantize_activation(x)
        q2, s2 = fp8_quant.quant_rowwise(x)
        assert s2.shape == sa.shape and torch.equal(s2, sa), (m, k)
        same = q2.float() == xq.float()
        carry_lost = q2.float() == xq.float() / 2      # a rounding up into the next power of two
        assert (same | carry_lost).all() and same.float().mean() > 0.9, (m, k)
        n = 40
        w = quantize_weight(torch.randn(n, k))
        b = torch.randn(n)
        acc = xq.float() @ w.q.float().t()
        for bias in (b, None):
            got = fp8_quant.scale_output(acc, sa, w.scale_row, bias, torch.float32)
            want = reference_matmul(xq, sa, w, bias, torch.float32)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
            into = torch.randn(m, n)                  # the residual add in the same launch
            added = fp8_quant.scale_output(acc, sa, w.scale_row, bias, torch.float32, out=into.clone(), accumulate=True)
            torch.testing.assert_close(added, into + want, rtol=1e-6, atol=1e-5)
    # a folded norm's column scale inside the quantizer, a program per block and one per row
    for m, k in ((3, 2100), (fp8_quant.ONE_PROGRAM_ROWS + 4, 300)):
        x = torch.randn(m, k) * 5
        g = torch.rand(k) + 0.5
        xq, sa = quantize_activation(x * g)
        q2, s2 = fp8_quant.quant_rowwise(x, g)
        same = q2.float() == xq.float()
        # the interpreter also rounds some ties away from even, and subnormals by a grid step
        near = (q2.float() - xq.float()).abs() <= xq.float().abs() / 8 + 2 ** -9
        carry_lost = q2.float() == xq.float() / 2
        assert torch.equal(s2, sa) and (near | carry_lost).all() and same.float().mean() > 0.9, (m, k)


def test_fp8_quant_kernels_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_fp8_scaled as t; t._kernel_check()")
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("per_tensor", [True, False])
@pytest.mark.parametrize("n,k", [(1536, 4096), (208, 576)])
def test_gpu_scaled_linear_equals_the_reference(m: int, per_tensor: bool, n: int, k: int) -> None:
    torch.manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda")
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    fw = quantize_weight(w, torch.tensor(0.004, device="cuda") if per_tensor else None)
    xq, sa = quantize_activation(x)
    q2, s2 = fp8_quant.quant_rowwise(x)           # the kernel's bytes and scales are the reference's
    assert torch.equal(s2, sa) and torch.equal(q2.view(torch.uint8), xq.view(torch.uint8))
    want = reference_matmul(xq, sa, fw, b, torch.float32)
    got = scaled_linear(x, fw, b).float()         # bf16 output: within its rounding of the fp32 reference
    assert ((got - want).abs() <= 2 ** -7 * want.abs() + 1e-3 * want.abs().max()).all()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    assert scaled_linear(x, fw, b, out=out) is out and torch.equal(out, got.to(out.dtype))    # into a buffer
    assert torch.equal(scaled_linear(x, fw, out=out), scaled_linear(x, fw))                   # (no bias)
    g = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)    # a folded norm's weight: in the quantizer
    xq, sa = quantize_activation(x.float() * g.float())
    q2, s2 = fp8_quant.quant_rowwise(x, g)
    assert torch.equal(s2, sa) and torch.equal(q2.view(torch.uint8), xq.view(torch.uint8))
    if not per_tensor:                            # the residual add (o / down of a folded layer)
        into = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        before = into.clone()
        assert scaled_accumulate(x, fw, into)
        want = reference_matmul(*quantize_activation(x), fw, None, torch.float32)
        assert ((into.float() - before.float() - want).abs() <= 2 ** -7 * (want.abs() + before.float().abs())
                + 1e-3 * want.abs().max()).all()
    graph_x = x.clone()
    scaled_linear(graph_x, fw, b)                 # warm (compile) before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = scaled_linear(graph_x, fw, b)
    g.replay()
    assert torch.equal(out, scaled_linear(x, fw, b))


@pytest.mark.gpu
def test_gpu_engine_fp8_graphs_match_eager(gpu_model_dir: str) -> None:
    # decode CUDA graphs and piecewise prefill graphs replay the fp8 linears (scales on the device)
    prompts = gpu_prompts()
    base = gpu_generate(gpu_model_dir, prompts, logprobs=True, quantization="fp8")
    assert_close_runs(gpu_generate(gpu_model_dir, prompts, logprobs=True, quantization="fp8",
                                   disable_cuda_graph=True), base)
    assert_close_runs(gpu_generate(gpu_model_dir, prompts, logprobs=True, quantization="fp8",
                                   disable_piecewise_cuda_graph=True), base)
