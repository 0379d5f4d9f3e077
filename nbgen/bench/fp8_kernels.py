"""FP8 kernel sweep on CUDA, at Llama-3.1-8B's linear shapes, against the bf16 matmul.

``--kernel gemv`` (default; rows 1, 2, 4, 8, 16): the launch shapes of ``kernels/fp8_gemv.py`` (weight
rows per program, groups per step, split-K waves and reduction, warps, stages). ``--kernel gemm`` (rows
1-256): the tile kernel ``kernels/fp8_gemm.py``'s variants. Prints one line per (shape, rows, variant)
with µs, GB/s of the bytes the call must read (weights, their scales, activations, outputs) and the
speed-up over bf16 ``F.linear`` (cuBLAS), next to nbgen's bf16 decode kernel (``small_gemm``, what a bf16
engine runs at these rows), ``torch._scaled_mm`` with 1x128 block scales where this torch takes them,
and the tables' current picks. Then, per rows bucket, the variant with the least µs summed over the
shapes (each runs once per decoder layer), printed as a table ready to paste into the kernel's ``CONFIGS``.

Timing: each candidate runs ``--calls`` times inside one CUDA graph over rotating weight copies (more
bytes than the L2 cache), so launch gaps and cache hits do not flatter small shapes; the median of
``--reps`` graph replays divided by the call count. The grid is pruned to keep the sweep (Triton's
compiles included) to a few minutes; ``--quick`` runs a handful of variants.

    python -m nbgen.bench.fp8_kernels [--kernel gemv|gemm] [--rows 1 2 4 8 16] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import time
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from nbgen.kernels import fp8_gemm, fp8_gemv, small_gemm
from nbgen.kernels.fp8_gemm import GemmConfig
from nbgen.kernels.fp8_gemv import GemvConfig

# (name, N, K) of Llama-3.1-8B's decoder linears
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = {"gemv": [1, 2, 4, 8, 16], "gemm": [1, 4, 16, 64, 256]}
Config = Union[GemmConfig, GemvConfig]

# (block_n, groups, num_warps) of the GEMV sweep: 16-64 e4m3 weight bytes per thread and step (16-byte
# vectors), 2-16 KB per program and step. At one row 64 bytes a thread take ~255 registers (ptxas for
# sm_90a): 2 programs an SM; 32x4 tiles on 8 warps and 64x1 on 4 spill, so they are not swept.
GEMV_TILES = [(8, 4, 2), (8, 8, 4), (16, 4, 4), (32, 2, 4), (16, 8, 8), (8, 4, 4), (16, 2, 4), (16, 4, 8),
              (32, 2, 8), (8, 2, 4), (16, 2, 8), (8, 4, 8)]
GEMV_TILES_QUICK = [(8, 8, 4), (16, 4, 4), (16, 8, 8), (16, 2, 4), (16, 2, 8)]
MAX_ACC = 128    # fp32 accumulators per thread (rows x weight elements per thread and step)


def tile_bytes(bn: int, g: int, warps: int) -> int:
    """e4m3 weight bytes one thread loads per step."""
    return bn * g * 128 // (32 * warps)


def gemv_variants(rows: int, quick: bool) -> list[GemvConfig]:
    """The GEMV candidates for ``rows`` rows: each tile whose accumulators fit (``MAX_ACC``) without
    split-K and split to >= 4 / 8 programs per SM (the last program of a tile sums the partials), plus
    fp32 atomics for two tiles and two stages for one; none where no tile fits (16 rows: the tile kernel)."""
    bm = 1 << (rows - 1).bit_length()
    tiles = [t for t in (GEMV_TILES_QUICK if quick else GEMV_TILES) if bm * tile_bytes(*t) <= MAX_ACC]
    out = []
    for bn, g, w in tiles:
        for waves in ((0, 4) if quick else (0, 4, 8)):
            out.append(GemvConfig(bn, g, waves, "last", w, 1))
    for bn, g, w in tiles[:2]:
        out.append(GemvConfig(bn, g, 4, "atomic", w, 1))
    if tiles and not quick:
        out.append(GemvConfig(tiles[0][0], tiles[0][1], 4, "last", tiles[0][2], 2))
    return out


def gemm_variants(rows: int, quick: bool) -> list[GemmConfig]:
    """The tile kernel's candidate launch shapes for ``rows`` rows."""
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


def _graph_time(fn: Callable[[int], object], copies: int, calls: int, reps: int) -> float:
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


