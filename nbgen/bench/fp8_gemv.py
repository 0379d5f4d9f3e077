"""FP8 GEMV bench: nbgen's streaming fp8 kernel (``kernels/fp8_small_gemm.py``) against cuBLAS's fp8 GEMM
and the bf16 streaming kernel (``kernels/small_gemm.py``) at Llama-3.1-8B's decoder linears, 1-16 rows,
on CUDA, in one run.

Per (shape, rows): µs per call and TB/s of weight bytes read (fp8: N x K bytes, bf16: 2 N x K) for
- ``bf16 small_gemm``: the bf16 decode kernel (its SiLU-and-mul epilogue on the gate|up+silu row),
- ``cuBLAS fp8 tensorwise``: ``torch._scaled_mm`` with 0-dim scales on an x quantized beforehand (the
  GEMM alone),
- ``quant + cuBLAS fp8``: ``quant_rowwise`` then that GEMM (two launches: the per-linear path without
  the streaming kernel at one row),
- ``fp8 kernel``: ``fp8_small_gemm`` with ``pick_config``'s launch (quantization of x included), and
  the call a folded layer makes (the norm weight as column scale for qkv and gate|up, the residual add
  for o and down),
then one decoder layer's four linears summed for bf16 and the fp8 kernel. On the gate|up+silu row the
bf16 kernel applies SiLU-and-mul in its epilogue, the fp8 kernel is followed by the SiLU-and-mul launch
(the folded call by the scaled one) as in the model, except at one row, where the folded call is the
one-row kernel with SiLU-and-mul in its epilogue (``kernels/fp8_row_gemv.py``; the former pair shown
too). ``--sweep``: each candidate launch
of the fp8 kernel per (shape, rows), the fastest printed (one row: every launch of the one-row kernel,
with x quantized by its own launch and on an e4m3 x given), and the fastest per rows bucket over the
shapes (for ``pick_config``).

The kernels as a decode step runs them, layer after layer with RoPE and attention between:
``nbgen.bench.decode_layers``.

Timing: ``fp8_kernels.graph_time``: ``--calls`` calls in one CUDA graph over rotating weight copies
(more bytes than the L2 cache), median of ``--reps`` replays.

    python -m nbgen.bench.fp8_gemv [--rows 1 4 16] [--sweep]
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from nbgen.bench.floor import copy_bandwidth
from nbgen.bench.fp8_kernels import graph_time, print_fastest
from nbgen.kernels import fp8_quant, gpu_ops, small_gemm
from nbgen.kernels.silu_scaled import silu_mul_scaled
from nbgen.kernels.fp8_row_gemv import fp8_row_gemv
from nbgen.kernels.fp8_row_gemv import pick_config as row_pick_config
from nbgen.kernels.fp8_small_gemm import Fp8GemvConfig, fp8_small_gemm, pick_config

# (name, N, K, SiLU-and-mul epilogue) of Llama-3.1-8B's decoder linears
SHAPES = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, False),
          ("gate_up+silu", 28672, 4096, True), ("down", 4096, 14336, False)]
LAYER = ("qkv", "o", "gate_up+silu", "down")    # one decoder layer's linears at a decode step
ROWS = [1, 4, 16]


# one-row kernel launches (block_n, block_k, warps, x_once) --sweep tries (no register spills on sm_90)
ROW_CANDIDATES = [(16, 2048, 8, True), (16, 2048, 8, False), (8, 2048, 4, True), (8, 2048, 4, False),
                  (32, 2048, 16, True), (16, 4096, 16, False)]


def candidates(rows: int) -> list[Fp8GemvConfig]:
    """The multi-row kernel's launches ``--sweep`` tries at ``rows`` rows (one row: ``ROW_CANDIDATES``)."""
    if rows == 1:
        return []
    out = [Fp8GemvConfig(16, bn, bk, 4, 4, pre) for bn, bk in ((32, 128), (32, 256), (64, 128), (64, 256), (128, 128))
           for pre in (False, True)]
    return out + [Fp8GemvConfig(16, 64, 256, 8, 4, pre) for pre in (False, True)]


