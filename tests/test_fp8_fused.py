"""The fp8 quantization fused into the launches before an fp8 layer's gate|up and down_proj
(``kernels.fp8_quant.scale_add_quant``; ``kernels.silu_scaled.silu_mul_scaled_quant`` folded,
``silu_mul_quant`` unfolded): each against the pair of launches it replaces (the residual add then
``quant_rowwise``; the SiLU kernel then ``quant_rowwise``), bit for bit, and against the torch reference
``quantize_activation``; the layer's choice of the fused path (GPU, above the streaming kernel's rows) and
its fallback elsewhere. CPU tests run the Triton kernels under TRITON_INTERPRET=1; GPU tests (marked gpu)
at Llama-3.1-8B, Qwen3-0.6B and wider models' widths."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from nbgen.kernels import fp8_quant, gpu_ops, triton_norm
from nbgen.kernels.fp8_quant import QuantizedRows
from nbgen.kernels.silu_scaled import (ONE_BLOCK_MAX, silu_mul_quant, silu_mul_scaled, silu_mul_scaled_kernel,
                                      silu_mul_scaled_quant)
from nbgen.models.fp8_linear import Fp8Weight, fp8_linear, quantize_linears
from nbgen.models.fp8_scaled import TENSORWISE_MAX_ROWS, quantize_activation, quantize_weight, scaled_accumulate
from nbgen.models.layers import RotaryEmbedding
from nbgen.models.llama_layer import LlamaDecoderLayer
from nbgen.models.norm_fold import fold_norms
from tests.tiny_models import run_under_triton_interpreter

U8 = torch.uint8


def _same_rows(got: QuantizedRows, q: torch.Tensor, s: torch.Tensor) -> bool:
    return torch.equal(got.scale, s) and torch.equal(got.q.view(U8), q.view(U8))


def _add_quant_inputs(m: int, n: int, device: str) -> tuple[torch.Tensor, ...]:
    # a unit-scale GEMM's fp32 output, its row and feature scales, the bf16 stream, a norm weight
    acc = torch.randn(m, n, device=device) * 300
    sa = torch.rand(m, 1, device=device) * 0.01 + 1e-3
    sw = torch.rand(1, n, device=device) * 0.01 + 1e-3
    into = (torch.randn(m, n, device=device) * 2).to(torch.bfloat16)
    into[0, 3] = 90.0                            # an outlier column, as real streams have
    g = (torch.rand(n, device=device) + 0.5).to(torch.bfloat16)
    return acc, sa, sw, into, g


def _check_add_quant(m: int, n: int, device: str) -> None:
    acc, sa, sw, into, g = _add_quant_inputs(m, n, device)
    pair = into.clone()
    fp8_quant.scale_output(acc, sa, sw, None, torch.bfloat16, out=pair, accumulate=True)
    q, s = fp8_quant.quant_rowwise(pair, g)
    fused = into.clone()
    got = fp8_quant.scale_add_quant(acc, sa, sw, fused, g)
    assert torch.equal(fused, pair), (m, n)                      # the updated stream
    assert _same_rows(got, q, s) and got.dtype == torch.bfloat16, (m, n)


def _check_silu_quant(t: int, inter: int, hid: int, device: str) -> None:
    gu = (torch.randn(t, 2 * inter, device=device) * 20).to(torch.bfloat16)
    gu[0, 5] = 400.0
    h = torch.randn(t, hid, device=device).to(torch.bfloat16)
    act = silu_mul_scaled_kernel(gu, h, 1e-5)
    q, s = fp8_quant.quant_rowwise(act)
    got = silu_mul_scaled_quant(gu, h, 1e-5)
    assert _same_rows(got, q, s) and got.dtype == act.dtype, (t, inter)
    q, s = fp8_quant.quant_rowwise(triton_norm.silu_and_mul(gu))      # an unfolded layer's SiLU-and-mul
    assert _same_rows(silu_mul_quant(gu), q, s), (t, inter)


def _interpreter_check() -> None:
    """Under TRITON_INTERPRET=1: the fused kernels give the pair's bits (the interpreter's own e4m3 cast in
    both), a program per block and one per row; the scales are the torch reference's."""
    torch.manual_seed(0)
    for m, n in ((3, 1000), (17, 64), (fp8_quant.ONE_PROGRAM_ROWS + 3, 96)):
        _check_add_quant(m, n, "cpu")
    for t, inter in ((3, 768), (70, 320), (3, ONE_BLOCK_MAX + 1024), (65, ONE_BLOCK_MAX + 512)):
        _check_silu_quant(t, inter, 64, "cpu")     # a row in one block; blocks, a program each or one a row
    gu, h = torch.randn(5, 2 * 768).to(torch.bfloat16) * 9, torch.randn(5, 64).to(torch.bfloat16)
    act = silu_mul_scaled_kernel(gu, h, 1e-5)
    xq, sa = quantize_activation(act)
    got = silu_mul_scaled_quant(gu, h, 1e-5)
    same = got.q.float() == xq.float()
    # the interpreter's e4m3 cast drops rounding carries and rounds subnormals by a grid step
    # (tests/test_fp8_scaled.py); the GPU test checks the exact bytes
    near = (got.q.float() - xq.float()).abs() <= xq.float().abs() / 8 + 2 ** -9
    carry_lost = got.q.float() == xq.float() / 2
    assert torch.equal(got.scale, sa) and (near | carry_lost).all() and same.float().mean() > 0.9


