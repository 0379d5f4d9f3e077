"""The LoRA slot kernels' time per call at Llama-3.1-8B's four fused linears (CUDA, bf16), and a
config sweep: ``python -m nbgen.bench.lora --kernels [--sweep]``.

Every case is a step of ``rows`` rows round-robin over ``slots`` rank-``rank`` adapters (default 256
and 32 rows: the tables' "large" and "small" buckets; the tables are keyed by the step's row count,
``rows_bucket``: "small" up to 64, "large" up to 1024, "prefill" above, and by the linear's width).
Times come from CUDA-graph replays
(steps replay graphs, so no launch overhead), in µs per call. ``--sweep`` times, per table bucket
(rows bucket x width bucket, summed over the shapes and the row counts in it: ``--rows 8,32`` picks
one "small" winner for both), a grid of tilings (BM x BN x niter for
the expand, BM x BK x ksplit for the shrink) at 4 warps / 2 stages, then the best few at every
warps x stages; each candidate is first checked against ``lora_reference``. It prints per shape the
first kernel (every shard per block, BN 64, no loop), the tables' configs and the sweep's best, and
the winners in the tables' syntax for ``kernels/lora_sgmv_configs.py``.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional

import torch

from nbgen.kernels import lora_sgmv as K
from nbgen.kernels import lora_sgmv_configs as C

# name -> (K, output shard sizes) of Llama-3.1-8B's fused linears
SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
          "down": (14336, [4096])}
OLD_SHRINK, OLD_EXPAND = C.ShrinkConfig(), C.ExpandConfig(all_shards=True)      # the first kernel's tiling
# BM 64: fewer, fuller row blocks for the "prefill" rows (thousands of rows in long runs per slot)
EXPAND_GRID = {"bm": (16, 32, 64), "bn": (64, 128, 256), "niter": (1, 2, 4, 8)}
SHRINK_GRID = {"bm": (16, 32, 64), "bk": (64, 128), "ksplit": (256, 512, 1024, 16384)}   # 16384: no split at K <= 16384
LAUNCH_GRID = {"warps": (4, 8), "stages": (1, 2, 3)}
TOP = 3          # tilings carried into the warps x stages stage


@dataclass
class Case:
    """One shape at one row count: the step's tensors, the reference output and the shrink's t."""

    name: str
    rows: int
    x: torch.Tensor               # [rows, K] bf16
    y0: torch.Tensor              # [rows, N] the base output before the LoRA add
    a: torch.Tensor               # [S, nshard * R, K]
    b: torch.Tensor               # [S, N, R]
    sc: torch.Tensor              # [S] fp32 scalings
    perm: torch.Tensor            # [rows] int32 rows grouped by slot
    start: torch.Tensor           # [S] int32
    lens: torch.Tensor            # [S] int32
    bounds: tuple[int, int]
    nshard: int
    want: torch.Tensor            # [rows, N] y0 plus the reference's LoRA
    t: torch.Tensor               # [rows, nshard * R] fp32, the expand's input


def make_case(name: str, rows: int, slots: int, rank: int, empty: bool = False, device: str = "cuda",
              dtype: torch.dtype = torch.bfloat16) -> Case:
    """Random tensors of shape ``name``; rows round-robin over the slots (``empty``: no adapter row)."""
    dev, dt = torch.device(device), dtype
    k, sizes = SHAPES[name]
    n, ns = sum(sizes), len(sizes)
    bounds = (sizes[0] if ns > 1 else n, sizes[0] + sizes[1] if ns > 2 else n)
    g = torch.Generator(device=dev).manual_seed(rows)
    x = torch.randn(rows, k, device=dev, generator=g).to(dt)
    a = (torch.randn(slots, ns * rank, k, device=dev, generator=g) * k ** -0.5).to(dt)
    b = (torch.randn(slots, n, rank, device=dev, generator=g) * 0.05).to(dt)
    sc = torch.rand(slots, device=dev, generator=g) + 0.5
    lens = torch.tensor([0 if empty else len(range(s, rows, slots)) for s in range(slots)], device=dev, dtype=torch.int32)
    start = (torch.cumsum(lens, 0) - lens).int()
    perm = torch.argsort(torch.arange(rows, device=dev) % slots, stable=True).int()
    y0 = torch.randn(rows, n, device=dev, generator=g).to(dt)
    want = y0.clone()
    K.lora_reference(x, want, a, b, sc, perm, start, lens, bounds, ns)
    t = K.lora_shrink(x, a, perm, start, lens, cfg=OLD_SHRINK)
    return Case(name, rows, x, y0, a, b, sc, perm, start, lens, bounds, ns, want, t)


def us_per_call(fn: Callable[[], None]) -> float:
    """µs per call: the median of 10 replays of one graph of ~10 ms of calls."""
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median")


def check(c: Case, shrink: Optional[C.ShrinkConfig] = None, expand: Optional[C.ExpandConfig] = None) -> bool:
    """One eager call (compiles) against the reference: bf16 outputs within 0.05."""
    y = c.y0.clone()
    K.lora_sgmv(c.x, y, c.a, c.b, c.sc, c.perm, c.start, c.lens, c.bounds, c.nshard, shrink_cfg=shrink, expand_cfg=expand)
    return (y.float() - c.want.float()).abs().max().item() < 0.05


def time_sgmv(c: Case, shrink: Optional[C.ShrinkConfig] = None, expand: Optional[C.ExpandConfig] = None) -> float:
    """µs per ``lora_sgmv`` call (shrink + expand)."""
    y = c.y0.clone()
    return us_per_call(lambda: K.lora_sgmv(c.x, y, c.a, c.b, c.sc, c.perm, c.start, c.lens, c.bounds, c.nshard,
                                   shrink_cfg=shrink, expand_cfg=expand))


def time_shrink(c: Case, cfg: C.ShrinkConfig) -> float:
    """µs per shrink call (with t's memset when it splits K)."""
    return us_per_call(lambda: K.lora_shrink(c.x, c.a, c.perm, c.start, c.lens, cfg=cfg))


def time_expand(c: Case, cfg: C.ExpandConfig) -> float:
    """µs per expand call."""
    y = c.y0.clone()
    return us_per_call(lambda: K.lora_expand(c.t, y, c.b, c.sc, c.perm, c.start, c.lens, c.bounds, c.nshard, cfg=cfg))


def _grid(base: Any, grid: dict) -> list:
    """``base`` with every combination of ``grid``'s values."""
    return [replace(base, **dict(zip(grid, vals))) for vals in itertools.product(*grid.values())]


def sweep_bucket(cases: list[Case], kind: str) -> list[tuple[float, object]]:
    """(summed µs over ``cases``, config) of the tilings grid then the launch grid, best first."""
    base = C.ShrinkConfig(warps=4, stages=2) if kind == "shrink" else C.ExpandConfig(warps=4, stages=2)
    timer = time_shrink if kind == "shrink" else time_expand

    def score(cfgs: list) -> list[tuple[float, object]]:
        out = []
        for cfg in dict.fromkeys(cfgs):
            try:
                ok = all(check(c, **{kind: cfg}) for c in cases)
            except Exception as e:              # e.g. a tile past the shared memory: not a candidate
                print(f"  {kind} {cfg}: failed ({type(e).__name__}: {str(e)[:120]}), skipped", flush=True)
                continue
            if not ok:
                print(f"  {kind} {cfg}: WRONG vs reference, skipped", flush=True)
                continue
            out.append((sum(timer(c, cfg) for c in cases), cfg))
        return sorted(out, key=lambda r: r[0])

    stage1 = score(_grid(base, SHRINK_GRID if kind == "shrink" else EXPAND_GRID))
    stage2 = score([cfg for _, top in stage1[:TOP] for cfg in _grid(top, LAUNCH_GRID)])
    best: dict = {}
    for us, cfg in stage1 + stage2:                 # a config timed in both stages: its best time
        best[cfg] = min(us, best.get(cfg, us))
    return sorted(((us, cfg) for cfg, us in best.items()), key=lambda r: r[0])


def _width(c: Case, kind: str) -> str:
    """The table's width bucket of a case for the shrink (K) or the expand (N)."""
    if kind == "shrink":
        return "deep" if c.x.shape[1] >= C.DEEP_K else "narrow"
    return "wide" if c.y0.shape[1] >= C.WIDE_N else "narrow"


def _sweep(by_rows: dict[int, dict[str, Case]], result: dict) -> None:
    """Per table bucket (kind x rows bucket x width bucket), one sweep over the cases of every row count
    in it (``--rows 8,32``: one winner for the "small" rows, timed at both), best configs into ``result``."""
    groups: dict[tuple[str, str, str], list[Case]] = {}
    for rows, cases in by_rows.items():
        rb = C.rows_bucket(rows)
        for kind in ("shrink", "expand"):
            for c in cases.values():
                groups.setdefault((kind, rb, _width(c, kind)), []).append(c)
    for (kind, rb, w), cs in groups.items():
        ranked = sweep_bucket(cs, kind)
        best = ranked[0][1]
        result["best"][f"{kind}:{rb}:{w}"] = asdict(best)
        for c in cs:
            result["rows"][c.rows][c.name][f"best_{kind}"] = (time_shrink if kind == "shrink" else time_expand)(c, best)
        print(f"{kind} ({rb!r}, {w!r}) over {sorted({(c.name, c.rows) for c in cs})}: best {best} "
              f"{ranked[0][0]:.1f} us; next {[(round(t, 1), str(cfg)) for t, cfg in ranked[1:4]]}", flush=True)
    for rows, res in result["rows"].items():
        for name, r in res.items():
            if "best_shrink" in r and "best_expand" in r:
                print(f"{name:7s} rows={rows:3d}: best shrink {r['best_shrink']:.1f} + expand {r['best_expand']:.1f} us "
                      f"(first kernel {r['old']:.1f}, tables {r['table']:.1f})", flush=True)
    for kind, cls in (("shrink", "ShrinkConfig"), ("expand", "ExpandConfig")):
        print(f"{kind.upper()}_TABLE winners (paste into kernels/lora_sgmv_configs.py):")
        for key, cfg in sorted(result["best"].items()):
            if key.startswith(kind):
                _, rb, w = key.split(":")
                args = ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "all_shards")
                print(f"    ({rb!r}, {w!r}): {cls}({args}),")