def _prequant_row(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, y: torch.Tensor,
                  config: tuple) -> torch.Tensor:
    """``quant_rowwise`` (one launch) then the one-row kernel on its e4m3 x."""
    xq, sa = fp8_quant.quant_rowwise(x)
    return fp8_row_gemv(xq, wq, sw, y, config=config, x_scale=sa)


def _timed(fn: Callable[[int], object], copies: int, args: argparse.Namespace) -> Optional[float]:
    try:
        return graph_time(fn, copies, args.calls, args.reps)
    except Exception as e:   # noqa: BLE001 - a launch this GPU cannot compile (shared memory, registers)
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
        return None


def run_shape(name: str, n: int, k: int, silu: bool, rows: int, args: argparse.Namespace
              ) -> dict[str, float]:
    """label -> seconds per call at one shape and row count (printed as it goes)."""
    dev = torch.device("cuda")
    copies = max(2, (400 << 20) // (n * k))                 # > 400 MB of fp8 weights in rotation
    wq = [torch.randn(n, k, device=dev).mul_(0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
    sw = torch.rand(n, device=dev) / 448
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    xq, sa = fp8_quant.quant_rowwise(x)
    s0 = torch.full((), 1e-3, device=dev)
    res: dict[str, Optional[float]] = {
        "bf16 small_gemm": _timed(lambda i: small_gemm.small_gemm(x, w16[i % len(w16)], silu_mul=silu),
                                  len(w16), args)}
    if not silu:
        res["cuBLAS fp8 tensorwise"] = _timed(
            lambda i: torch._scaled_mm(xq, wq[i].t(), scale_a=s0, scale_b=s0, out_dtype=torch.bfloat16), copies, args)
        res["quant + cuBLAS fp8"] = _timed(lambda i: torch._scaled_mm(
            fp8_quant.quant_rowwise(x)[0], wq[i].t(), scale_a=s0, scale_b=s0, out_dtype=torch.bfloat16), copies, args)
    cfg = tuple(pick_config(rows, n, k)) if rows > 1 else row_pick_config(n, k)
    act = gpu_ops.silu_and_mul if silu else (lambda y: y)
    res[f"fp8 kernel {cfg}"] = _timed(lambda i: act(fp8_small_gemm(x, wq[i], sw)), copies, args)
    # the call a folded fp8 layer makes: the norm weight as column scale (qkv, gate|up: then the scaled
    # SiLU-and-mul), the residual add (o, down)
    g = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
    stream = torch.zeros(rows, n, device=dev, dtype=torch.bfloat16)
    fold = {"qkv": dict(col_scale=g), "gate_up+silu": dict(col_scale=g),
            "o": dict(accumulate=stream), "down": dict(accumulate=stream)}.get(name)
    fold_act = (lambda y: silu_mul_scaled(y, x, 1e-5)) if silu else (lambda y: y)
    if silu and rows == 1:   # the model's call: SiLU-and-mul in the one-row kernel's epilogue
        act1 = torch.empty(1, n // 2, device=dev, dtype=torch.bfloat16)
        res["fp8 kernel, folded layer's call"] = _timed(
            lambda i: fp8_row_gemv(x, wq[i], sw, act1, col_scale=g, silu_eps=1e-5), copies, args)
        res["fp8 kernel, folded: projection + SiLU launch"] = _timed(
            lambda i: fold_act(fp8_small_gemm(x, wq[i], sw, **fold)), copies, args)
        if args.sweep:
            for c in ROW_CANDIDATES:
                res[f"sweep row SiLU epilogue {c}"] = _timed(
                    lambda i: fp8_row_gemv(x, wq[i], sw, act1, col_scale=g, silu_eps=1e-5, config=c), copies, args)
    elif fold is not None:
        res["fp8 kernel, folded layer's call"] = _timed(
            lambda i: fold_act(fp8_small_gemm(x, wq[i], sw, **fold)), copies, args)
    if args.sweep and rows == 1 and not silu:
        y1 = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        for c in ROW_CANDIDATES:
            t = _timed(lambda i: fp8_row_gemv(x, wq[i], sw, y1, config=c), copies, args)
            if t is not None:
                res[f"sweep row {c}"] = t
        for c in ROW_CANDIDATES[:1]:
            # x quantized by its own launch first, and the kernel alone on that e4m3 x (its streaming rate)
            res[f"quant launch + row kernel {c}"] = _timed(lambda i: _prequant_row(x, wq[i], sw, y1, c), copies, args)
            res[f"row kernel on e4m3 x {c}"] = _timed(
                lambda i: fp8_row_gemv(xq, wq[i], sw, y1, config=c, x_scale=sa), copies, args)
    if args.sweep and not silu:
        for c in candidates(rows):
            t = _timed(lambda i: fp8_small_gemm(x, wq[i], sw, config=c), copies, args)
            if t is not None:
                res[f"sweep {tuple(c)}"] = t
    out = {label: t for label, t in res.items() if t is not None}
    bf16 = out.get("bf16 small_gemm", float("nan"))
    shown = [(label, t) for label, t in sorted(out.items(), key=lambda r: r[1]) if not label.startswith("sweep")]
    sweep = sorted((t, label) for label, t in out.items() if label.startswith("sweep"))
    if rows == 1:     # few candidates: each one
        shown += [(label, t) for t, label in sweep]
    elif sweep:
        shown.append((f"best {sweep[0][1]}", sweep[0][0]))
    for label, t in shown:
        wbytes = n * k * (2 if label.startswith("bf16") else 1)
        tbs = wbytes / t / 1e12
        print(f"{name:<13} N={n:<6} K={k:<6} rows={rows:<3} {t * 1e6:8.1f} µs {tbs:5.2f} TB/s "
              f"({tbs * 1e12 / args.copy_bw:4.0%} of copy) {bf16 / t:5.2f}x bf16  {label}")
    return out


def main(argv: Optional[list[str]] = None) -> None:
    """Run the bench and print it (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    ap.add_argument("--sweep", action="store_true", help="every candidate launch of the fp8 kernel")
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the fp8 GEMV bench needs a CUDA GPU")
    args.copy_bw = copy_bandwidth(torch.device("cuda"))
    gpu_ops.enable_fused()          # flashinfer's SiLU-and-mul after the unfused gate|up
    print(f"device: {torch.cuda.get_device_name()}, copy {args.copy_bw / 1e12:.2f} TB/s")
    layer: dict[int, dict[str, float]] = {}
    best: dict[int, dict[str, list[float]]] = {}        # rows -> sweep label -> µs per (non-silu) shape
    for rows in args.rows:
        for name, n, k, silu in SHAPES:
            out = run_shape(name, n, k, silu, rows, args)
            if name in LAYER:
                for label, t in out.items():
                    key = label.split(" (")[0]
                    if key in ("bf16 small_gemm", "fp8 kernel", "fp8 kernel, folded layer's call"):
                        layer.setdefault(rows, {}).setdefault(key, 0.0)
                        layer[rows][key] += t * 1e6
            if not silu:
                for label, t in out.items():
                    if label.startswith("sweep"):
                        best.setdefault(rows, {}).setdefault(label, []).append(t * 1e6)
    print("\none layer's linears (qkv, o, gate|up with SiLU, down), µs:")
    nan = float("nan")
    for rows, by in layer.items():
        bf16, fp8, fold = (by.get(k, nan) for k in ("bf16 small_gemm", "fp8 kernel", "fp8 kernel, folded layer's call"))
        print(f"  rows={rows:<3} bf16 {bf16:7.1f}   fp8 kernel {fp8:7.1f} ({bf16 / fp8:4.2f}x)   "
              f"folded layer's calls {fold:7.1f} ({bf16 / fold:4.2f}x)")
    if best:
        print_fastest(best, "fastest sweep launch per rows over qkv, o, gate_up, down (sum of µs):")


if __name__ == "__main__":
    main()
