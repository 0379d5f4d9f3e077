"""The element-wise kernels of a folded layer-step at a model's widths, and their launch candidates, on
CUDA: the SiLU kernel with the fp8 quantizer (``silu_mul_scaled_quant``) and without it
(``silu_mul_scaled_kernel``), the RoPE kernel with the K/V write into e4m3 and bf16 pages
(``qk_norm_rope_`` with a row scale), and Qwen3's per-head norm form. Prints µs a launch and TB/s of the
bytes it moves, per rows count, for each case's default launch and each candidate; every output compared
bit for bit with the default's, and with ``--baseline-root R`` with the tree at R (a main checkout: this
file runs again there, its default launches timed and their outputs saved, in the same call).

Timing: ``--calls`` launches alternating between two input copies in one CUDA graph, the median of
``--reps`` replays divided by the call count (``bench.fp8_kernels.graph_time``).

    python -m nbgen.bench.ew_kernels [--rows 64 128 256 320 512 8192] [--baseline-root R]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Optional

import torch

from nbgen.bench.fp8_kernels import graph_time
from nbgen.bench.report import add_json_option, write_json
from nbgen.kernels import qk_norm_rope, silu_scaled
from nbgen.kernels.kv_write import KVTarget

ROWS = [64, 128, 256, 320, 512, 8192]
HID, INTER, HQ, HKV, D, PAGE = 4096, 14336, 32, 8, 128, 16      # Llama-3.1-8B
QWEN3 = (1024, 16, 8)                                           # Qwen3-0.6B: hidden, q heads, kv heads
# The launch classes exist in this tree only; the baseline role runs this file against a tree without
# them and times the default launches alone.
SILU_LAUNCH = getattr(silu_scaled, "SiluQuantLaunch", None)
ROPE_LAUNCH = getattr(qk_norm_rope, "RopeLaunch", None)

Inputs = dict[str, torch.Tensor]


def silu_inputs(rows: int, seed: int) -> Inputs:
    g = torch.Generator(device="cuda").manual_seed(seed)
    gu = (torch.randn(rows, 2 * INTER, device="cuda", generator=g) * 20).to(torch.bfloat16)
    return {"gu": gu, "h": torch.randn(rows, HID, device="cuda", generator=g).to(torch.bfloat16)}


def rope_inputs(rows: int, seed: int, hid: int = HID, hq: int = HQ, hkv: int = HKV,
                cache: torch.dtype = torch.float8_e4m3fn) -> Inputs:
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = rows // PAGE + 2
    return {"qkv": (torch.randn(rows, (hq + 2 * hkv) * D, device="cuda", generator=g) * 3).to(torch.bfloat16),
            "h": torch.randn(rows, hid, device="cuda", generator=g).to(torch.bfloat16),
            "pos": torch.randint(0, 8000, (rows,), device="cuda", generator=g),
            "slots": torch.randperm(pages * PAGE, device="cuda", generator=g)[:rows],
            "kc": torch.zeros(pages, hkv, PAGE, D, device="cuda", dtype=cache),
            "vc": torch.zeros(pages, hkv, PAGE, D, device="cuda", dtype=cache),
            "cs": torch.randn(8192, D, device="cuda", generator=g),
            "w": (torch.rand(2, D, device="cuda", generator=g) + 0.5).to(torch.bfloat16)}


def run_rope(x: Inputs, launch: Any, hq: int = HQ, hkv: int = HKV, norm: bool = False) -> list[torch.Tensor]:
    kw = {} if launch is None else {"launch": launch}
    qw, kw_ = (x["w"][0], x["w"][1]) if norm else (None, None)
    qk_norm_rope.qk_norm_rope_(x["qkv"], x["pos"], qw, kw_, 1e-6, x["cs"], hq, hkv, D,
                               kv=KVTarget(x["kc"], x["vc"], x["slots"], 0.5, 0.25), row_scale=(x["h"], 1e-5), **kw)
    return [x["qkv"], x["kc"], x["vc"]]


def run_silu_quant(x: Inputs, launch: Any) -> list[torch.Tensor]:
    kw = {} if launch is None else {"launch": launch}
    r = silu_scaled.silu_mul_scaled_quant(x["gu"], x["h"], 1e-5, **kw)
    return [r.q, r.scale]


def cases(baseline: bool) -> dict[str, tuple[Callable[[int, int], Inputs], Callable[[Inputs, Any], list],
                                             Callable[[int], int], list[tuple[str, Any]]]]:
    """name -> (inputs(rows, seed), run(inputs, launch), bytes moved(rows), [(candidate, launch)])."""
    silu_c: list[tuple[str, Any]] = []
    rope_c: list[tuple[str, Any]] = []
    if not baseline:
        # main's layout (one masked 16 384-column block, 16 warps), the pieces at other warp counts
        for pieces, nw in [((16384, 0, 0), 16), ((8192, 4096, 2048), 16), ((8192, 4096, 2048), 32)]:
            silu_c.append((f"pieces {pieces} {nw} warps", SILU_LAUNCH(pieces, 0, 1, nw)))
        for groups, nw in [(1, 4), (2, 4), (2, 8), (4, 4), (8, 2)]:     # the default: 1 group, 8 warps
            rope_c.append((f"{groups} groups {nw} warps", ROPE_LAUNCH(groups, nw)))
    silu_bytes = lambda r: r * (2 * INTER * 2 + HID * 2 + INTER + 4)
    rope_bytes = lambda r, hid=HID, hq=HQ, hkv=HKV, c=1: r * (hid * 2 + (hq + 2 * hkv) * D * 2 + (hq + hkv) * D * 2
                                                               + 2 * hkv * D * c + D * 4 + 16)
    return {
        "silu+quant fp8": (silu_inputs, run_silu_quant, silu_bytes, silu_c),
        "silu bf16": (silu_inputs, lambda x, lc: [silu_scaled.silu_mul_scaled_kernel(x["gu"], x["h"], 1e-5)],
                      lambda r: r * (2 * INTER * 2 + HID * 2 + INTER * 2), []),
        "rope fp8 kv": (rope_inputs, run_rope, rope_bytes, rope_c),
        "rope bf16 kv": (lambda r, s: rope_inputs(r, s, cache=torch.bfloat16), run_rope,
                         lambda r: rope_bytes(r, c=2), rope_c[:4]),
        "rope qwen3 norm": (lambda r, s: rope_inputs(r, s, QWEN3[0], QWEN3[1], QWEN3[2], torch.bfloat16),
                            lambda x, lc: run_rope(x, lc, QWEN3[1], QWEN3[2], norm=True),
                            lambda r: rope_bytes(r, QWEN3[0], QWEN3[1], QWEN3[2], 2),
                            [(n, lc) for n, lc in rope_c if lc.groups == 1]),    # the norm form: one program a token
    }


def measure(rows_list: list[int], calls: int, reps: int, baseline: bool) -> dict[str, Any]:
    """{case: {rows: {label: (µs, outputs on fresh inputs)}}} for the default launch and the candidates."""
    out: dict[str, Any] = {}
    for name, (make, run, nbytes, cands) in cases(baseline).items():
        out[name] = {}
        for rows in rows_list:
            res = {}
            for label, lc in [("default", None)] + cands:
                xs = [make(rows, 1), make(rows, 2)]
                try:
                    us = graph_time(lambda i: run(xs[i], lc), 2, calls, reps) * 1e6
                except ValueError as e:          # a candidate this shape does not take
                    print(f"  {name} rows={rows} {label}: {e}")
                    continue
                fresh = make(rows, 0)
                got = [t.clone() for t in run(fresh, lc)]
                torch.cuda.synchronize()
                res[label] = (us, nbytes(rows) / us / 1e6, [t.cpu() for t in got])
            out[name][rows] = res
    return out


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Outputs equal byte for byte (fp8 through uint8 views; NaNs compare by their bits too)."""
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                    for x, y in zip(a, b))


