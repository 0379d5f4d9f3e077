"""FP8 kernel sweep: cuBLAS's fp8 GEMM (``torch._scaled_mm``: tensorwise, row-wise, and the per-feature
linear of ``models/fp8_scaled.py`` as the model runs it) and every
``kernels.fp8_gemm`` launch variant against the bf16 matmul at Llama-3.1-8B's linear shapes, on CUDA. Prints one line per (shape, rows, variant) with µs, GB/s of the bytes the
call must read (weights, their scales, activations) and the speed-up over bf16, then the fastest
variant per rows bucket over all shapes, ready to paste into ``kernels/fp8_gemm.py``'s ``CONFIGS``.

Timing: each candidate runs ``--calls`` times inside one CUDA graph over rotating weight copies (more
bytes than the L2 cache), so launch gaps and cache hits do not flatter small shapes; the median of
``--reps`` graph replays divided by the call count. Also timed: ``torch._scaled_mm`` with 1x128 x 1x128
block scales (x quantized beforehand, where this torch and GPU support it), and the table's pick.
``--cublas``: the cuBLAS rows only (no group-kernel sweep), then the four linears summed per rows
count (one decoder layer's GEMM time) for bf16 and each fp8 path.

    python -m nbgen.bench.fp8_kernels [--rows 1 4 16 64 256] [--quick] [--cublas]
"""
from __future__ import annotations

import argparse
import itertools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from nbgen.kernels import fp8_gemm
from nbgen.kernels.fp8_gemm import GemmConfig
from nbgen.models.fp8_scaled import quantize_weight, scaled_accumulate, scaled_linear

# (name, N, K) of Llama-3.1-8B's decoder linears
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = [1, 4, 16, 64, 256]


def variants(rows: int, quick: bool) -> list[GemmConfig]:
    """The candidate launch shapes for ``rows`` rows."""
    out = []
    warps, stages, splits = ((4,), (3,), (1, 2)) if quick else ((2, 4, 8), (2, 4, 6), (1, 2, 4))
    if rows <= 8:       # FMA products: no padding of the rows to 16
        for bn, sk, w, st in itertools.product((8, 16, 32), splits, warps, stages):
            out.append(GemmConfig(rows, bn, sk, w, st, False, True))
    if rows <= 16:
        for bn, sk, w, st in itertools.product((16, 32, 64), splits, warps, stages):
            out.append(GemmConfig(16, bn, sk, w, st, True, True))
    else:
        for bm, bn, w, st in itertools.product((32, 64, 128), (64, 128), (4, 8), stages):
            if bm <= max(32, rows):
                out.append(GemmConfig(bm, bn, 1, w, st, True, False))
    return out


