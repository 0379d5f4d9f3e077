"""The element-wise kernels' launch forms (``kernels.silu_scaled``'s power-of-2 pieces, ``kernels.qk_norm_rope``'s
head groups) and the e4m3 stores' division through a shared reciprocal (``kernels.kv_write.div_rcp``): each
form gives the default's bits (and the pair of launches' for the SiLU quantizer), div_rcp gives
``tl.div_rn``'s quotient for every bf16 value over scales of every size. CPU tests run the kernels under
TRITON_INTERPRET=1 (whose fma rounds once); GPU tests (marked gpu) at Llama-3.1-8B's widths, every
candidate of ``python -m nbgen.bench.ew_kernels``."""
from __future__ import annotations

import pytest
import torch

from nbgen.kernels import fp8_quant
from nbgen.kernels.kv_write import KVTarget
from nbgen.kernels.qk_norm_rope import RopeLaunch, qk_norm_rope_
from nbgen.kernels.silu_scaled import (SiluQuantLaunch, row_pieces, silu_mul_scaled_kernel,
                                      silu_mul_scaled_quant)
from tests.tiny_models import run_under_triton_interpreter

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from nbgen.kernels.kv_write import div_rcp  # noqa: E402


@triton.jit
def _div_kernel(x_ptr, s_ptr, ref_ptr, got_ptr, N, BLOCK: tl.constexpr):
    # row j: every x over the scale s[j], tl.div_rn against div_rcp
    j = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    s = tl.load(s_ptr + j)
    tl.store(ref_ptr + j * N + offs, tl.div_rn(x, s), mask=m)
    tl.store(got_ptr + j * N + offs, div_rcp(x, s, tl.div_rn(1.0, s)), mask=m)


def check_div_rcp(device: str, n_scales: int) -> None:
    """All finite bf16 values (both signs, subnormals, zeros) over scales from 2^-40 to 2^40 and over
    e4m3_scale(amax) of bf16 amaxes: div_rcp's quotient is div_rn's bits for |x| >= 2^-100 and a normal
    quotient, and its e4m3 byte is div_rn's for every x."""
    bits = torch.arange(0, 0x7F80, dtype=torch.int32)
    x = torch.cat([bits, bits | -0x8000]).to(torch.int16).view(torch.bfloat16).float().to(device)
    g = torch.Generator().manual_seed(0)
    amax = x.abs()[torch.randint(0, x.numel() // 2, (n_scales,), generator=g)]
    scales = torch.cat([torch.exp2(torch.rand(n_scales, generator=g) * 80 - 40).to(device),
                        (amax.clamp(min=1e-10) / 448),      # as e4m3_scale divides a row amax
                        torch.tensor([1.0, 0.5, 3.0, 448.0, 1.9999999], device=device)])
    ref = torch.empty(scales.numel(), x.numel(), device=device)
    got = torch.empty_like(ref)
    _div_kernel[(triton.cdiv(x.numel(), 4096), scales.numel())](x, scales, ref, got, x.numel(), BLOCK=4096)
    fin = ref.isfinite() & (ref.abs() < 2.0 ** 100)
    exact = fin & (x.abs() >= 2.0 ** -100)[None, :] & (ref.abs() >= 2.0 ** -126)
    assert torch.equal(got[exact].view(torch.int32), ref[exact].view(torch.int32))
    e4 = lambda t: t.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(e4(got[fin]), e4(ref[fin]))


def check_silu_pieces(device: str, rows: int) -> None:
    """Every piece layout of the fused SiLU quantizer gives the pair's bytes: Llama-3.1-8B's
    14 336 columns unmasked (8 192 + 4 096 + 2 048) or as one masked 16 384, and a width whose last piece
    runs past it (11 008 = 8 192 + 2 048 + a masked 1 024)."""
    # 8 warps, as the pair's SiLU kernel: the row scale's reduction order over h follows the warp count
    for inter, layouts in ((14336, [((8192, 4096, 2048), 8), ((16384, 0, 0), 8)]),
                           (11008, [((8192, 2048, 1024), 8), ((16384, 0, 0), 8)])):
        g = torch.Generator().manual_seed(inter)
        gu = (torch.randn(rows, 2 * inter, generator=g) * 20).to(torch.bfloat16).to(device)
        gu[0, 5], gu[-1, inter - 1] = 400.0, -300.0          # outliers: the row amax at either end
        gu[0, 7] = -0.0
        h = torch.randn(rows, 256, generator=g).to(torch.bfloat16).to(device)
        want_q, want_s = fp8_quant.quant_rowwise(silu_mul_scaled_kernel(gu, h, 1e-5))
        for pieces, nw in layouts:
            got = silu_mul_scaled_quant(gu, h, 1e-5, launch=SiluQuantLaunch(pieces, 0, 1, nw))
            assert torch.equal(got.scale, want_s), (inter, pieces)
            assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8)), (inter, pieces, nw)


