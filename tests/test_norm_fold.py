"""Folded RMSNorms (nbgen.models.norm_fold): the folded decoder equals the unfolded one and HF.

CPU tests run the torch fallbacks of the folded path (fp32, against HF logits); the GPU tests check
the Triton kernels' folded variants against torch references and a folded engine against an
unfolded one on a model with random norm weights.
"""
from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nbgen
from nbgen.core.config import EngineConfig
from nbgen.kernels import silu_scaled
from nbgen.models import norm_fold
from nbgen.models.loader import load_model
from tests.test_models import _hf_model, _run
from tests.tiny_models import assert_close_runs, gpu_generate, gpu_prompts, make_gpu_model, teacher_forced_vs_hf

gpu = pytest.mark.gpu


def _load(tmp_path: Path, cls_name: str, dtype: str = "float32", **overrides):
    hf = _hf_model(cls_name, **overrides)         # random norm weights and biases
    hf.save_pretrained(tmp_path)
    return hf, load_model(EngineConfig(model_path=str(tmp_path), dtype=dtype, device="cpu"), torch.device("cpu"))


@pytest.mark.parametrize("cls_name", ["LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"])
def test_folded_model_matches_hf(tmp_path: Path, cls_name: str) -> None:
    hf, loaded = _load(tmp_path, cls_name)
    before = _run(loaded, [[5, 9, 2, 77, 31, 8, 100]])
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj.weight.clone()
    assert norm_fold.fold_norms(loaded.model)
    assert all(layer.folded for layer in loaded.model.model.layers)
    g = loaded.model.model.layers[0].input_layernorm.weight
    torch.testing.assert_close(loaded.model.model.layers[0].self_attn.qkv_proj.weight, qkv * g[None, :])
    assert norm_fold.fold_norms(loaded.model)     # a second call folds nothing again
    torch.testing.assert_close(loaded.model.model.layers[0].self_attn.qkv_proj.weight, qkv * g[None, :])
    rng = random.Random(3)
    a = [rng.randrange(300) for _ in range(13)]
    b = [rng.randrange(300) for _ in range(5)]
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in (a, b)])
    got = _run(loaded, [a, b])                    # two sequences in one flat batch, torch backend
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # and the same prompt as before folding, through the folded layers
    torch.testing.assert_close(_run(loaded, [[5, 9, 2, 77, 31, 8, 100]]), before, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cls_name,overrides,dtype", [
    ("Qwen2ForCausalLM", {}, "float32"),                        # q/k/v biases
    ("LlamaForCausalLM", {"attention_bias": True}, "float32"),  # o_proj bias too
    ("LlamaForCausalLM", {}, "float16"),                        # fp16: the raw stream's range
])
def test_not_foldable_models_stay_unchanged(tmp_path: Path, cls_name: str, overrides: dict, dtype: str) -> None:
    _hf, loaded = _load(tmp_path, cls_name, dtype=dtype, **overrides)
    state = copy.deepcopy(loaded.model.state_dict())
    assert not norm_fold.foldable(loaded.model)
    assert not norm_fold.fold_norms(loaded.model)
    assert not any(layer.folded for layer in loaded.model.model.layers if hasattr(layer, "folded"))
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_runner_folds_only_on_cuda(tmp_path: Path) -> None:
    _hf, loaded = _load(tmp_path, "LlamaForCausalLM", dtype="bfloat16")
    assert norm_fold.foldable(loaded.model)
    assert not norm_fold.should_fold(loaded.model, torch.device("cpu"))


def test_accumulate_and_scaled_silu_torch_paths() -> None:
    from nbgen.models.linear import RowParallelLinear

    torch.manual_seed(0)
    lin = RowParallelLinear(16, 8)
    lin.weight.data.normal_()
    x, h = torch.randn(5, 16), torch.randn(5, 8)
    want = h + x @ lin.weight.T
    got = lin.accumulate(x, h)
    assert got is h
    torch.testing.assert_close(h, want)
    gu, hh = torch.randn(5, 12), torch.randn(5, 7) * 30
    s = torch.rsqrt(hh.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(silu_scaled.silu_mul_scaled(gu, hh, 1e-6), F.silu(gu[:, :6] * s) * gu[:, 6:] * s)


def test_folded_engine_generates_like_unfolded(tiny_qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's fold on the CPU (policy patched): the engine reports it and greedy output is the
    unfolded engine's (fp32, torch fallbacks of the folded path, decode steps included)."""
    prompts = [[3, 17, 42, 9, 120, 7], [5, 6, 7, 8]]
    sp = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    with nbgen.Engine(tiny_qwen3_dir, dtype="float32", device="cpu") as eng:
        plain = eng.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)
        assert eng.get_server_info()["norms_folded"] is False
    monkeypatch.setattr(norm_fold, "should_fold", lambda model, device: True)
    with nbgen.Engine(tiny_qwen3_dir, dtype="float32", device="cpu") as eng:
        folded = eng.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)
        assert eng.get_server_info()["norms_folded"] is True
    assert [o["output_ids"] for o in folded] == [o["output_ids"] for o in plain]


# ---- CUDA: the kernels' folded variants ------------------------------------------------------------

ULP = 2.0 ** -8