def graph_time(fn: Callable[[int], object], copies: int, calls: int, reps: int) -> float:
    """Seconds per call of ``fn(i)`` (i: the weight copy), ``calls`` of them captured in one graph."""
    for i in range(copies):   # compile and warm outside the capture
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(calls):
            fn(c % copies)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[reps // 2] / calls


def cublas_variants(n: int, k: int, rows: int, x: torch.Tensor, wq: list[torch.Tensor], calls: int,
                    reps: int) -> list[tuple[str, float, float]]:
    """cuBLAS's fp8 GEMM at one shape: tensorwise and row-wise ``_scaled_mm`` on a pre-quantized x, and
    ``scaled_linear`` end to end (up to 16 rows the streaming fp8 kernel, above it the quantize launch and
    cuBLAS) with one scale per feature and per tensor, and ``scaled_accumulate`` (into a residual stream)."""
    dev = x.device
    nbytes = n * k + n * 4 + rows * k * 2 + rows * n * 2
    sa0, sw0 = torch.full((), 0.01, device=dev), torch.full((), 0.002, device=dev)
    sa1, sw1 = torch.full((rows, 1), 0.01, device=dev), torch.full((1, n), 0.002, device=dev)
    xq = (x.float() / 0.01).to(torch.float8_e4m3fn)
    into = torch.zeros(rows, n, device=dev, dtype=torch.bfloat16)       # the residual stream (stays finite)
    per_feature = [quantize_weight(w.float()) for w in wq[:2]]          # searched scales: differ per row
    per_tensor = [quantize_weight(w.float(), sw0) for w in wq[:2]]
    for fw in per_feature + per_tensor:                                  # rotate the big copies through them
        fw.q = wq[0]
    cases = {
        "cuBLAS _scaled_mm tensorwise (x pre-quantized)":
            lambda i: torch._scaled_mm(xq, wq[i].t(), scale_a=sa0, scale_b=sw0, out_dtype=torch.bfloat16),
        "cuBLAS _scaled_mm row-wise (x pre-quantized)":
            lambda i: torch._scaled_mm(xq, wq[i].t(), scale_a=sa1, scale_b=sw1, out_dtype=torch.bfloat16),
        "scaled_linear per-feature (the model's linear)": lambda i: scaled_linear(x, _with(per_feature[0], wq[i])),
        "scaled_linear one weight scale (the model's linear)": lambda i: scaled_linear(x, _with(per_tensor[0], wq[i])),
        "scaled_accumulate per-feature (the model's o / down: the residual add)":
            lambda i: scaled_accumulate(x, _with(per_feature[0], wq[i]), into),
    }
    out = []
    for label, fn in cases.items():
        try:
            t = graph_time(fn, len(wq), calls, reps)
        except (RuntimeError, ValueError) as e:
            print(f"  N={n} K={k} rows={rows}: {label} unsupported here ({str(e).splitlines()[0][:90]})")
            continue
        out.append((label, t, nbytes / t / 1e9))
    return out


def _with(fw: object, q: torch.Tensor) -> object:
    """``fw`` reading the weight copy ``q`` (the rotation; the scales stay)."""
    fw.q = q
    return fw


def run_shape(name: str, n: int, k: int, rows: int, quick: bool, calls: int, reps: int,
              cublas_only: bool = False) -> list[tuple[str, float, float]]:
    """(variant, seconds per call, read GB/s) for one shape and row count, bf16 first."""
    dev = torch.device("cuda")
    g = -(-k // fp8_gemm.GROUP)
    copies = max(2, (400 << 20) // (n * k))                 # > 400 MB of fp8 weights in rotation
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
    wq = [torch.randn(n, k, device=dev).to(torch.float8_e4m3fn) for _ in range(copies)]
    sw = [torch.rand(n, g, device=dev) / 448 for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    fp8_bytes = n * k + n * g * 4 + rows * k * 2 + rows * n * 2
    out = []
    t = graph_time(lambda i: F.linear(x, w16[i % len(w16)]), len(w16), calls, reps)
    out.append(("bf16 F.linear", t, (2 * n * k + rows * k * 2 + rows * n * 2) / t / 1e9))
    out += cublas_variants(n, k, rows, x, wq, calls, reps)
    if cublas_only:
        return out
    xq, sx = fp8_gemm.per_token_group_quant_fp8(x)
    sx_t = sx.t().contiguous().t()                          # cuBLASLt wants outer-dim-major block scales
    try:
        t = graph_time(lambda i: torch._scaled_mm(xq, wq[i].t(), scale_a=sx_t, scale_b=sw[i].t(),
                                                   out_dtype=torch.bfloat16), copies, calls, reps)
        out.append(("torch._scaled_mm 1x128 (x pre-quantized)", t, fp8_bytes / t / 1e9))
    except (RuntimeError, ValueError) as e:
        print(f"  {name} rows={rows}: torch._scaled_mm 1x128 unsupported here ({str(e).splitlines()[0][:90]})")
    t = graph_time(lambda i: fp8_gemm.fp8_group_gemm(x, None, wq[i], sw[i], None, torch.bfloat16),
                    copies, calls, reps)
    out.append((f"table {fp8_gemm.pick_config(rows)}", t, fp8_bytes / t / 1e9))
    for cfg in variants(rows, quick):
        try:
            t = graph_time(lambda i: fp8_gemm.fp8_group_gemm(x, None, wq[i], sw[i], None, torch.bfloat16, cfg),
                            copies, calls, reps)
        except Exception as e:   # a launch shape this GPU cannot compile (shared memory, registers)
            print(f"  {name} rows={rows} {cfg}: failed ({type(e).__name__})")
            continue
        out.append((str(cfg), t, fp8_bytes / t / 1e9))
    return out


def main(argv: Optional[list[str]] = None) -> None:
    """Run the sweep and print it (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    ap.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    ap.add_argument("--quick", action="store_true", help="a few variants per row count")
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cublas", action="store_true", help="cuBLAS fp8 paths only, and the per-layer sums")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the fp8 kernel sweep needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}")
    totals: dict[int, dict[str, list[float]]] = {}     # rows -> variant -> µs per shape
    layer: dict[int, dict[str, float]] = {}             # rows -> bf16 / cuBLAS path -> µs over the shapes
    for rows in args.rows:
        for name, n, k in [s for s in SHAPES if s[0] in args.shapes]:
            res = run_shape(name, n, k, rows, args.quick, args.calls, args.reps, args.cublas)
            for variant, t, _ in res:
                if not variant.startswith(("GemmConfig", "table", "torch._scaled_mm 1x128")):
                    layer.setdefault(rows, {}).setdefault(variant, 0.0)
                    layer[rows][variant] += t * 1e6
            bf16 = res[0][1]
            for variant, t, gbs in sorted(res, key=lambda r: r[1]):
                print(f"{name:<8} N={n:<6} K={k:<6} rows={rows:<4} {t * 1e6:9.1f} µs {gbs:8.0f} GB/s "
                      f"{bf16 / t:5.2f}x bf16  {variant}")
                if variant.startswith("GemmConfig"):
                    totals.setdefault(rows, {}).setdefault(variant, []).append(t * 1e6)
    print("\none layer's linears (sum over the shapes, µs):")
    for rows, by in layer.items():
        bf16 = by.get("bf16 F.linear", float("nan"))
        for variant, us in by.items():
            print(f"  rows={rows:<4} {us:8.1f} µs {bf16 / us:5.2f}x bf16  {variant}")
    if args.cublas:
        return
    print_fastest(totals, "fastest variant per rows over the shapes (sum of µs):")


def print_fastest(totals: dict[int, dict[str, list[float]]], title: str) -> None:
    """Per rows count, the variant with the least µs summed over the shapes (among those that ran on
    every shape): ``totals`` rows -> variant -> µs per shape."""
    print("\n" + title)
    for rows, by in totals.items():
        full = {v: sum(ts) for v, ts in by.items() if len(ts) == max(len(t) for t in by.values())}
        best = min(full, key=full.get)
        print(f"  {rows}: {best}   # {full[best]:.1f} µs")


if __name__ == "__main__":
    main()
