"""``python -m nbgen.bench.fp8_kernels --tc``'s candidates at one linear shape and row count: the launch
shapes of ``kernels/fp8_tc_gemm.py`` (on an activation quantized beforehand; its precise and fast
accumulation; the residual-add epilogue), cuBLAS's fp8 GEMM with fast accumulation, and the activation
quantizers a per-feature fp8 linear runs before its GEMM (a folded norm's column scale in the kernel
against the fp32 product first; at gate|up's shape the SiLU-and-mul with the quantization fused against
the two launches).
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from nbgen.kernels import fp8_quant, fp8_tc_gemm
from nbgen.kernels.fp8_tc_gemm import TcConfig
from nbgen.kernels.silu_scaled import silu_mul_scaled, silu_mul_scaled_quant

SMEM_BYTES = 220 << 10       # an H100 SM's shared memory a program may take (227 KB, less Triton's own)


def tc_configs(rows: int, quick: bool) -> list[TcConfig]:
    """The launch shapes worth timing at ``rows`` rows (shared memory within an H100's)."""
    out = []
    bms = (64, 128) if rows <= 1024 else (128,)
    for bm, bn, w, st in itertools.product(bms, (64, 128, 256), (4, 8), (3, 4, 5)):
        if (bm + bn) * 128 * st > SMEM_BYTES or (bm == 64 and w == 8 and bn < 256) or (quick and st == 5):
            continue
        out.append(TcConfig(bm, bn, 128, w, st))
    if 128 < rows <= 1024:
        out += [TcConfig(256, bn, 128, 8, st) for bn in (64, 128) for st in (3, 4) if (256 + bn) * 128 * st <= SMEM_BYTES]
    return out


def tc_cases(n: int, k: int, rows: int, x: torch.Tensor, wq: list[torch.Tensor], quick: bool,
             timer: Callable[[Callable[[int], object]], float]) -> list[tuple[str, float]]:
    """(label, seconds per call) of each candidate; ``timer(fn)`` times ``fn(i)`` over the weight copies."""
    dev = x.device
    xq, sa = fp8_quant.quant_rowwise(x)
    sw = torch.rand(1, n, device=dev) / 448
    y = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    out: list[tuple[str, float]] = []

    def case(label: str, fn: Callable[[int], object]) -> None:
        try:
            out.append((label, timer(fn)))
        except Exception as e:   # noqa: BLE001 - a shape this GPU or torch cannot run
            print(f"  N={n} K={k} rows={rows}: {label} failed ({type(e).__name__}: {str(e).splitlines()[0][:90]})")

    best, best_t = None, float("inf")
    for cfg in tc_configs(rows, quick):
        case(str(cfg), lambda i, c=cfg: fp8_tc_gemm.fp8_tc_gemm(xq, sa, wq[i], sw, out=y, cfg=c))
        if out and out[-1][0] == str(cfg) and out[-1][1] < best_t:
            best, best_t = cfg, out[-1][1]
    if best is not None:
        fast = TcConfig(best.block_m, best.block_n, best.block_k, best.num_warps, best.num_stages, best.group_m, False)
        case(f"fast accumulation {fast}", lambda i: fp8_tc_gemm.fp8_tc_gemm(xq, sa, wq[i], sw, out=y, cfg=fast))
        case(f"residual add {best}", lambda i: fp8_tc_gemm.fp8_tc_gemm(xq, sa, wq[i], sw, out=y, accumulate=True,
                                                                       cfg=best))
    case("table pick (x pre-quantized)", lambda i: fp8_tc_gemm.fp8_tc_gemm(xq, sa, wq[i], sw, out=y))
    unit = torch.ones((), device=dev)
    case("cuBLAS tensorwise fast accumulation", lambda i: torch._scaled_mm(
        xq, wq[i].t(), scale_a=unit, scale_b=unit, out_dtype=torch.bfloat16, use_fast_accum=True))
    case("cuBLAS row-wise fast accumulation", lambda i: torch._scaled_mm(
        xq, wq[i].t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True))
    g = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
    case("quantize x (no GEMM)", lambda i: fp8_quant.quant_rowwise(x))
    case("quantize x * g, g in the kernel (no GEMM)", lambda i: fp8_quant.quant_rowwise(x, g))
    case("quantize x * g, fp32 product first (no GEMM)", lambda i: fp8_quant.quant_rowwise(x.float() * g.float()))
    if n % 2 == 0 and n // 2 > k:     # gate|up: its SiLU-and-mul, quantized for down
        gu = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
        case("SiLU-and-mul, then quantize (no GEMM)", lambda i: fp8_quant.quant_rowwise(silu_mul_scaled(gu, x, 1e-5)))
        case("SiLU-and-mul quantized in one launch (no GEMM)", lambda i: silu_mul_scaled_quant(gu, x, 1e-5))
    return out
