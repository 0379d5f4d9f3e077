"""``python -m nbgen.bench.cascade_kernel`` — one layer's decode attention over shared prefixes (CUDA).

W-prefix's shape (8 prefixes of 2,000 tokens, 32 rows each with 50-800 tokens of their own; fewer
rows a prefix as requests finish) at Qwen3-0.6B's and Llama-3.1-8B's heads, bf16 pages: nbgen's plain
decode kernel against the shared-prefix path (kernels/triton_cascade.py: level 0 + level 1) through
the tables exactly as a graph replay reads them. The default launch shapes first (both levels, each
level alone, and each level's bytes), then each level-0 shape of ``--level0`` (level 0 alone, then
both) and each level-1 shape of ``--level1`` (level 1 alone, then both). Prints µs per layer (CUDA
events), GB/s of the distinct KV each launch reads (the shared floor's rate), max |Δ| against plain.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import time
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


def _row(label: str, t: float, t_alone: float, nbytes: int, t_plain: float, err: float) -> str:
    return (f"  {label}: alone {t_alone * 1e6:6.1f} us ({nbytes / t_alone / 1e9:5.0f} GB/s), "
            f"both {t * 1e6:6.1f} us, {t_plain / t:.2f}x plain, max |d| {err:.4f}")


def measure(model: str, rows: int, level0: list[tc.Level0], level1: list[tc.Level1], prefixes: int = 8,
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
    tok_bytes = hkv * D * 2 * 2                                                  # K and V of one token
    shared_bytes = prefixes * (prefix_len // P) * P * tok_bytes                  # level 0's distinct KV
    own_bytes = (len(idx) - int(plan_rows(ip, idx, rows, hq // hkv).sum())) * P * tok_bytes   # level 1's
    kv_bytes = shared_bytes + own_bytes
    print(f"{model} {rows} rows x {prefixes} prefixes of {prefix_len}: plain {t_plain * 1e6:.1f} us "
          f"({kv_bytes / t_plain / 1e9:.0f} GB/s of distinct KV: {shared_bytes / 1e6:.1f} MB shared, "
          f"{own_bytes / 1e6:.1f} MB own)")
    spec = KVCacheSpec(1, pages, P, hq, hkv, D, torch.bfloat16, dev)
    tables = CascadeTables(SimpleNamespace(spec=spec), rows)
    plan = plan_shared(ip, idx, rows, tables.R, MAX_CHUNKS)
    region = np.zeros(tables.size, dtype=np.int32)
    tables.fill(region, plan, rows, rows)
    on = [torch.from_numpy(a).to(dev) for a in (ip, idx, last, longest_first(ip, last, P, plan.skip))]
    tables.scratch = tc.SharedScratch(hkv, D, MAX_CHUNKS, dev, max([tc.SPLITS] + [lv.splits for lv in level0]))
    dev_region = torch.from_numpy(region).to(dev)
    w = tables.wrapper(dev_region, rows, *on)
    d0, d1 = w.level0, w.level1

    def both() -> tuple[float, float]:
        err = (w.run(q, (kc, vc)).float() - ref.float()).abs().max().item()
        return median_seconds(lambda: w.run(q, (kc, vc))), err

    t, err = both()
    t0 = median_seconds(lambda: w.run_level0(q, (kc, vc)))
    t1 = median_seconds(lambda: w.run_level1(q, (kc, vc)))
    print(f"  default {d0} + {d1}: {t * 1e6:.1f} us ({kv_bytes / t / 1e9:.0f} GB/s), {t_plain / t:.2f}x plain, "
          f"max |d| {err:.4f}; level 0 alone {t0 * 1e6:.1f} us ({shared_bytes / t0 / 1e9:.0f} GB/s), "
          f"level 1 alone {t1 * 1e6:.1f} us ({own_bytes / t1 / 1e9:.0f} GB/s), sum {(t0 + t1) * 1e6:.1f}")
    w.level0, w.level1 = tc.Level0(4 if rows >= 64 else tc.SPLITS, d0.block_n), tc.Level1()
    t, err = both()
    print(f"  shapes before page numbers ahead ({w.level0.splits} splits, decode kernel's level 1): "
          f"{t * 1e6:.1f} us ({kv_bytes / t / 1e9:.0f} GB/s), {t_plain / t:.2f}x plain, max |d| {err:.4f}")
    w.level0, w.level1 = d0, d1
    for lv in level0:
        if lv == d0:
            continue
        w.level0 = lv
        t0 = median_seconds(lambda: w.run_level0(q, (kc, vc)))
        t, err = both()
        print(_row(f"L0 splits {lv.splits:2d} x {lv.block_n:3d} tok, {lv.warps} warps, stages {lv.stages}, "
                   f"ahead {lv.ahead}", t, t0,
                   shared_bytes, t_plain, err))
    w.level0 = d0
    pairs = rows * hkv
    for lv in level1:
        if lv == d1 or (lv.splits or 1) > 1 and pairs * lv.splits > w.count.numel():
            continue
        w.level1 = lv
        t1 = median_seconds(lambda: w.run_level1(q, (kc, vc)))
        t, err = both()
        print(_row(f"L1 {lv.block_n} tok, {lv.warps} warps, stages {lv.stages}, splits {lv.splits}, "
                   f"ahead {lv.ahead}", t, t1, own_bytes, t_plain, err))


def plan_rows(ip: np.ndarray, idx: np.ndarray, rows: int, group: int) -> np.ndarray:
    """Pages each row's level 1 skips (the shared pages it does not read itself)."""
    plan = plan_shared(ip, idx, rows, tc.rows_per_chunk(group), MAX_CHUNKS)
    return plan.skip if plan is not None else np.zeros(rows, dtype=np.int32)