def kernel_times(rows_list: tuple[int, ...] = (256, 32), slots: int = 8, rank: int = 16, sweep: bool = False,
                 shapes: tuple[str, ...] = tuple(SHAPES), json_path: Optional[str] = None, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16) -> dict:
    """Per shape and row count: µs of the first kernel, of the tables' configs (shrink, expand, both,
    and both with no adapter row); with ``sweep``: each table bucket's best configs and their times
    (row counts of one bucket swept together). (``device`` / ``dtype``: the tests run it on the CPU
    under the Triton interpreter, in fp16.)"""
    result: dict = {"rows": {}, "best": {}}
    by_rows: dict[int, dict[str, Case]] = {}
    for rows in rows_list:
        cases = {name: make_case(name, rows, slots, rank, device=device, dtype=dtype) for name in shapes}
        res: dict = {}
        for name, c in cases.items():
            assert check(c, OLD_SHRINK, OLD_EXPAND) and check(c), name
            empty = make_case(name, rows, slots, rank, empty=True, device=device, dtype=dtype)
            res[name] = {"old": time_sgmv(c, OLD_SHRINK, OLD_EXPAND), "table": time_sgmv(c),
                         "old_shrink": time_shrink(c, OLD_SHRINK), "old_expand": time_expand(c, OLD_EXPAND),
                         "table_shrink": time_shrink(c, C.shrink_config(rows, c.x.shape[1])),
                         "table_expand": time_expand(c, C.expand_config(rows, c.y0.shape[1])),
                         "table_no_adapter_row": time_sgmv(empty)}
            r = res[name]
            print(f"{name:7s} rows={rows:3d}: first kernel {r['old']:6.1f} us (shrink {r['old_shrink']:.1f}, expand "
                  f"{r['old_expand']:.1f}) | tables {r['table']:6.1f} us (shrink {r['table_shrink']:.1f}, expand "
                  f"{r['table_expand']:.1f}; no adapter row {r['table_no_adapter_row']:.1f})", flush=True)
        result["rows"][rows] = res
        by_rows[rows] = cases
        print(f"rows={rows}: sum over the four linears: first kernel {sum(r['old'] for r in res.values()):.1f} us, "
              f"tables {sum(r['table'] for r in res.values()):.1f} us", flush=True)
    if sweep:
        _sweep(by_rows, result)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result
