"""``python -m nbgen.bench.cascade_kernel`` — one layer's decode attention over shared prefixes (CUDA).

W-prefix's shape (8 prefixes of 2,000 tokens, 32 rows each with 50-800 tokens of their own; fewer
rows a prefix as requests finish) at Qwen3-0.6B's and Llama-3.1-8B's heads, bf16 pages: nbgen's plain
decode kernel against the shared-prefix path (kernels/triton_cascade.py: level 0 + level 1), each
level-0 launch shape in ``--splits`` x ``--tiles`` (the default shape first), through the tables
exactly as a graph replay reads them, then level 1 alone on each tile size of ``--level1-tiles``.
Prints µs per layer (and each level alone), the distinct KV bytes per µs (the shared floor's rate),
the max |Δ| between the two paths.
"""
from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import numpy as np
import torch

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.cascade_plan import plan_shared
from nbgen.bench.kv_decode import HEADS, P, median_seconds
from nbgen.kernels import triton_cascade as tc
from nbgen.kernels.triton_decode import TritonDecodeWrapper, longest_first
from nbgen.runtime.cascade_graphs import MAX_CHUNKS, CascadeTables


def _tables(prefixes: int, rows: int, prefix_len: int, seed: int = 0):
    """Page tables: row i takes prefix i % prefixes, then 50-800 tokens of its own (pages shuffled)."""
    rng = random.Random(seed)
    own = [rng.randint(50, 800) for _ in range(rows)]
    npref = prefix_len // P
    counts = [-(-(prefix_len + o) // P) - npref for o in own]
    total = prefixes * npref + sum(counts)
    perm = iter((np.random.default_rng(seed).permutation(total) + 1).tolist())
    pref = [[next(perm) for _ in range(npref)] for _ in range(prefixes)]
    tabs = [pref[i % prefixes] + [next(perm) for _ in range(counts[i])] for i in range(rows)]
    ip = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum([len(t) for t in tabs], out=ip[1:])
    last = np.array([prefix_len + o - (len(t) - 1) * P for o, t in zip(own, tabs)], dtype=np.int32)
    return ip, np.asarray([p for t in tabs for p in t], dtype=np.int32), last, total + 1


def measure(model: str, rows: int, shapes: list[tc.Level0], level1_tiles: list[int], prefixes: int = 8,
            prefix_len: int = 2000) -> None:
    hq, hkv, D = HEADS[model]
    dev = torch.device("cuda")
    ip, idx, last, pages = _tables(prefixes, rows, prefix_len)
    kc = torch.randn(pages, hkv, P, D, device=dev).bfloat16()
    vc = torch.randn_like(kc)
    q = torch.randn(rows, hq, D, device=dev).bfloat16()
    plain = TritonDecodeWrapper(hq, hkv, D, P, dev)
    plain.plan(*(torch.from_numpy(a).pin_memory() for a in (ip, idx, last)))
    ref = plain.run(q, (kc, vc))
    t_plain = median_seconds(lambda: plain.run(q, (kc, vc)))
    own = (len(idx) - int(plan_rows(ip, idx, rows, hq // hkv).sum())) * P          # level 1's tokens
    kv_bytes = (prefixes * (prefix_len // P) * P + own) * hkv * D * 2 * 2           # distinct K and V bytes
    own_bytes = own * hkv * D * 2 * 2
    print(f"{model} {rows} rows x {prefixes} prefixes of {prefix_len}: plain {t_plain * 1e6:.1f} us "
          f"({kv_bytes / t_plain / 1e9:.0f} GB/s of distinct KV)")
    spec = KVCacheSpec(1, pages, P, hq, hkv, D, torch.bfloat16, dev)
    tables = CascadeTables(SimpleNamespace(spec=spec), rows)
    plan = plan_shared(ip, idx, rows, tables.R, MAX_CHUNKS)
    region = np.zeros(tables.size, dtype=np.int32)
    tables.fill(region, plan, rows, rows)
    on = [torch.from_numpy(a).to(dev) for a in (ip, idx, last, longest_first(ip, last, P, plan.skip))]
    tables.scratch = tc.SharedScratch(hkv, D, MAX_CHUNKS, dev, max(lv.splits for lv in shapes))
    dev_region = torch.from_numpy(region).to(dev)
    default = tables.wrapper(dev_region, rows, *on).level0
    for lv in [default] + [x for x in shapes if x != default]:
        w = tables.wrapper(dev_region, rows, *on)
        w.level0 = lv
        err = (w.run(q, (kc, vc)).float() - ref.float()).abs().max().item()
        t = median_seconds(lambda: w.run(q, (kc, vc)))
        t0 = median_seconds(lambda: w.run_level0(q, (kc, vc)))
        t1 = median_seconds(lambda: w.run_level1(q, (kc, vc)))
        tag = "default " if lv == default else ""
        print(f"  {tag}level 0 splits {lv.splits:2d} x {lv.block_n:3d}-token tiles, {lv.warps} warps: {t * 1e6:.1f} us "
              f"(level 0 {t0 * 1e6:.1f}, level 1 {t1 * 1e6:.1f} = {own_bytes / t1 / 1e9:.0f} GB/s of own KV; "
              f"{kv_bytes / t / 1e9:.0f} GB/s), "
              f"{t_plain / t:.2f}x, max |d| vs plain {err:.4f}")
    w = tables.wrapper(dev_region, rows, *on)
    for bn in level1_tiles:
        w.level1_block_n = bn
        err = (w.run(q, (kc, vc)).float() - ref.float()).abs().max().item()
        t1 = median_seconds(lambda: w.run_level1(q, (kc, vc)))
        print(f"  default level 0, level 1 on {bn}-token tiles: level 1 {t1 * 1e6:.1f} us "
              f"({own_bytes / t1 / 1e9:.0f} GB/s), max |d| vs plain {err:.4f}")


def plan_rows(ip: np.ndarray, idx: np.ndarray, rows: int, group: int) -> np.ndarray:
    """Pages each row's level 1 skips (the shared pages it does not read itself)."""
    plan = plan_shared(ip, idx, rows, tc.rows_per_chunk(group), MAX_CHUNKS)
    return plan.skip if plan is not None else np.zeros(rows, dtype=np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", default="4,8,16", help="level-0 split counts to time")
    ap.add_argument("--tiles", default="32x4,64x4,32x8,64x8", help="level-0 tokens per tile x warps to time")
    ap.add_argument("--rows", default="256,128,32")
    ap.add_argument("--level1-tiles", default="32,64,128", help="level 1's tokens per tile to time")
    args = ap.parse_args()
    shapes = [tc.Level0(int(s), int(t.split("x")[0]), int(t.split("x")[1]))
              for s in args.splits.split(",") for t in args.tiles.split(",")]
    for model in HEADS:
        for rows in [int(r) for r in args.rows.split(",")]:
            measure(model, rows, shapes, [int(x) for x in args.level1_tiles.split(",")])


if __name__ == "__main__":
    main()
