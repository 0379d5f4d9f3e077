"""The batch-1 fp8 qkv + RoPE + K/V write kernel (nbgen.kernels.fp8_qkv_rope): on CUDA bit for bit the two
kernels it replaces (fp8_row_gemv's projection, then qk_norm_rope_) and end to end the same decode; on the
CPU, which projections LlamaAttention.project hands to it."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import torch

import nbgen
from nbgen.kernels import fp8_qkv_rope as fk
from nbgen.kernels import qk_norm_rope as fq
from nbgen.kernels.kv_write import KVTarget
from nbgen.kernels.silu_scaled import rms_scale
from nbgen.models import llama_layer
from nbgen.models.fp8_scaled import Fp8ScaledWeight, quantize_activation, quantize_weight, reference_matmul
from nbgen.models.layers import get_rope
from tests.tiny_models import GREEDY_SP, gpu_prompts, make_gpu_model, write_kv_torch

gpu = pytest.mark.gpu

# (Hq, Hkv, D, hidden, qkv bias): Llama-3.1-8B's shards at tp 1 / 2 / 4, Qwen2-0.5B (biases)
SHAPES = [(32, 8, 128, 4096, False), (16, 4, 128, 4096, False), (8, 2, 128, 4096, False), (14, 2, 64, 896, True)]
# folded (the norm weight as column scale; no bias: models/norm_fold) or not, bf16 or e4m3 cache: every
# combination at tp 1, two at the other shards; one fp16 case
CASES = ([(*s, fold, fp8, torch.bfloat16) for s in SHAPES for fold in (False, True) for fp8 in (False, True)
          if not (fold and s[4]) and (s[0] == 32 or fp8 == fold)]
         + [(*SHAPES[3], False, True, torch.float16)])


@gpu
@pytest.mark.parametrize("hq,hkv,D,K,bias,fold,fp8,dtype", CASES)
def test_fused_equals_projection_then_rope_kernel(hq: int, hkv: int, D: int, K: int, bias: bool, fold: bool, fp8: bool,
                                                  dtype: torch.dtype) -> None:
    """q, k (rotated) and v as the two-kernel path leaves them, and the same cache bytes (bf16 or e4m3 with
    scales), at position 0 and at a large one."""
    from nbgen.kernels.fp8_row_gemv import fp8_row_gemv

    g = torch.Generator(device="cuda").manual_seed(hq + 3 * K + 7 * fold + 11 * fp8)
    N = (hq + 2 * hkv) * D
    # a raw residual stream (folded: larger values, the norm's scale matters) or a normed input
    x = (torch.randn(1, K, device="cuda", generator=g) * (4.0 if fold else 1.0)).to(dtype)
    wq = (torch.randn(N, K, device="cuda", generator=g) * 0.4).clamp(-448, 448).to(torch.float8_e4m3fn)
    sw = (torch.rand(1, N, device="cuda", generator=g) + 0.5) / 12
    b = (torch.randn(N, device="cuda", generator=g) * 0.2).to(dtype) if bias else None
    col = (torch.rand(K, device="cuda", generator=g) + 0.5).to(dtype) if fold else None
    assert fk.usable(x, wq, D)
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
        ref = fp8_row_gemv(x, wq, sw, x.new_empty(1, N), b, col)
        fq.qk_norm_rope_(ref, positions, None, None, 0.0, rope.cos_sin_cache, hq, hkv, D,
                         kv=KVTarget(*ref_c, slots, ks, vs), row_scale=None if eps is None else (x, eps))
        got = fk.qkv_rope(x, wq, sw, b, col, positions, rope.cos_sin_cache, hq, hkv, D, KVTarget(*got_c, slots, ks, vs),
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


@gpu
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batch1_decode_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """fp8 weights, one request at a time (batch-1 decode steps, in CUDA graphs; llama folded, qwen2 with
    biases): the fused kernel runs and the greedy tokens and their logprobs are exactly those of the
    projection + RoPE kernel path."""
    path = make_gpu_model(family, str(tmp_path))
    prompts = gpu_prompts(3)
    calls = []
    fused_kernel = fk.qkv_rope

    def counted(*args: Any, **kw: Any) -> torch.Tensor:
        calls.append(1)
        return fused_kernel(*args, **kw)

    monkeypatch.setattr(fk, "qkv_rope", counted)
    fused = _one_at_a_time(path, prompts)
    assert calls, "the fused kernel never ran"
    monkeypatch.setattr(fk, "usable", lambda x, wq, head_dim: False)
    calls.clear()
    plain = _one_at_a_time(path, prompts)
    assert not calls
    for a, b in zip(fused, plain):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def _one_at_a_time(path: str, prompts: list[list[int]]) -> list[dict]:
    """Greedy outputs with logprobs of one bf16 CUDA engine with fp8 weights, one request a call (batch-1
    decode graphs)."""
    with nbgen.Engine(path, device="cuda", dtype="bfloat16", cuda_graph_max_bs=1, quantization="fp8") as eng:
        assert eng.get_server_info()["cuda_graph_batch_sizes"]
        return [eng.generate(input_ids=p, sampling_params=GREEDY_SP, return_logprob=True) for p in prompts]


def _reference_kernel(calls: list) -> Callable[..., torch.Tensor]:
    """The fused kernel's contract in torch (the unfused CPU path's ops), recording each call."""
    def run(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
            col_scale: Optional[torch.Tensor], positions: torch.Tensor, cos_sin_cache: torch.Tensor, hq: int, hkv: int,
            D: int, kv: KVTarget, row_scale_eps: Optional[float] = None) -> torch.Tensor:
        calls.append(row_scale_eps)
        w = Fp8ScaledWeight(wq, sw, None, torch.ones(()))
        xq, sa = quantize_activation(x if col_scale is None else x.float() * col_scale.float())
        qkv = reference_matmul(xq, sa, w, bias, x.dtype)
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
def test_project_at_one_row_takes_the_fused_kernel(monkeypatch: pytest.MonkeyPatch, bias: bool,
                                                  fold: Optional[float]) -> None:
    """CPU: LlamaAttention.project hands one row with an fp8 weight to the fused kernel with the layer's heads,
    bias, scales, fold eps and K/V target, and gets what the unfused path computes; LoRA, a backend without a
    K/V target, a q/k norm, a caller's qkv buffer, two rows and a bf16 weight keep the unfused path."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, attention_bias=bias)
    D, P = 64, 8
    att = llama_layer.LlamaAttention(cfg, 0, get_rope(D, 512, 1e4, None))      # (the RoPE table stays fp32)
    torch.manual_seed(0)
    for p in att.parameters():
        p.data = torch.randn(p.shape).mul_(0.05).bfloat16()
    bf16_weight = att.qkv_proj.weight.data
    att.qkv_proj.fp8 = quantize_weight(bf16_weight)
    att.qkv_proj.weight.data = att.qkv_proj.fp8.q
    if fold is not None:      # the folded norm's weight, a column scale of the quantized input
        att.qkv_proj.fp8.col_scale = (torch.rand(256) + 0.5).bfloat16()
    caches = [torch.zeros(4, 2, P, D, dtype=torch.bfloat16) for _ in range(2)]
    target = KVTarget(*caches, torch.tensor([2 * P + 3]))
    meta = SimpleNamespace(backend=SimpleNamespace(kv_target=lambda layer_id, m: target))
    x, pos = torch.randn(1, 256).bfloat16() * 3, torch.tensor([77])
    q0, k0, v0, written0 = att.project(pos, x, meta, fold_eps=fold)       # CPU: the unfused path in torch
    assert not written0
    calls: list = []
    # as on an fp8-capable GPU: the layer's check without the device part
    monkeypatch.setattr(llama_layer, "qkv_rope_usable",
                        lambda x, w, head_dim: isinstance(w, Fp8ScaledWeight) and fk.usable(x, w.q, head_dim))
    monkeypatch.setattr(fk, "qkv_rope", _reference_kernel(calls))
    q, k, v, written = att.project(pos, x, meta, fold_eps=fold)
    assert written and calls == [fold]
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)
    assert torch.equal(caches[0][2, :, 3], k0.view(2, D)) and torch.equal(caches[1][2, :, 3], v0.view(2, D))
    no_target = SimpleNamespace(backend=SimpleNamespace(kv_target=lambda layer_id, m: None))
    assert not att.project(pos, x, no_target, fold_eps=fold)[3]
    att.project(pos, x, meta, qkv_out=torch.empty(1, 512, dtype=torch.bfloat16), fold_eps=fold)
    att.project(torch.tensor([5, 6]), x.repeat(2, 1), meta, fold_eps=fold)
    att.qkv_proj.lora = _NoLora()
    att.project(pos, x, meta, fold_eps=fold)
    att.qkv_proj.lora = None
    with monkeypatch.context() as m:
        m.setattr(att, "qk_norm_weights", lambda: (torch.ones(D), torch.ones(D), 1e-6))
        att.project(pos, x, meta, fold_eps=fold)
    w8 = att.qkv_proj.fp8
    att.qkv_proj.fp8, att.qkv_proj.weight.data = None, bf16_weight             # bf16 weights: two launches
    att.project(pos, x, meta, fold_eps=fold)
    assert calls == [fold]                                  # none of these took the fused kernel
    att.qkv_proj.fp8, att.qkv_proj.weight.data = w8, w8.q
    att.project(pos, x, meta, fold_eps=fold)
    assert calls == [fold, fold]


class _NoLora:
    """An active LoRA hook that adds nothing."""

    active = True

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        pass
