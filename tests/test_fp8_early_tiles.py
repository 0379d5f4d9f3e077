"""Early weight tiles in the one-row fp8 kernels (``early_tiles``: tiles a program loads before its PDL wait):
``fp8_row_gemv`` and ``fp8_qkv_rope.qkv_rope`` give the bits of one early tile with 2-4, and the engine's
o_proj takes ``EARLY_TILES_AFTER_ATTENTION``.

CPU: fp8_row_gemv under TRITON_INTERPRET=1 (K of one to five tiles, a partial last tile, every epilogue:
bias, folded norm's column scale, residual add, SiLU-and-mul, x given quantized); bad ``early_tiles`` raise;
the o_proj's residual add passes its early tiles down to the kernel. GPU (``gpu``): the same at
Llama-3.1-8B shapes and the fused qkv + RoPE kernel's outputs and cache bytes.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from nbgen.kernels import fp8_qkv_rope as fk
from nbgen.kernels import fp8_quant
from nbgen.kernels import fp8_row_gemv as fr
from nbgen.kernels.kv_write import KVTarget
from nbgen.models import linear, llama_layer
from nbgen.models.fp8_scaled import quantize_weight
from nbgen.models.layers import get_rope
from nbgen.models.linear import RowParallelLinear
from tests.tiny_models import run_under_triton_interpreter

gpu = pytest.mark.gpu


def _launches(x: torch.Tensor, w: Any, n: int, early: int, cfg: tuple, gen: torch.Generator) -> list[torch.Tensor]:
    """Every epilogue of the one-row kernel with ``early`` early tiles (same inputs for any ``early``)."""
    dt, dev = x.dtype, x.device
    k = x.shape[1]
    b = torch.randn(n, generator=gen).to(dev, dt)
    g = (torch.rand(k, generator=gen) + 0.5).to(dev, dt)
    into = torch.randn(1, n, generator=gen).to(dev, dt)
    xq, sa = fp8_quant.quant_rowwise(x)
    return [fr.fp8_row_gemv(x, w.q, w.scale_row, x.new_empty(1, n), b, config=cfg, early_tiles=early),
            fr.fp8_row_gemv(x, w.q, w.scale_row, into.clone(), col_scale=g, accumulate=True, config=cfg,
                            early_tiles=early),
            fr.fp8_row_gemv(x, w.q, w.scale_row, x.new_empty(1, n // 2), col_scale=g, silu_eps=1e-5, config=cfg,
                            early_tiles=early),
            fr.fp8_row_gemv(xq, w.q, w.scale_row, x.new_empty(1, n), config=cfg, x_scale=sa, early_tiles=early)]


def _same_bits(n: int, k: int, cfg: tuple, dev: str, seed: int) -> None:
    """2, 3 and 4 early tiles against 1, bit for bit, at [n, k] with launch ``cfg``."""
    w = quantize_weight((torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dev))
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(seed + 1)) * 3).to(dev, torch.bfloat16)
    want = _launches(x, w, n, 1, cfg, torch.Generator().manual_seed(seed + 2))
    assert all(bool(y.float().abs().sum() > 0) for y in want)
    for early in (2, 3, 4):
        got = _launches(x, w, n, early, cfg, torch.Generator().manual_seed(seed + 2))
        for a, b in zip(got, want):
            assert torch.equal(a, b), (early, n, k, cfg, (a.float() - b.float()).abs().max().item())


def _early_check() -> None:
    """Run under TRITON_INTERPRET=1: K of 1-5 tiles of 512 (the last one partial), 8 rows a program."""
    for i, (n, k) in enumerate(((20, 300), (18, 1100), (8, 1536), (22, 2500))):
        _same_bits(n, k, (8, 512, 1, k <= 2048), "cpu", 10 * i)


def test_early_tiles_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_fp8_early_tiles as t; t._early_check()")
    assert res.returncode == 0, res.stderr[-3000:]


def test_early_tiles_outside_1_to_4_raise() -> None:
    pytest.importorskip("triton")
    w = quantize_weight(torch.randn(8, 64) * 0.05)
    x = torch.randn(1, 64).bfloat16()
    for bad in (0, 5):
        with pytest.raises(ValueError, match="early_tiles"):
            fr.fp8_row_gemv(x, w.q, w.scale_row, x.new_empty(1, 8), early_tiles=bad)


def test_o_proj_residual_add_takes_its_early_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """LinearBase.accumulate hands the layer's early tiles to the fp8 residual add; Llama's o_proj sets
    ``EARLY_TILES_AFTER_ATTENTION``, down_proj keeps 1."""
    seen = []
    monkeypatch.setattr(linear, "scaled_accumulate", lambda x, w, into, early: seen.append(early) or True)
    lin = RowParallelLinear(16, 8)
    lin.fp8 = quantize_weight(torch.randn(8, 16))
    lin.accumulate(torch.randn(1, 16), torch.zeros(1, 8))
    lin.early_tiles = 3
    lin.accumulate(torch.randn(1, 16), torch.zeros(1, 8))
    assert seen == [1, 3]
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    layer = llama_layer.LlamaDecoderLayer(cfg, 0, None)
    assert layer.self_attn.o_proj.early_tiles == fr.EARLY_TILES_AFTER_ATTENTION
    assert 1 < fr.EARLY_TILES_AFTER_ATTENTION <= 4 and layer.mlp.down_proj.early_tiles == 1


@gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (28672, 4096), (4096, 14336), (6144, 4096), (40, 1100)])
def test_gpu_early_tiles_same_bits(n: int, k: int) -> None:
    """Llama-3.1-8B's o, gate|up, down and qkv shapes at pick_config's launch, and a small odd one."""
    _same_bits(n, k, fr.pick_config(n, k), "cuda", n + k)


@gpu
def test_gpu_qkv_rope_early_tiles_same_bits() -> None:
    """The fused qkv + RoPE + K/V write kernel at Llama-3.1-8B's shape, folded: outputs and cache bytes."""
    g = torch.Generator(device="cuda").manual_seed(5)
    hq, hkv, D, K = 32, 8, 128, 4096
    N = (hq + 2 * hkv) * D
    x = (torch.randn(1, K, device="cuda", generator=g) * 4).bfloat16()
    wq = (torch.randn(N, K, device="cuda", generator=g) * 0.4).clamp(-448, 448).to(torch.float8_e4m3fn)
    sw = (torch.rand(1, N, device="cuda", generator=g) + 0.5) / 12
    col = (torch.rand(K, device="cuda", generator=g) + 0.5).bfloat16()
    rope = get_rope(D, 131072, 5e5, None).cuda()
    pos, slots = torch.tensor([777], device="cuda"), torch.tensor([3 * 16 + 5], device="cuda")
    outs = []
    for early in (1, 2, 3, 4):
        caches = [torch.zeros(8, hkv, 16, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        y = fk.qkv_rope(x, wq, sw, None, col, pos, rope.cos_sin_cache, hq, hkv, D, KVTarget(*caches, slots),
                        row_scale_eps=1e-5, early_tiles=early)
        outs.append((y, caches))
    for y, caches in outs[1:]:
        assert torch.equal(y, outs[0][0])
        assert all(torch.equal(a, b) for a, b in zip(caches, outs[0][1]))
    assert outs[0][1][0].any()