class ShapeWeights:
    """Rotating copies of one shape's weights: bf16 and e4m3 with 1x128 scales (> 400 MB of fp8 in all)."""

    def __init__(self, n: int, k: int) -> None:
        dev = torch.device("cuda")
        self.n, self.k, g = n, k, -(-k // fp8_gemm.GROUP)
        self.copies = max(2, (400 << 20) // (n * k))
        self.w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, self.copies // 2))]
        self.wq = [torch.randn(n, k, device=dev).to(torch.float8_e4m3fn) for _ in range(self.copies)]
        self.sw = [torch.rand(n, g, device=dev) / 448 for _ in range(self.copies)]

    def fp8_bytes(self, rows: int) -> int:
        """Bytes an fp8 call must move: weights, scales, x in bf16, y in bf16."""
        return self.n * self.k + self.sw[0].numel() * 4 + rows * self.k * 2 + rows * self.n * 2


def run_shape(w: ShapeWeights, rows: int, kernel: str, quick: bool, calls: int,
              reps: int) -> list[tuple[str, float, float]]:
    """(variant, seconds per call, GB/s) for one shape and row count, bf16 ``F.linear`` first."""
    n, k = w.n, w.k
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    b16 = 2 * n * k + rows * k * 2 + rows * n * 2
    nw = len(w.w16)
    out = [("bf16 F.linear", _graph_time(lambda i: F.linear(x, w.w16[i % nw]), nw, calls, reps))]
    if rows <= small_gemm.MAX_ROWS:
        out.append(("bf16 small_gemm (nbgen)", _graph_time(lambda i: small_gemm.small_gemm(x, w.w16[i % nw]),
                                                           nw, calls, reps)))
    res = [(v, t, b16 / t / 1e9) for v, t in out]
    xq, sx = fp8_gemm.per_token_group_quant_fp8(x)
    sx_t = sx.t().contiguous().t()                          # cuBLASLt wants outer-dim-major block scales
    cands: list[tuple[str, Callable[[int], object]]] = [
        ("torch._scaled_mm 1x128 (x pre-quantized)",
         lambda i: torch._scaled_mm(xq, w.wq[i].t(), scale_a=sx_t, scale_b=w.sw[i].t(), out_dtype=torch.bfloat16)),
        (f"fp8_gemm table {fp8_gemm.pick_config(rows)}",
         lambda i: fp8_gemm.fp8_group_gemm(x, None, w.wq[i], w.sw[i], None, torch.bfloat16))]
    if rows <= fp8_gemv.MAX_ROWS and fp8_gemv.pick_config(rows) is not None:
        cands.append((f"fp8_gemv table {fp8_gemv.pick_config(rows)}",
                      lambda i: fp8_gemv.fp8_gemv(x, w.wq[i], w.sw[i], None, torch.bfloat16)))
    for cfg in (gemv_variants(rows, quick) if kernel == "gemv" else gemm_variants(rows, quick)):
        if isinstance(cfg, GemvConfig):
            cands.append((str(cfg), lambda i, c=cfg: fp8_gemv.fp8_gemv(x, w.wq[i], w.sw[i], None, torch.bfloat16, c)))
        else:
            cands.append((str(cfg), lambda i, c=cfg: fp8_gemm.fp8_group_gemm(x, None, w.wq[i], w.sw[i], None,
                                                                             torch.bfloat16, c)))
    for name, fn in cands:
        try:
            t = _graph_time(fn, w.copies, calls, reps)
        except Exception as e:   # a launch shape this GPU cannot compile, or a torch without the recipe
            print(f"  N={n} K={k} rows={rows} {name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:90]})")
            continue
        res.append((name, t, w.fp8_bytes(rows) / t / 1e9))
    return res


def winners_table(totals: dict[int, dict[str, list[float]]], bf16: dict[int, float], n_shapes: int) -> str:
    """Per rows bucket the variant (a ``GemvConfig(...)`` / ``GemmConfig(...)`` string, or "None": the tile
    kernel's table) with the least µs summed over all shapes, as ``CONFIGS`` source lines."""
    lines = ["CONFIGS = {"]
    for rows, by in sorted(totals.items()):
        full = {v: sum(ts) for v, ts in by.items() if len(ts) == n_shapes}
        if full:
            best = min(full, key=full.get)
            lines.append(f"    {rows}: {best},   # {full[best]:.1f} µs over the shapes, "
                         f"{bf16[rows] / full[best]:.2f}x bf16 F.linear")
    return "\n".join(lines + ["}"])


def main(argv: Optional[list[str]] = None) -> None:
    """Run the sweep and print it (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=["gemv", "gemm"], default="gemv")
    ap.add_argument("--rows", type=int, nargs="*", default=None)
    ap.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    ap.add_argument("--quick", action="store_true", help="a few variants per row count")
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the fp8 kernel sweep needs a CUDA GPU")
    rows_list = args.rows or ROWS[args.kernel]
    print(f"device: {torch.cuda.get_device_name()}")
    t0 = time.perf_counter()
    totals: dict[int, dict[str, list[float]]] = {}     # rows -> variant -> µs per shape
    bf16: dict[int, float] = {}                          # rows -> bf16 F.linear µs summed over the shapes
    shapes = [s for s in SHAPES if s[0] in args.shapes]
    for name, n, k in shapes:
        w = ShapeWeights(n, k)
        for rows in rows_list:
            res = run_shape(w, rows, args.kernel, args.quick, args.calls, args.reps)
            base = res[0][1]
            bf16[rows] = bf16.get(rows, 0.0) + base * 1e6
            for variant, t, gbs in sorted(res, key=lambda r: r[1]):
                print(f"{name:<8} N={n:<6} K={k:<6} rows={rows:<4} {t * 1e6:9.1f} µs {gbs:8.0f} GB/s "
                      f"{base / t:5.2f}x bf16  {variant}")
                if args.kernel == "gemv" and variant.startswith("fp8_gemm table"):
                    variant = "None"      # the GEMV table's entry for "the tile kernel serves these rows"
                if variant.startswith(("GemvConfig", "GemmConfig", "None")):
                    totals.setdefault(rows, {}).setdefault(variant, []).append(t * 1e6)
        del w
        torch.cuda.empty_cache()
    print(f"\nsweep took {time.perf_counter() - t0:.0f} s. Fastest variant per rows (sum of µs over "
          f"{', '.join(s[0] for s in shapes)}), for kernels/fp8_{args.kernel}.py:")
    print(winners_table(totals, bf16, len(shapes)))


if __name__ == "__main__":
    main()
