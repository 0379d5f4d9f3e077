"""The launches a folded fp8 layer runs around its down_proj and gate|up above 16 rows, fused and as
pairs, on CUDA: o_proj's residual add then gate|up's quantizer (``scale_output`` + ``quant_rowwise``)
against ``scale_add_quant``, and the SiLU kernel then down_proj's quantizer (``silu_mul_scaled`` +
``quant_rowwise``) against ``silu_mul_scaled_quant``, at a model's widths. Prints µs per call for each,
per rows count, and the layer-step's saving (both pairs against both fused launches).

Timing: ``--calls`` calls alternating between two input copies in one CUDA graph, the median of
``--reps`` replays divided by the call count (``bench.fp8_kernels.graph_time``). A layer's kernels read
what the launch before them just wrote, so small inputs sit in the L2 cache here as they do there.

    python -m nbgen.bench.fp8_fused [--rows 17 64 256 1024 4096] [--hidden 4096 --intermediate 14336]
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from nbgen.bench.fp8_kernels import graph_time
from nbgen.bench.report import add_json_option, write_json
from nbgen.kernels import fp8_quant
from nbgen.kernels.silu_scaled import silu_mul_scaled, silu_mul_scaled_quant

ROWS = [17, 32, 64, 128, 256, 1024, 4096]


def time_rows(rows: int, hid: int, inter: int, calls: int, reps: int) -> dict[str, float]:
    """µs per call of each pair and fused launch at ``rows`` rows (Llama-like widths hid, inter)."""
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    copies = 2
    acc = [torch.randn(rows, hid, device=dev) * 300 for _ in range(copies)]
    sa, sw = torch.rand(rows, 1, device=dev) * 0.01, torch.rand(1, hid, device=dev) * 0.01
    h = [torch.randn(rows, hid, device=dev).to(bf16) for _ in range(copies)]
    g = (torch.rand(hid, device=dev) + 0.5).to(bf16)
    gu = [(torch.randn(rows, 2 * inter, device=dev) * 20).to(bf16) for _ in range(copies)]

    def add_pair(i: int) -> object:
        fp8_quant.scale_output(acc[i], sa, sw, None, bf16, out=h[i], accumulate=True)
        return fp8_quant.quant_rowwise(h[i], g)

    cases = {
        "o add + quant_rowwise (pair)": add_pair,
        "scale_add_quant (fused)": lambda i: fp8_quant.scale_add_quant(acc[i], sa, sw, h[i], g),
        "silu_mul_scaled + quant_rowwise (pair)": lambda i: fp8_quant.quant_rowwise(silu_mul_scaled(gu[i], h[i], 1e-5)),
        "silu_mul_scaled_quant (fused)": lambda i: silu_mul_scaled_quant(gu[i], h[i], 1e-5),
    }
    return {label: graph_time(fn, copies, calls, reps) * 1e6 for label, fn in cases.items()}


def main(argv: Optional[list[str]] = None) -> None:
    """Time the pairs and the fused launches (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size (default: Llama-3.1-8B's)")
    ap.add_argument("--intermediate", type=int, default=14336, help="intermediate size (default: Llama-3.1-8B's)")
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--reps", type=int, default=10)
    add_json_option(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the fused fp8 launches need a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}  hidden {args.hidden}  intermediate {args.intermediate}")
    results = {}
    for rows in args.rows:
        us = time_rows(rows, args.hidden, args.intermediate, args.calls, args.reps)
        results[rows] = us
        for label, t in us.items():
            print(f"rows={rows:<5} {t:8.2f} µs  {label}")
        pair = us["o add + quant_rowwise (pair)"] + us["silu_mul_scaled + quant_rowwise (pair)"]
        fused = us["scale_add_quant (fused)"] + us["silu_mul_scaled_quant (fused)"]
        print(f"rows={rows:<5} a layer-step: pairs {pair:.2f} µs, fused {fused:.2f} µs ({pair - fused:+.2f} saved)")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