def check_rope_groups(device: str, hq: int, hkv: int, D: int, norm: bool, cache: torch.dtype,
                      launches: list[RopeLaunch]) -> None:
    """qk_norm_rope_ with a row scale and a K/V write: every head-group launch gives the default's q|k|v and
    cache bytes."""
    g = torch.Generator().manual_seed(hq * 100 + hkv)
    T, P = 37, 4
    qkv = (torch.randn(T, (hq + 2 * hkv) * D, generator=g) * 3).to(torch.bfloat16)
    h = torch.randn(T, 96, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 200, (T,), generator=g)
    cs = torch.randn(256, D, generator=g)
    w = (torch.rand(2, D, generator=g) + 0.5).to(torch.bfloat16)
    slots = torch.randperm(12 * P, generator=g)[:T]
    outs = []
    for lc in [None] + launches:
        x = qkv.clone().to(device)
        kc = torch.zeros(12, hkv, P, D, dtype=cache, device=device)
        vc = torch.zeros_like(kc)
        qw, kw = (w[0].to(device), w[1].to(device)) if norm else (None, None)
        qk_norm_rope_(x, pos.to(device), qw, kw, 1e-6, cs.to(device), hq, hkv, D,
                      kv=KVTarget(kc, vc, slots.to(device), 0.5, 0.25), row_scale=(h.to(device), 1e-5),
                      **({} if lc is None else {"launch": lc}))
        outs.append([t.cpu().view(torch.uint8) for t in (x, kc, vc)])
    for lc, o in zip(launches, outs[1:]):
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0])), (hq, hkv, lc)


def _interpreted() -> None:
    check_div_rcp("cpu", 12)
    check_silu_pieces("cpu", 2)
    for hq, hkv, D, norm in ((8, 4, 32, False), (6, 2, 32, False), (6, 2, 32, True), (4, 2, 64, True)):
        for cache in (torch.float8_e4m3fn, torch.bfloat16):
            launches = [RopeLaunch(1, 8)] + ([] if norm else [RopeLaunch(2, 4)])
            check_rope_groups("cpu", hq, hkv, D, norm, cache, launches)


def test_ew_kernels_under_triton_interpreter() -> None:
    res = run_under_triton_interpreter("import tests.test_ew_kernels as t; t._interpreted()")
    assert res.returncode == 0, res.stderr[-3000:]


def test_row_pieces() -> None:
    assert row_pieces(14336) == (8192, 4096, 2048)        # Llama-3.1-8B: no masked lane
    assert row_pieces(3072) == (2048, 1024, 0)            # Qwen3-0.6B
    assert row_pieces(11008) == (8192, 2048, 1024)        # Llama-2-7B: the last piece runs past I
    assert row_pieces(320) == (256, 64, 0)
    assert row_pieces(96) == (128, 0, 0)


def test_bad_launches_name_the_parameter() -> None:
    gu, h = torch.zeros(2, 2 * 14336, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)
    for pieces in ((8192, 4096, 0), (16384, 2048, 0), (8192, 0, 4096), (12288, 2048, 0)):
        with pytest.raises(ValueError, match="launch.pieces"):
            silu_mul_scaled_quant(gu, h, 1e-5, launch=SiluQuantLaunch(pieces, 0, 1, 16))
    qkv = torch.zeros(3, 48 * 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="launch.groups"):
        qk_norm_rope_(qkv, torch.zeros(3, dtype=torch.long), None, None, 0.0, torch.zeros(8, 128), 32, 8, 128,
                      launch=RopeLaunch(3, 4))
    w = torch.ones(128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="launch.groups"):   # the norm form is one program a token
        qk_norm_rope_(qkv, torch.zeros(3, dtype=torch.long), w, w, 1e-6, torch.zeros(8, 128), 32, 8, 128,
                      launch=RopeLaunch(2, 4))


@pytest.mark.gpu
def test_gpu_div_rcp_is_div_rn() -> None:
    check_div_rcp("cuda", 1000)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 320])
def test_gpu_silu_pieces_equal_the_pair(rows: int) -> None:
    check_silu_pieces("cuda", rows)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,norm", [(32, 8, False), (16, 8, True), (28, 4, False)])
@pytest.mark.parametrize("cache", [torch.float8_e4m3fn, torch.bfloat16])
def test_gpu_rope_groups_equal_the_default(hq: int, hkv: int, norm: bool, cache: torch.dtype) -> None:
    # the default's 8 warps: the row scale's reduction order over h follows the warp count, so other counts
    # may round a row's scale differently; the per-head norm form is one program a token
    launches = [RopeLaunch(g, 8) for g in ((1,) if norm else (1, 2, 4)) if hkv % g == 0 and hq % g == 0]
    check_rope_groups("cuda", hq, hkv, 128, norm, cache, launches)
