"""The batch-1 qkv + RoPE + K/V write kernels (nbgen.kernels.qkv_rope_gemv): on CUDA bit for bit the two
kernels each replaces (small_gemm's or fp8_row_gemv's projection, then qk_norm_rope_) and end to end the same
decode; on the CPU, which projections LlamaAttention.project hands to them."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import nbgen

from nbgen.kernels import qk_norm_rope as fq
from nbgen.kernels import qkv_rope_gemv as qr
from nbgen.kernels import small_gemm as sg
from nbgen.kernels.kv_write import KVTarget
from nbgen.kernels.silu_scaled import rms_scale
from nbgen.models.layers import get_rope
from tests.tiny_models import GREEDY_SP, gpu_prompts, make_gpu_model, write_kv_torch

gpu = pytest.mark.gpu

# (Hq, Hkv, D, hidden, qkv bias): Llama-3.1-8B's shards at tp 1 / 2 / 4, Qwen2-0.5B (biases)
SHAPES = [(32, 8, 128, 4096, False), (16, 4, 128, 4096, False), (8, 2, 128, 4096, False), (14, 2, 64, 896, True)]


def _case(hq: int, hkv: int, D: int, K: int, bias: bool, fold: bool, fp8: bool, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(hq + 3 * K + 7 * fold + 11 * fp8)
    N = (hq + 2 * hkv) * D
    # a raw residual stream (folded: larger values, the norm's scale matters) or a normed input
    x = (torch.randn(1, K, device="cuda", generator=g) * (4.0 if fold else 1.0)).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.03).to(dtype)
    b = (torch.randn(N, device="cuda", generator=g) * 0.2).to(dtype) if bias else None
    return x, w, b


# every shape with a bf16 or e4m3 cache, folded (no bias: models/norm_fold) or not, in bf16; two in fp16
CASES = ([(*s, fold, fp8, torch.bfloat16) for s in SHAPES for fold in (False, True) for fp8 in (False, True)
          if not (fold and s[4])]
         + [(*SHAPES[2], True, False, torch.float16), (*SHAPES[3], False, True, torch.float16)])


@gpu
@pytest.mark.parametrize("hq,hkv,D,K,bias,fold,fp8,dtype", CASES)
def test_fused_equals_projection_then_rope_kernel(hq, hkv, D, K, bias, fold, fp8, dtype):
    """q, k (rotated) and v as the two-kernel path leaves them, and the same cache bytes (bf16 or e4m3
    with scales), at position 0 and at a large one."""
    x, w, b = _case(hq, hkv, D, K, bias, fold, fp8, dtype)
    rope = get_rope(D, 131072, 5e5, None).cuda()
    pages, P, qk = 40, 16, (hq + hkv) * D
    cdt = torch.float8_e4m3fn if fp8 else dtype
    ks, vs = (0.37, 0.61) if fp8 else (1.0, 1.0)
    eps = 1e-5 if fold else None
    for pos, slot in ((0, 3), (100_000, 17 * P + 9)):
        positions = torch.tensor([pos], device="cuda")
        slots = torch.tensor([slot], device="cuda")
        ref_c = [torch.zeros(pages, hkv, P, D, device="cuda", dtype=cdt) for _ in range(2)]
        got_c = [torch.zeros(pages, hkv, P, D, device="cuda", dtype=cdt) for _ in range(2)]
        ref = sg.small_gemm(x, w, b)
        fq.qk_norm_rope_(ref, positions, None, None, 0.0, rope.cos_sin_cache, hq, hkv, D,
                         kv=KVTarget(*ref_c, slots, ks, vs), row_scale=None if eps is None else (x, eps))
        got = qr.qkv_rope(x, w, b, positions, rope.cos_sin_cache, hq, hkv, D, KVTarget(*got_c, slots, ks, vs),
                          row_scale_eps=eps)
        assert torch.equal(got[:, :qk], ref[:, :qk]), (got[:, :qk].float() - ref[:, :qk].float()).abs().max()
        for r, c in zip(ref_c, got_c):
            assert torch.equal(r.view(torch.uint8), c.view(torch.uint8))
            assert c.view(torch.uint8).view(pages, -1)[slot // P].any()       # the slot's page was written
        # v: the two-kernel path leaves the raw projection in qkv once the cache holds v (scaled when folded);
        # the fused kernel stores in qkv what it writes into the cache
        if eps is None:
            assert torch.equal(got[:, qk:], ref[:, qk:])
        if not fp8:
            assert torch.equal(got[:, qk:], got_c[1][slot // P, :, slot % P].reshape(1, -1))


# e4m3 weights: the Llama-8B shards and Qwen2-0.5B (bias), folded (the norm weight as column scale) or not,
# bf16 or e4m3 cache; one fp16 case
FP8_CASES = ([(*s, fold, fp8, torch.bfloat16) for s in SHAPES for fold in (False, True) for fp8 in (False, True)
              if not (fold and s[4]) and (s[0] == 32 or fp8 == fold)]
             + [(*SHAPES[3], False, True, torch.float16)])


@gpu
@pytest.mark.parametrize("hq,hkv,D,K,bias,fold,fp8,dtype", FP8_CASES)
def test_fp8_fused_equals_projection_then_rope_kernel(hq, hkv, D, K, bias, fold, fp8, dtype):
    """e4m3 weights with per-row scales: fp8_row_gemv's projection then qk_norm_rope_, bit for bit."""
    from nbgen.kernels.fp8_row_gemv import fp8_row_gemv

    x, w, b = _case(hq, hkv, D, K, bias, fold, fp8, dtype)
    g = torch.Generator(device="cuda").manual_seed(K)
    wq = (w.float() * 12).clamp(-448, 448).to(torch.float8_e4m3fn)
    sw = (torch.rand(1, wq.shape[0], device="cuda", generator=g) + 0.5) / 12
    col = (torch.rand(K, device="cuda", generator=g) + 0.5).to(dtype) if fold else None
    rope = get_rope(D, 131072, 5e5, None).cuda()
    pages, P, qk = 40, 16, (hq + hkv) * D
    cdt = torch.float8_e4m3fn if fp8 else dtype
    ks, vs = (0.37, 0.61) if fp8 else (1.0, 1.0)
    eps = 1e-5 if fold else None
    for pos, slot in ((0, 3), (100_000, 17 * P + 9)):
        positions = torch.tensor([pos], device="cuda")
        slots = torch.tensor([slot], device="cuda")
        ref_c = [torch.zeros(pages, hkv, P, D, device="cuda", dtype=cdt) for _ in range(2)]
        got_c = [torch.zeros(pages, hkv, P, D, device="cuda", dtype=cdt) for _ in range(2)]
        ref = fp8_row_gemv(x, wq, sw, x.new_empty(1, wq.shape[0]), b, col)
        fq.qk_norm_rope_(ref, positions, None, None, 0.0, rope.cos_sin_cache, hq, hkv, D,
                         kv=KVTarget(*ref_c, slots, ks, vs), row_scale=None if eps is None else (x, eps))
        got = qr.fp8_qkv_rope(x, wq, sw, b, col, positions, rope.cos_sin_cache, hq, hkv, D,
                              KVTarget(*got_c, slots, ks, vs), row_scale_eps=eps)
        assert torch.equal(got[:, :qk], ref[:, :qk]), (got[:, :qk].float() - ref[:, :qk].float()).abs().max()
        for r, c in zip(ref_c, got_c):
            assert torch.equal(r.view(torch.uint8), c.view(torch.uint8))
            assert c.view(torch.uint8).view(pages, -1)[slot // P].any()
        if eps is None:
            assert torch.equal(got[:, qk:], ref[:, qk:])


@gpu
@pytest.mark.parametrize("family,quant", [("llama", None), ("qwen2", None), ("llama", "fp8"), ("qwen2", "fp8")])
def test_batch1_decode_unchanged(tmp_path, monkeypatch, family, quant):
    """One request at a time (batch-1 decode steps, in CUDA graphs): the fused kernel runs and the greedy
    tokens and their logprobs are exactly those of the projection + RoPE kernel path."""
    path = make_gpu_model(family, str(tmp_path))
    prompts = gpu_prompts(3)
    calls = []
    name = "fp8_qkv_rope" if quant else "qkv_rope"
    fused_kernel = getattr(qr, name)

    def counted(*args, **kw):
        calls.append(1)
        return fused_kernel(*args, **kw)

    monkeypatch.setattr(qr, name, counted)
    fused = _one_at_a_time(path, prompts, quant)
    assert calls, "the fused kernel never ran"
    monkeypatch.setattr(qr, "fp8_usable" if quant else "usable", lambda x, weight, head_dim: False)
    calls.clear()
    plain = _one_at_a_time(path, prompts, quant)
    assert not calls
    for a, b in zip(fused, plain):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def _one_at_a_time(path: str, prompts: list[list[int]], quant: Optional[str]) -> list[dict]:
    """Greedy outputs with logprobs of one bf16 CUDA engine, one request a call (batch-1 decode graphs)."""
    with nbgen.Engine(path, device="cuda", dtype="bfloat16", cuda_graph_max_bs=1, quantization=quant) as eng:
        assert eng.get_server_info()["cuda_graph_batch_sizes"]
        return [eng.generate(input_ids=p, sampling_params=GREEDY_SP, return_logprob=True) for p in prompts]


def _reference_kernel(calls: list):
    """The fused kernel's contract in torch (the unfused CPU path's ops), recording each call."""
    def run(x, weight, bias, positions, cos_sin_cache, hq, hkv, D, kv, row_scale_eps=None):
        calls.append(row_scale_eps)
        qkv = F.linear(x, weight, bias)
        if row_scale_eps is not None:
            qkv.mul_(rms_scale(x, row_scale_eps))
        q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
        rope = get_rope(D, cos_sin_cache.shape[0], 1e4, None)
        rope.cos_sin_cache = cos_sin_cache                  # the table the kernel was given
        q, k = rope(positions, q, k)
        write_kv_torch(k, v, kv.k_cache, kv.v_cache, kv.slots)
        return torch.cat([q, k, v], dim=-1)
    return run


@pytest.mark.parametrize("bias,fold", [(False, None), (False, 1e-5), (True, None)])
def test_project_at_one_row_takes_the_fused_kernel(monkeypatch, bias, fold):
    """CPU: LlamaAttention.project hands one row to the fused kernel with the layer's heads, bias, fold eps and
    K/V target, and gets what the unfused path computes; two rows, LoRA, a backend without a K/V target,
    a q/k norm and a caller's qkv buffer keep the unfused path."""
    from transformers import LlamaConfig

    from nbgen.models.llama_layer import LlamaAttention

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, attention_bias=bias)
    D, P = 64, 8
    att = LlamaAttention(cfg, 0, get_rope(D, 512, 1e4, None))      # (the RoPE table stays fp32)
    torch.manual_seed(0)
    for p in att.parameters():
        p.data = torch.randn(p.shape).mul_(0.05).bfloat16()
    caches = [torch.zeros(4, 2, P, D, dtype=torch.bfloat16) for _ in range(2)]
    target = KVTarget(*caches, torch.tensor([2 * P + 3]))
    meta = SimpleNamespace(backend=SimpleNamespace(kv_target=lambda layer_id, m: target))
    calls: list = []
    monkeypatch.setattr(qr, "usable", lambda x, weight, head_dim: True)
    monkeypatch.setattr(qr, "qkv_rope", _reference_kernel(calls))
    x, pos = torch.randn(1, 256).bfloat16() * 3, torch.tensor([77])
    q, k, v, written = att.project(pos, x, meta, fold_eps=fold)
    assert written and calls == [fold]
    monkeypatch.setattr(qr, "usable", lambda x, weight, head_dim: False)
    q0, k0, v0, written0 = att.project(pos, x, meta, fold_eps=fold)       # CPU: projection, scale, RoPE in torch
    assert not written0 and torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)
    assert torch.equal(caches[0][2, :, 3], k0.view(2, D)) and torch.equal(caches[1][2, :, 3], v0.view(2, D))
    monkeypatch.setattr(qr, "usable", lambda x, weight, head_dim: True)
    att.project(pos, x, meta, qkv_out=torch.empty(1, 512, dtype=torch.bfloat16), fold_eps=fold)
    att.project(pos, x, SimpleNamespace(backend=SimpleNamespace(kv_target=lambda layer_id, m: None)), fold_eps=fold)
    att.qkv_proj.lora = _NoLora()
    att.project(pos, x, meta, fold_eps=fold)
    att.qkv_proj.lora = None
    monkeypatch.setattr(att, "qk_norm_weights", lambda: (torch.ones(D), torch.ones(D), 1e-6))
    att.project(pos, x, meta, fold_eps=fold)
    assert calls == [fold]                                  # none of these took the fused kernel


class _NoLora:
    """An active LoRA hook that adds nothing."""

    active = True

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        pass