def test_fused_quant_kernels_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_fp8_fused as t; t._interpreter_check()")
    assert res.returncode == 0, res.stderr[-3000:]


def _fp8_layer(hidden: int, inter: int, heads: int, device: str, fold: bool = True) -> LlamaDecoderLayer:
    """One fp8 decoder layer, folded or not (random weights, per-feature scales searched as on load)."""
    return _fp8_model(hidden, inter, heads, device, fold).model.layers[0]


def _fp8_model(hidden: int, inter: int, heads: int, device: str, fold: bool = True,
               n_layers: int = 1) -> torch.nn.Module:
    """fp8 decoder layers in ``model.model.layers`` (what fold_norms / quantize_linears walk)."""
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 4), head_dim=128, rms_norm_eps=1e-5)
    rope = RotaryEmbedding(128, 256, 10000.0, None)
    layers = torch.nn.ModuleList(LlamaDecoderLayer(cfg, i, rope) for i in range(n_layers))
    with torch.no_grad():
        for p in layers.parameters():
            p.copy_(torch.randn_like(p) * 0.02 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
    layers.to(device=device, dtype=torch.bfloat16)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = layers
    assert quantize_linears(model) == 4 * n_layers
    assert not fold or fold_norms(model)
    return model


def test_folded_layers_know_the_next_qkv_without_owning_it() -> None:
    model = _fp8_model(256, 512, 2, "cpu", n_layers=3)
    names = [n for n, _ in model.named_parameters()]
    assert not any("next_qkv" in n for n in names) and len(names) == len(set(names))
    layers = model.model.layers
    assert [len(m.next_qkv) for m in layers] == [1, 1, 0]
    assert layers[0].next_qkv[0] is layers[1].self_attn.qkv_proj and layers[1].next_qkv[0] is layers[2].self_attn.qkv_proj


def test_cpu_layer_falls_back_to_the_separate_quantizer() -> None:
    # on the CPU no product takes quantized rows: o_proj adds as accumulate() does and hands nothing on
    torch.manual_seed(1)
    layer = _fp8_layer(256, 512, 2, "cpu")
    attn_out = torch.randn(20, 256).to(torch.bfloat16)
    h = torch.randn(20, 256).to(torch.bfloat16)
    o, gate_up = layer.self_attn.o_proj, layer.mlp.gate_up_proj
    assert not gate_up.takes_quantized(h) and not layer.mlp.down_proj.takes_quantized(h)
    got = h.clone()
    assert o.accumulate_quantized(attn_out, got, gate_up) is None
    assert torch.equal(got, o.accumulate(attn_out, h.clone()))
    out, res = layer.post_attention(attn_out, h.clone())
    assert out is None and res.shape == h.shape and torch.isfinite(res.float()).all()


def test_quantized_rows_refused_where_no_product_takes_them() -> None:
    rows = QuantizedRows(torch.zeros(2, 128).to(torch.float8_e4m3fn), torch.ones(2, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="x: quantized rows"):
        fp8_linear(rows, Fp8Weight(torch.zeros(4, 128).to(torch.float8_e4m3fn), torch.ones(4, 1)))
    with pytest.raises(ValueError, match="x: quantized rows"):
        scaled_accumulate(rows, None, torch.zeros(2, 4, dtype=torch.bfloat16))
    w = quantize_weight(torch.randn(32, 128))
    with pytest.raises(ValueError, match="x: quantized rows"):
        scaled_accumulate(rows, w, torch.zeros(2, 32))            # a stream of another dtype


# (hidden, intermediate); Qwen3-14B's and Qwen2.5-7B's intermediate rows are wider than one block
WIDTHS = {"llama-8b": (4096, 14336), "qwen3-0.6b": (1024, 3072), "qwen3-14b": (5120, 17408),
          "qwen2.5-7b": (3584, 18944)}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 64, 256, 1000])