@gpu
@pytest.mark.parametrize("M", [1, 3, 8, 16])
def test_small_gemm_row_scale_and_accumulate(M: int) -> None:
    from nbgen.kernels import small_gemm as sg

    g = torch.Generator(device="cuda").manual_seed(M)
    K, I = 1024, 1536
    h = (torch.randn(M, K, device="cuda", generator=g) * 20).bfloat16()
    w = (torch.randn(2 * I, K, device="cuda", generator=g) * 0.05).bfloat16()
    s = silu_scaled.rms_scale(h, 1e-6)
    gate_up = (F.linear(h.float(), w.float()) * s).bfloat16().float()
    ref = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    y = sg.small_gemm(h, w, silu_mul=True, row_scale_eps=1e-6)
    err = (y.float() - ref).abs()
    assert bool((err <= 4 * ULP * ref.abs() + 1e-5 * ref.abs().max()).all())
    # accumulate: stream + x @ W.T, rounded once
    wd = (torch.randn(K, I, device="cuda", generator=g) * 0.05).bfloat16()
    stream = h.clone()
    out = sg.small_gemm(y, wd, accumulate=stream)
    assert out.data_ptr() == stream.data_ptr()
    exact = h.float() + F.linear(y.float(), wd.float())
    assert bool(((stream.float() - exact).abs() <= ULP * exact.abs() + 1e-4 * exact.abs().max()).all())


@gpu
@pytest.mark.parametrize("T", [1, 40, 300, 1500])   # 1500: one program a token
def test_silu_mul_scaled_kernel_matches_torch(T: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(T)
    gu = torch.randn(T, 2 * 3000, device="cuda", generator=g).bfloat16()
    h = (torch.randn(T, 1000, device="cuda", generator=g) * 50).bfloat16()
    s = silu_scaled.rms_scale(h, 1e-5)
    gate, up = (gu.float() * s).bfloat16().float().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    y = silu_scaled.silu_mul_scaled(gu, h, 1e-5)
    assert y.shape == (T, 3000) and y.dtype == torch.bfloat16
    assert bool(((y.float() - ref).abs() <= ULP * ref.abs() + 1e-6).all())


@gpu
@pytest.mark.parametrize("norm", [True, False])
def test_rope_kernel_row_scale(norm: bool) -> None:
    """qk_norm_rope_ with row_scale == scaling q|k|v by the rows' rms scale (rounded), then the plain kernel."""
    from nbgen.kernels import qk_norm_rope as fq
    from nbgen.models.layers import get_rope

    T, hq, hkv, D, H = 37, 16, 8, 128, 1024
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(T, (hq + 2 * hkv) * D, device="cuda", generator=g).bfloat16()
    h = (torch.randn(T, H, device="cuda", generator=g) * 10).bfloat16()
    pos = torch.randint(0, 500, (T,), device="cuda", generator=g)
    rope = get_rope(D, 1024, 1e6, None).cuda()
    wq = wk = None
    if norm:
        wq = (1 + 0.2 * torch.randn(D, device="cuda", generator=g)).bfloat16()
        wk = (1 + 0.2 * torch.randn(D, device="cuda", generator=g)).bfloat16()
    ref = (qkv.float() * silu_scaled.rms_scale(h, 1e-6)).bfloat16()
    fq.qk_norm_rope_(ref, pos, wq, wk, 1e-6, rope.cos_sin_cache, hq, hkv, D)
    got = qkv.clone()
    fq.qk_norm_rope_(got, pos, wq, wk, 1e-6, rope.cos_sin_cache, hq, hkv, D, row_scale=(h, 1e-6))
    # v scaled in place; the kernel's row sums may differ from torch's mean in the last fp32 bit
    assert (got[:, (hq + hkv) * D:] == ref[:, (hq + hkv) * D:]).float().mean().item() > 0.99
    assert (got == ref).float().mean().item() > 0.99                            # q, k: same arithmetic
    torch.testing.assert_close(got.float(), ref.float(), atol=0.02, rtol=0.02)


@gpu
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_folded_engine_tracks_unfolded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """Random norm weights (so the fold is not a no-op): the folded engine (default) against
    the same engine with the fold policy saying no — teacher-forced against HF within bf16 noise of the unfolded engine, and
    free-running greedy with logprobs through decode graphs and piecewise prefill graphs."""

    path = make_gpu_model(family, str(tmp_path), norm_noise=0.2)
    with nbgen.Engine(path, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16) as eng:
        assert eng.get_server_info()["norms_folded"] is True
    folded = teacher_forced_vs_hf(path)
    prompts = gpu_prompts()
    gen_folded = gpu_generate(path, prompts, logprobs=True)
    monkeypatch.setattr(norm_fold, "should_fold", lambda model, device: False)
    plain = teacher_forced_vs_hf(path)
    gen_plain = gpu_generate(path, prompts, logprobs=True)
    # the fold rounds g * W once and the raw projections twice: a little more noise than the unfolded
    # layers, never a different computation. The unfolded layers round as HF does (kernels/triton_norm.py),
    # so their median |dlogprob| is the matmuls' summation order alone (~0.006-0.008 on these models, top-1
    # 0.97-0.98) while the fold's own roundings give ~0.02-0.025 (top-1 0.945-0.96, disagreeing only at
    # near-ties): an additive term, not a multiple of the unfolded noise. A wrong scale or a missed
    # residual is tenths of a nat off and disagrees where the margin is clear.
    assert folded["agree_clear"] >= 0.99 and folded["dlp"] <= 0.05
    assert folded["dlp"] <= plain["dlp"] + 0.025, (folded, plain)
    assert folded["agree"] >= 0.93, (folded, plain)
    # free-running: near-ties fork some sequences at their first token (2 of 12 here); a broken fold forks most
    assert_close_runs(gen_folded, gen_plain, first_share=0.75)