def report(mine: dict[str, Any], base: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Print each case's table; returns the JSON summary (no tensors)."""
    summary: dict[str, Any] = {}
    for name, per_rows in mine.items():
        print(f"\n== {name}")
        summary[name] = {}
        for rows, res in per_rows.items():
            ref = res["default"][2]
            main = base[name][rows]["default"] if base else None
            if main:
                print(f"rows={rows:<5} {'main default':<32} {main[0]:8.2f} µs {main[1]:6.2f} TB/s")
            summary[name][rows] = {"main": main[0] if main else None}
            for label, (us, tbs, outs) in res.items():
                eq = "= default" if same_bits(outs, ref) else "DIFFERS from default"
                if main:
                    eq += ", = main" if same_bits(outs, main[2]) else ", DIFFERS from main"
                    eq += f", {main[0] / us:.2f}x main"
                print(f"rows={rows:<5} {label:<32} {us:8.2f} µs {tbs:6.2f} TB/s  {eq}")
                summary[name][rows][label] = {"us": us, "tb_s": tbs, "bits": eq}
    return summary


def run_baseline(root: str, argv: list[str]) -> dict[str, Any]:
    """This file run against the tree at ``root`` (its default launches), results read back."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "base.pt")
        code = (f"import sys, runpy; sys.path.insert(0, {root!r}); sys.argv = {['ew_kernels'] + argv + ['--save', path]!r}; "
                f"runpy.run_path({os.path.abspath(__file__)!r}, run_name='__main__')")
        pypath = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])   # root's nbgen first
        subprocess.run([sys.executable, "-c", code], cwd=root, check=True, env={**os.environ, "PYTHONPATH": pypath})
        return torch.load(path)


def main(argv: Optional[list[str]] = None) -> None:
    """Time the kernels and their candidates (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    ap.add_argument("--calls", type=int, default=20, help="launches per captured graph")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--baseline-root", default=None, help="a tree (main) whose default launches run in the same call")
    ap.add_argument("--save", default=None, help=argparse.SUPPRESS)       # the baseline role: results to this file
    add_json_option(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the element-wise kernels' sweep needs a CUDA GPU")
    if args.rows and min(args.rows) < 1:
        raise ValueError(f"rows must be >= 1, got {args.rows}")
    timing = ["--rows", *map(str, args.rows), "--calls", str(args.calls), "--reps", str(args.reps)]
    if args.save:
        torch.save(measure(args.rows, args.calls, args.reps, baseline=True), args.save)
        return
    print(f"device: {torch.cuda.get_device_name()}  Llama-3.1-8B widths (hidden {HID}, intermediate {INTER}, "
          f"{HQ}/{HKV} heads of {D}); Qwen3-0.6B for the norm form")
    base = run_baseline(args.baseline_root, timing) if args.baseline_root else None
    mine = measure(args.rows, args.calls, args.reps, baseline=False)
    summary = report(mine, base)
    if args.baseline_root:      # the baseline again after the branch: the two runs bracket any drift
        again = run_baseline(args.baseline_root, timing)
        for name, per_rows in again.items():
            print(f"main again {name}: " + ", ".join(f"rows={r} {v['default'][0]:.2f} µs" for r, v in per_rows.items()))
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
