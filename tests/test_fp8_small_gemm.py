"""The streaming fp8 decode kernels (nbgen.kernels.fp8_small_gemm, and fp8_row_gemv for one row) against
``fp8_scaled.reference_matmul``.

CPU: under TRITON_INTERPRET=1 at odd shapes (N, K not multiples of the tiles; 1, 3, 16 rows; bias; one
scale per tensor and per feature; x quantized in the kernel and beforehand; a folded norm's column scale
and the residual add; the one-row kernel's launches and its SiLU-and-mul epilogue); a folded fp8 model
against the unfolded one (torch path).
The interpreter's fp32 -> e4m3 cast does not round to nearest even (and its fp32 -> bf16 cast truncates:
bf16 outputs get one ulp, fp16 ones half an ulp), so exactness is checked on x whose
values lie on the e4m3 grid times a power of two (x / sa is exact, any cast agrees), and on random x
the in-kernel quantization is checked against ``quant_rowwise``'s (prequant): the same bits.
GPU (``gpu``): Llama-3.1-8B shapes against the reference, the in-kernel quantization bit for bit
against quant_rowwise's bytes (which tests/test_fp8_scaled.py proves equal to the reference's), the
folded calls and CUDA graphs, the one-row kernel's launches and SiLU epilogue, the engine's decode
through the kernels against the cuBLAS path, and a folded fp8 engine against an unfolded one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch

import nbgen
from nbgen.core.config import EngineConfig
from nbgen.kernels import fp8_quant
from nbgen.kernels import fp8_row_gemv as fr
from nbgen.kernels import fp8_small_gemm as fs
from nbgen.kernels.silu_scaled import silu_mul_scaled
from nbgen.models import norm_fold
from nbgen.models.loader import load_model
from nbgen.models.fp8_scaled import (
    Fp8ScaledWeight,
    quantize_activation,
    quantize_weight,
    reference_matmul,
)
from tests.test_models import _hf_model, _run
from tests.tiny_models import (
    GREEDY_SP,
    assert_close_runs,
    gpu_prompts,
    make_gpu_model,
    run_under_triton_interpreter,
)


def _grid_x(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """x [m, k] whose rows are e4m3 values (448 among them) times a power of two: x / sa is exact."""
    q = (torch.randn(m, k, generator=gen) * 60).clamp(-440, 440).to(torch.float8_e4m3fn).float()
    q[:, k // 2] = -448.0
    return (q * 2.0 ** torch.randint(-10, 2, (m, 1), generator=gen).float()).to(dtype)


def _want(x: torch.Tensor, w: Fp8ScaledWeight, bias: Optional[torch.Tensor] = None,
          g: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The reference in fp32; a folded norm's weight ``g``: x * g quantized per token."""
    xq, sa = quantize_activation(x if g is None else x.float() * g.float())
    return reference_matmul(xq, sa, w, bias, torch.float32)


def _within_rounding(y: torch.Tensor, ref: torch.Tensor, ulps: float) -> None:
    """y is ref (fp32, exact up to summation order) rounded once to y's dtype (within ``ulps``)."""
    step = torch.finfo(y.dtype).eps / 2        # relative rounding bound of y's dtype
    err = (y.float() - ref).abs()
    bound = ulps * step * ref.abs() + 1e-5 * ref.abs().max()
    assert bool((err <= bound).all()), (err - bound).max().item()