def _shapes(spec: str, make: type) -> list:
    """'a:b:c,...' -> [make(a, b, c), ...]: '-' keeps a field's default; a last part 'a' sets ``ahead``."""
    out = []
    for item in filter(None, spec.split(",")):
        vals = item.split(":")
        flags = vals.pop() if vals[-1].isalpha() else ""
        kw: dict = {"ahead": True} if "a" in flags else {}
        for f, v in zip(dataclasses.fields(make), vals):
            if v != "-":
                kw[f.name] = int(v)
        out.append(make(**kw))
    return out


# the shapes before page numbers ahead (4:32:4 / 8:32:4, -:4:-:-) first, then the alternatives
L0_SWEEP = "4:32:4,8:32:4,4:32:4:3,8:32:4:3:a,16:32:4:3:a,4:32:4:4:a,4:64:8:3:a,4:16:4:4:a"
L1_SWEEP = ("-:4:-:-,64:4:3:-:a,128:4:3:-:a,32:4:4:-:a,64:4:4:-:a,64:8:3:-:a,32:4:6:-:a,64:4:3:1:a,"
            "64:4:3:2:a,64:4:3:4:a")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level0", default=L0_SWEEP,
                    help="level-0 shapes splits:tokens:warps:stages[:a] ('-': default; a: page numbers ahead)")
    ap.add_argument("--level1", default=L1_SWEEP,
                    help="level-1 shapes tokens:warps:stages:splits[:a] ('-': default; a: page numbers ahead)")
    ap.add_argument("--rows", default="256,128,64,32")
    ap.add_argument("--model", choices=sorted(HEADS), action="append", help="head shapes (default: both)")
    args = ap.parse_args()
    level0 = _shapes(args.level0, tc.Level0)
    level1 = _shapes(args.level1, tc.Level1)
    t = time.perf_counter()
    for model in args.model or sorted(HEADS):
        for rows in [int(r) for r in args.rows.split(",")]:
            measure(model, rows, level0, level1)
    print(f"cascade_kernel: {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