@pytest.mark.parametrize("model", list(WIDTHS))
def test_gpu_fused_quant_kernels_equal_the_pairs(rows: int, model: str) -> None:
    torch.manual_seed(rows)
    hid, inter = WIDTHS[model]
    _check_add_quant(rows, hid, "cuda")
    _check_silu_quant(rows, inter, hid, "cuda")
    act = silu_mul_scaled(*_silu_inputs(rows, inter, hid), 1e-5)          # and the torch reference's bytes
    xq, sa = quantize_activation(act)
    got = silu_mul_scaled_quant(*_silu_inputs(rows, inter, hid), 1e-5)
    assert _same_rows(got, xq, sa)


def _silu_inputs(t: int, inter: int, hid: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(t)
    gu = (torch.randn(t, 2 * inter, device="cuda", generator=g) * 20).to(torch.bfloat16)
    return gu, torch.randn(t, hid, device="cuda", generator=g).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 64, 256, 1000])
def test_gpu_folded_fp8_layer_takes_the_fused_path(rows: int) -> None:
    # post_attention (fused hand-offs) against the same layer's parts called the unfused way: the same
    # stream bit for bit, and one row quantizer a layer-step instead of three
    torch.manual_seed(rows)
    layer = _fp8_layer(1024, 3072, 16, "cuda")
    attn_out = torch.randn(rows, 16 * 128, device="cuda").to(torch.bfloat16)
    h = torch.randn(rows, 1024, device="cuda").to(torch.bfloat16) * 3
    mlp, eps = layer.mlp, layer.post_attention_layernorm.eps
    want = layer.self_attn.o_proj.accumulate(attn_out, h.clone())
    mlp.down_proj.accumulate(silu_mul_scaled(mlp.gate_up_proj(want), want, eps), want)
    layer.post_attention(attn_out, h.clone())                     # compile outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _, got = layer.post_attention(attn_out, h.clone())
        torch.cuda.synchronize()
    assert torch.equal(got, want)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_quant_rowwise_kernel" in n for n in names) == 1, names
    assert any("_scale_add_quant_kernel" in n for n in names) and any("_silu_scaled_quant" in n for n in names)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 64, 256, 1000])
def test_gpu_folded_fp8_layer_quantizes_the_next_layers_input(rows: int) -> None:
    # down_proj's residual add hands the next layer's qkv its input quantized (the bytes quant_rowwise
    # gives), and that layer's projection with them equals the one from the stream, bit for bit
    torch.manual_seed(rows)
    first, second = _fp8_model(1024, 3072, 16, "cuda", n_layers=2).model.layers
    attn_out = torch.randn(rows, 16 * 128, device="cuda").to(torch.bfloat16)
    h = torch.randn(rows, 1024, device="cuda").to(torch.bfloat16) * 3
    first.post_attention(attn_out, h.clone())                     # compile outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        xq, got = first.post_attention(attn_out, h.clone())
        torch.cuda.synchronize()
    qkv = second.self_attn.qkv_proj
    want_q, want_s = fp8_quant.quant_rowwise(got, qkv.fp8.col_scale)
    assert isinstance(xq, QuantizedRows) and _same_rows(xq, want_q, want_s)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_quant_rowwise_kernel" in n for n in names) == 1, names         # o_proj's input only
    assert sum("_scale_add_quant_kernel" in n for n in names) == 2                # o_proj's and down_proj's adds
    # the only epilogue launch left is gate|up's, at the few rows that take the unit-scale GEMM
    assert sum("_scale_output" in n for n in names) == (rows <= TENSORWISE_MAX_ROWS), names
    _, alone = first.post_attention(attn_out, h.clone())          # the stream is the same either way
    assert torch.equal(alone, got)
    assert torch.equal(qkv(xq), qkv(got))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 256])
def test_gpu_unfolded_fp8_mlp_silu_writes_e4m3(rows: int) -> None:
    # an unfolded layer's MLP (fused kernels on): the same output as its parts called the unfused way,
    # bit for bit; down_proj's input quantized by the SiLU launch (gate|up's own quantizer remains)
    was = gpu_ops.fused_enabled(torch.empty(0, device="cuda", dtype=torch.bfloat16))
    try:
        if not gpu_ops.enable_fused(True):
            pytest.skip("fused GPU kernels unavailable (flashinfer does not import)")
        torch.manual_seed(rows)
        mlp = _fp8_layer(1024, 3072, 16, "cuda", fold=False).mlp
        x = torch.randn(rows, 1024, device="cuda").to(torch.bfloat16)
        want = mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x)))
        mlp(x)                                                    # compile outside the profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = mlp(x)
            torch.cuda.synchronize()
        assert torch.equal(got, want)
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert sum("_quant_rowwise_kernel" in n for n in names) == 1, names
        assert any("_silu_scaled_quant" in n for n in names) and not any("_silu_mul_kernel" in n for n in names)
    finally:
        gpu_ops.enable_fused(was)