def _kernel_check() -> None:
    """Run under TRITON_INTERPRET=1 (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    small = [fs.Fp8GemvConfig(16, 16, 64, 4, 1, False), fs.Fp8GemvConfig(16, 16, 64, 4, 1, True)]
    for m, n, k in ((1, 37, 300), (3, 40, 200), (16, 26, 130)):
        for dtype in (torch.bfloat16, torch.float16):
            w_full = torch.randn(n, k, generator=gen) * 0.05
            for w in (quantize_weight(w_full), quantize_weight(w_full, torch.tensor(2e-4))):
                b = torch.randn(n, generator=gen).to(dtype)
                x = _grid_x(m, k, dtype, gen)
                ulps = 2.0 if dtype == torch.bfloat16 else 1.0
                for cfg in [None] + small:
                    for bias in (b, None):
                        y = fs.fp8_small_gemm(x, w.q, w.scale_row, bias, config=cfg)
                        assert y.shape == (m, n) and y.dtype == dtype
                        _within_rounding(y, _want(x, w, bias), ulps)
                # a folded norm: g (powers of two: x * g stays on the grid), the residual add
                g = 2.0 ** torch.randint(-2, 3, (k,), generator=gen).float()
                g[k // 2] = 4.0                  # x * g's amax stays 448 times a power of two
                g = g.to(dtype)
                y = fs.fp8_small_gemm(x, w.q, w.scale_row, col_scale=g)
                _within_rounding(y, _want(x, w, None, g), ulps)
                into = torch.randn(m, n, generator=gen).to(dtype)
                y = fs.fp8_small_gemm(x, w.q, w.scale_row, col_scale=g, accumulate=into.clone())
                _within_rounding(y, _want(x, w, None, g) + into.float(), ulps)
                xr = (torch.randn(m, k, generator=gen) * 3).to(dtype)     # off the grid: rounding in the cast
                assert torch.equal(fs.fp8_small_gemm(xr, w.q, w.scale_row, config=small[0]),
                                   fs.fp8_small_gemm(xr, w.q, w.scale_row, config=small[1]))


def _row_kernel_check() -> None:
    """The one-row kernel (``kernels.fp8_row_gemv``) under TRITON_INTERPRET=1: several K tiles, a partial
    last tile and block of rows, bias, column scale, residual add; equal to the multi-row kernel's bits."""
    gen = torch.Generator().manual_seed(1)
    for n, k in ((37, 1100), (20, 512), (9, 40)):
        for dtype in (torch.bfloat16, torch.float16):
            w = quantize_weight(torch.randn(n, k, generator=gen) * 0.05)
            b = torch.randn(n, generator=gen).to(dtype)
            x = _grid_x(1, k, dtype, gen)
            ulps = 2.0 if dtype == torch.bfloat16 else 1.0
            g = 2.0 ** torch.randint(-2, 3, (k,), generator=gen).float()
            g[k // 2] = 4.0
            g = g.to(dtype)
            for cfg in ((4, 512, 1, False), (8, 1024, 2, False), (16, 512, 1, False), (4, 512, 1, True)):
                y = fr.fp8_row_gemv(x, w.q, w.scale_row, torch.empty(1, n, dtype=dtype), b, config=cfg)
                _within_rounding(y, _want(x, w, b), ulps)
                y = fr.fp8_row_gemv(x, w.q, w.scale_row, torch.empty(1, n, dtype=dtype), col_scale=g, config=cfg)
                _within_rounding(y, _want(x, w, None, g), ulps)
                into = torch.randn(1, n, generator=gen).to(dtype)
                y = fr.fp8_row_gemv(x, w.q, w.scale_row, into.clone(), col_scale=g, accumulate=True, config=cfg)
                _within_rounding(y, _want(x, w, None, g) + into.float(), ulps)
            xr = (torch.randn(1, k, generator=gen) * 3).to(dtype)      # off the grid: the same e4m3 bytes
            assert torch.equal(fr.fp8_row_gemv(xr, w.q, w.scale_row, torch.empty(1, n, dtype=dtype),
                                               config=(8, 512, 1)),
                               fs.fp8_small_gemm(xr, w.q, w.scale_row, config=fs.Fp8GemvConfig(16, 16, 64, 4, 1, True)))
            xq, sa = fp8_quant.quant_rowwise(xr)                        # x given as e4m3 with its scale
            out = [torch.empty(1, n, dtype=dtype) for _ in range(2)]
            assert torch.equal(fr.fp8_row_gemv(xq, w.q, w.scale_row, out[0], config=(8, 512, 1), x_scale=sa),
                               fr.fp8_row_gemv(xr, w.q, w.scale_row, out[1], config=(8, 512, 1)))


def _row_silu_check() -> None:
    """The one-row kernel's folded gate|up with SiLU-and-mul in its epilogue, under TRITON_INTERPRET=1,
    against ``silu_mul_scaled`` (torch) of the reference projection rounded to the model dtype (within a
    few ulps: the interpreter's final cast truncates, and r's fp32 sum has another order)."""
    gen = torch.Generator().manual_seed(2)
    for i, k in ((20, 1100), (7, 512)):
        for dtype in (torch.bfloat16, torch.float16):
            w = quantize_weight(torch.randn(2 * i, k, generator=gen) * 0.05)
            h = _grid_x(1, k, dtype, gen)
            g = 2.0 ** torch.randint(-1, 2, (k,), generator=gen).float()
            g[k // 2] = 2.0                      # x * g's amax stays 448 times a power of two
            g = g.to(dtype)
            want = silu_mul_scaled(_want(h, w, None, g).to(dtype), h, 1e-5).float()
            for cfg in ((4, 512, 1, False), (8, 1024, 2, False), (2, 512, 1, True)):
                y = fr.fp8_row_gemv(h, w.q, w.scale_row, torch.empty(1, i, dtype=dtype), col_scale=g, config=cfg,
                                    silu_eps=1e-5)
                assert y.shape == (1, i)
                torch.testing.assert_close(y.float(), want, rtol=4 * torch.finfo(dtype).eps, atol=1e-6)


def test_fp8_small_gemm_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_fp8_small_gemm as t; t._kernel_check(); "
                                       "t._row_kernel_check(); t._row_silu_check()")
    assert res.returncode == 0, res.stderr[-3000:]


def test_pick_config_covers_the_rows() -> None:
    for n, k in ((6144, 4096), (4096, 14336), (14336, 4096), (40, 200)):
        bn, bk, warps = fr.pick_config(n, k)[:3]                       # one row
        assert bk % (fr.VEC * 32) == 0 and bn % 2 == 0, (bn, bk, warps)
        for m in range(2, fs.MAX_ROWS + 1):
            assert fs.pick_config(m, n, k).block_m >= m, m


@pytest.mark.parametrize("cls_name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_fp8_folded_model_equals_unfolded(tmp_path: Path, cls_name: str) -> None:
    """Folding the norms of an fp8 model keeps its e4m3 bytes, makes each norm weight its projection's
    column scale (the parameter itself), and computes what the unfolded fp8 layers compute (CPU torch
    path: x * g quantized per token, the row factor after)."""
    _hf_model(cls_name).save_pretrained(tmp_path)          # random norm weights
    loaded = load_model(EngineConfig(model_path=str(tmp_path), dtype="float32", device="cpu", quantization="fp8"),
                        torch.device("cpu"))
    prompts = [[5, 9, 2, 77, 31, 8, 100], [3, 4, 250]]
    before = _run(loaded, prompts)
    layer = loaded.model.model.layers[0]
    q = layer.self_attn.qkv_proj.fp8.q.clone()
    assert norm_fold.fold_norms(loaded.model) and layer.folded
    assert torch.equal(layer.self_attn.qkv_proj.fp8.q.view(torch.uint8), q.view(torch.uint8))
    assert layer.mlp.gate_up_proj.fp8.col_scale.data_ptr() == layer.post_attention_layernorm.weight.data_ptr()
    assert norm_fold.fold_map(loaded.model) == {}          # weight updates: no fp8 rows to fold
    after = _run(loaded, prompts)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=0)


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (4096, 14336, True), (1000, 1000, True)])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_gpu_fp8_small_gemm_equals_the_reference(m: int, n: int, k: int, bias: bool, per_tensor: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m * n + per_tensor)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.02,
                        torch.tensor(1e-4, device="cuda") if per_tensor else None)
    b = torch.randn(n, device="cuda", generator=gen).bfloat16() if bias else None
    y = fs.fp8_small_gemm(x, w.q, w.scale_row, b)           # the model's launch (one row: fp8_row_gemv)
    _within_rounding(y, _want(x, w, b), 1.0)
    # the kernel's own e4m3 rounding of x is quant_rowwise's (the reference's bytes): the same bits
    if m == 1:
        xq, sa = fp8_quant.quant_rowwise(x)
        assert torch.equal(y, fr.fp8_row_gemv(xq, w.q, w.scale_row, torch.empty_like(y), b, x_scale=sa))
    else:
        cfg = fs.pick_config(m, n, k)
        assert torch.equal(y, fs.fp8_small_gemm(x, w.q, w.scale_row, b, config=cfg._replace(prequant=not cfg.prequant)))


@gpu
@pytest.mark.parametrize("config", [(8, 2048, 4, False), (16, 2048, 8, False), (16, 2048, 8, True),
                                    (32, 2048, 16, True)])
def test_gpu_row_kernel_launches(config: tuple) -> None:
    """The one-row kernel's sweep launches at down_proj's shape: column scale and residual add."""
    gen = torch.Generator(device="cuda").manual_seed(config[0] + config[1])
    x = torch.randn(1, 14336, device="cuda", generator=gen).bfloat16()
    g = (torch.rand(14336, device="cuda", generator=gen) + 0.5).bfloat16()
    w = quantize_weight(torch.randn(4096, 14336, device="cuda", generator=gen) * 0.02)
    into = torch.randn(1, 4096, device="cuda", generator=gen).bfloat16()
    y = fr.fp8_row_gemv(x, w.q, w.scale_row, into.clone(), col_scale=g, accumulate=True, config=config)
    _within_rounding(y, _want(x, w, None, g) + into.float(), 1.0)


@gpu
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gpu_fp8_folded_calls_and_graphs(m: int) -> None:
    """A folded layer's calls (qkv: the norm weight as column scale; o / down: the residual add) against
    the reference, and replayed from a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=gen).bfloat16() * 4
    g = (torch.rand(4096, device="cuda", generator=gen) + 0.5).bfloat16()
    w = quantize_weight(torch.randn(6144, 4096, device="cuda", generator=gen) * 0.02)
    y = fs.fp8_small_gemm(x, w.q, w.scale_row, col_scale=g)
    _within_rounding(y, _want(x, w, None, g), 1.0)
    stream = torch.randn(m, 6144, device="cuda", generator=gen).bfloat16()
    into = fs.fp8_small_gemm(x, w.q, w.scale_row, accumulate=stream.clone())
    _within_rounding(into, _want(x, w) + stream.float(), 1.0)
    graph_x, graph_into = x.clone(), stream.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fs.fp8_small_gemm(graph_x, w.q, w.scale_row, col_scale=g)
        fs.fp8_small_gemm(graph_x, w.q, w.scale_row, accumulate=graph_into)
    graph.replay()
    assert torch.equal(out, y) and torch.equal(graph_into, into)


def _engine_run(path: str, prompts: list[list[int]]) -> tuple[list[dict], bool]:
    """Greedy outputs with logprobs of an fp8 CUDA engine (decode graphs up to 16 rows), and whether it
    folded its norms."""
    with nbgen.Engine(path, device="cuda", dtype="bfloat16", quantization="fp8", cuda_graph_max_bs=16) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, use_tqdm=False)
        return out, eng.get_server_info()["norms_folded"]


def _assert_fp8_close(folded: list[dict], unfolded: list[dict]) -> None:
    """Two fp8 engine runs that differ at fp8 rounding. A folded fp8 layer quantizes x * g (fp32) where
    the unfolded one quantizes the normed x rounded to bf16: some activations land on the neighbouring e4m3 value, so the two differ at fp8 rounding, not
    bf16's. On this random model that flips top-1 tokens often (the torch path on the CPU, 193 prefill
    positions: folded and unfolded agree on 77 %, each of them with fp32 on 73-75 %, bf16 with fp32 on
    97 %), more than ``assert_close_runs``'s bf16 defaults allow. Most first tokens still agree and the logprobs up to a
    fork stay close; a broken fold (a norm weight lost, a wrong row factor) or kernel forks at once
    everywhere. The kernels themselves are checked against the fp8 reference bit for bit above."""
    assert_close_runs(folded, unfolded, median=0.3, largest=None, first_share=0.5, steps=2)


@gpu
def test_gpu_engine_fp8_kernel_path_and_fold(tmp_path: Path, monkeypatch) -> None:
    """Random norm weights (so the fold is not a no-op). The fp8 engine folds its norms on CUDA (the
    kernel's column scale and residual add; at one row gate|up's SiLU in the kernel) and stays within
    fp8 rounding of the same engine unfolded (``_assert_fp8_close``); unfolded, decode through the
    streaming kernels (batch <= MAX_ROWS, in graphs) agrees with cuBLAS's fp8 GEMM, whose activation
    bytes are the same."""
    path = make_gpu_model("llama", str(tmp_path), norm_noise=0.2)
    prompts = gpu_prompts(12)                        # batch 12 shrinking: graphs of 16, 8, 4, 2, 1 rows
    folded, was_folded = _engine_run(path, prompts)
    monkeypatch.setattr(norm_fold, "should_fold", lambda model, device: False)
    unfolded, unfolded_folded = _engine_run(path, prompts)
    monkeypatch.setattr(fs, "MAX_ROWS", 0)
    cublas, _ = _engine_run(path, prompts)
    assert was_folded and not unfolded_folded
    # the same e4m3 activation bytes into each linear, but fp32 sums in another order: a one-ulp bf16
    # difference in a linear's output becomes a one-step e4m3 one in the next linear's input now and
    # then, and on this random model that compounds like the fold's rounding (H100 runs: median
    # |dlogprob| 0.059 / 0.083, max 0.29 / 0.53 — beyond the bf16 runs' bound of ``assert_close_runs``)
    _assert_fp8_close(unfolded, cublas)
    _assert_fp8_close(folded, unfolded)


@gpu
@pytest.mark.parametrize("config", [None, (8, 2048, 4, False), (16, 2048, 8, False)])
def test_gpu_row_kernel_silu_epilogue(config: Optional[tuple]) -> None:
    """A folded gate|up at one row with SiLU-and-mul in the kernel's epilogue against the projection
    followed by the scaled SiLU-and-mul launch (the same arithmetic; r summed in another order)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    h = torch.randn(1, 4096, device="cuda", generator=gen).bfloat16() * 4
    g = (torch.rand(4096, device="cuda", generator=gen) + 0.5).bfloat16()
    w = quantize_weight(torch.randn(2 * 3000, 4096, device="cuda", generator=gen) * 0.02)
    want = silu_mul_scaled(fs.fp8_small_gemm(h, w.q, w.scale_row, col_scale=g), h, 1e-5)
    y = fr.fp8_row_gemv(h, w.q, w.scale_row, torch.empty(1, 3000, device="cuda", dtype=torch.bfloat16),
                        col_scale=g, silu_eps=1e-5, config=config)
    torch.testing.assert_close(y.float(), want.float(), rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-5)
