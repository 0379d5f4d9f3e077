"""``python -m nbgen.bench.cascade_kernel`` — one layer's shared-prefix decode attention at W-prefix's shape
(CUDA): 8 prefixes of 2,000 tokens, rows with 50-800 tokens of their own on shuffled pages, grouped by
prefix; Qwen3-0.6B or Llama-3.1-8B heads, bf16 pages. Each candidate's launches are captured ``INNER``
times in a CUDA graph and replayed (the median per call: no Python launch cost, as in the engine).
``--part nbgen``: the plain decode kernel, then (level 0, level 1) launch-shape pairs: both, each
level alone, max |d| against plain; the plain kernel over the own pages alone. ``--part flashinfer``:
``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores, LSE) over the own pages, ``BatchPrefill...``
with each prefix's rows one query group, ``merge_state_in_place``, the pair on one or two streams,
``MultiLevelCascadeAttentionWrapper``; each ``plan()``'s host time.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import time
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.cascade_plan import plan_shared
from nbgen.bench.floor import median_seconds
from nbgen.bench.kv_decode import HEADS, P
from nbgen.kernels import triton_cascade as tc
from nbgen.kernels.triton_decode import TritonDecodeWrapper, longest_first
from nbgen.runtime.cascade_graphs import MAX_CHUNKS, CascadeTables

INNER = 10          # calls per captured graph


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


def gpu_seconds(fn: Callable[[], object], reps: int = 20) -> tuple[float, str]:
    """Median seconds per call of ``fn`` replayed from a CUDA graph holding INNER calls; eager
    back-to-back calls (INNER between two events) where capture fails."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    how = "graph"
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                for _ in range(INNER):
                    fn()
        torch.cuda.current_stream().wait_stream(s)
        run = g.replay
    except Exception as e:  # noqa: BLE001 - report and time eagerly
        how = f"eager ({type(e).__name__})"
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(INNER):
                fn()
    return median_seconds(run, torch.device("cuda"), reps) / INNER, how


def fork(side: Callable[[], object], main: Callable[[], object]) -> None:
    """``side`` on a second stream while ``main`` runs on the current one, joined after (two parallel
    branches when captured into a graph)."""
    cur = torch.cuda.current_stream()
    st = _side_stream()
    st.wait_stream(cur)
    with torch.cuda.stream(st):
        side()
    main()
    cur.wait_stream(st)


@functools.cache
def _side_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()


def host_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Median host milliseconds of ``fn`` (a plan), the device idle in between."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[reps // 2]


def measure(model: str, rows: int, part: str = "all", prefixes: int = 8, prefix_len: int = 2000) -> None:
    hq, hkv, D = HEADS[model]
    dev = torch.device("cuda")
    ip, idx, last, pages = _tables(prefixes, rows, prefix_len)
    # rows grouped by prefix (row i takes prefix i % prefixes): one contiguous query group each
    perm = np.argsort(np.arange(rows) % prefixes, kind="stable")
    tabs = [idx[ip[i]: ip[i + 1]] for i in perm]
    last = last[perm]
    ip = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum([len(t) for t in tabs], out=ip[1:])
    idx = np.concatenate(tabs).astype(np.int32)
    kc = torch.randn(pages, hkv, P, D, device=dev).bfloat16()
    vc = torch.randn_like(kc)
    q = torch.randn(rows, hq, D, device=dev).bfloat16()
    tok_bytes = hkv * D * 2 * 2
    npref = prefix_len // P
    shared_b = prefixes * npref * P * tok_bytes
    own_b = (len(idx) - rows * npref) * P * tok_bytes

    def rate(t: float, nbytes: int) -> str:
        return f"{t * 1e6:7.1f} us ({nbytes / t / 1e9:5.0f} GB/s)"

    plain = TritonDecodeWrapper(hq, hkv, D, P, dev)
    plain.plan(*(torch.from_numpy(a).pin_memory() for a in (ip, idx, last)))
    ref = plain.run(q, (kc, vc)).float()
    t, how = gpu_seconds(lambda: plain.run(q, (kc, vc)))
    print(f"{model} {rows} rows x {prefixes} prefixes of {prefix_len} ({shared_b / 1e6:.1f} MB shared, "
          f"{own_b / 1e6:.1f} MB own; rates over the bytes each launch must read):")
    print(f"  nbgen plain decode          {rate(t, shared_b + own_b)} [{how}]")

    def err(o: torch.Tensor) -> float:
        return (o.float() - ref).abs().max().item()

    if part != "flashinfer":
        # nbgen's two levels through the graph runner's tables
        spec = KVCacheSpec(1, pages, P, hq, hkv, D, torch.bfloat16, dev)
        tables = CascadeTables(SimpleNamespace(spec=spec), rows)
        plan = plan_shared(ip, idx, rows, tables.R, MAX_CHUNKS)
        region = np.zeros(tables.size, dtype=np.int32)
        tables.fill(region, plan, rows, rows)
        tables.scratch = tc.SharedScratch(hkv, D, MAX_CHUNKS, dev, 16)
        on = [torch.from_numpy(a).to(dev) for a in (ip, idx, last, longest_first(ip, last, P, plan.skip))]
        w = tables.wrapper(torch.from_numpy(region).to(dev), rows, *on)
        d0, d1 = w.level0, w.level1
        L0, L1, E = tc.Level0, tc.Level1, dataclasses.replace
        pairs = [(d0, d1), (d0, E(d1, early=False)), (L0(2, 64, 4, 2, True), d1), (L0(2, 64, 4, 4, True), d1),
                 (L0(4, 64, 4, 3, True), d1)]
        # level 1: tokens per tile, warps, stages
        for bn, warps, stages in ((64, 4, 3), (32, 4, 4), (16, 1, 6), (32, 2, 4), (128, 4, 2)):
            pairs.append((d0, L1(bn, warps, stages, None, bn < 128, True)))
        alone0: dict = {}
        alone1: dict = {}
        for lv0, lv1 in pairs:
            if (lv1.splits or 1) > 1 and rows * hkv * lv1.splits > w.count.numel():
                continue
            w.level0, w.level1 = lv0, lv1
            e = err(w.run(q, (kc, vc)))
            if lv0 not in alone0:
                alone0[lv0] = gpu_seconds(lambda: w.run_level0(q, (kc, vc)))[0]
            if lv1 not in alone1:
                alone1[lv1] = gpu_seconds(lambda: w.run_level1(q, (kc, vc)))[0]
            t, how = gpu_seconds(lambda: w.run(q, (kc, vc)))
            tag = "default " if (lv0, lv1) == (d0, d1) else ""
            print(f"  nbgen {tag}L0 {lv0.splits}x{lv0.block_n} w{lv0.warps} st{lv0.stages} a{lv0.ahead:d} + "
                  f"L1 {lv1.block_n}t w{lv1.warps} st{lv1.stages} sp{lv1.splits} a{lv1.ahead:d} early{lv1.early:d}: "
                  f"both {rate(t, shared_b + own_b)}; L0 alone {rate(alone0[lv0], shared_b)}, "
                  f"L1 alone {rate(alone1[lv1], own_b)}; |d| {e:.4f} [{how}]")
        w.level0, w.level1 = d0, d1
        # the plain kernel over the own pages alone (tables without the prefixes): short rows as such
        own_tabs = [t[npref:] for t in tabs]
        ip1 = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum([len(t) for t in own_tabs], out=ip1[1:])
        alone = TritonDecodeWrapper(hq, hkv, D, P, dev)
        alone.plan(*(torch.from_numpy(a).pin_memory() for a in (ip1, np.concatenate(own_tabs), last)))
        t, how = gpu_seconds(lambda: alone.run(q, (kc, vc)))
        print(f"  nbgen plain decode over the own pages only {rate(t, own_b)} [{how}]")

    if part != "nbgen":
        import flashinfer

        # flashinfer: level 1 over the rows' own pages (after the shared ones), level 0 per prefix group
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        own_tabs = [t[npref:] for t in tabs]
        ip1 = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum([len(t) for t in own_tabs], out=ip1[1:])
        idx1 = np.concatenate(own_tabs).astype(np.int32)
        group = rows // prefixes
        qo0 = np.arange(prefixes + 1, dtype=np.int32) * group
        ip0 = np.arange(prefixes + 1, dtype=np.int32) * npref
        idx0 = np.concatenate([tabs[p * group][:npref] for p in range(prefixes)]).astype(np.int32)
        last0 = np.full(prefixes, P, dtype=np.int32)
        h = {k: torch.from_numpy(v).pin_memory() for k, v in
             dict(ip1=ip1, idx1=idx1, last1=last, qo0=qo0, ip0=ip0, idx0=idx0, last0=last0).items()}
        kw = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=D ** -0.5)
        o1 = torch.empty_like(q)
        s1 = torch.empty(rows, hq, dtype=torch.float32, device=dev)
        o0 = torch.empty_like(q)
        s0 = torch.empty(rows, hq, dtype=torch.float32, device=dev)
        cands = {}
        for tcores in (True,):        # the CUDA-core kernel is slower for grouped heads (decode_tensor_cores)
            dw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tcores)

            def plan1(dw=dw) -> None:
                dw.plan(h["ip1"], h["idx1"], h["last1"], hq, hkv, D, P, pos_encoding_mode="NONE",
                        non_blocking=True, **kw)
            try:
                ms = host_ms(plan1)
                t, how = gpu_seconds(lambda dw=dw: dw.run(q, (kc, vc), out=o1, lse=s1, return_lse=True))
                print(f"  flashinfer L1 decode tc={tcores!s:5}: {rate(t, own_b)}, plan {ms:.3f} ms host [{how}]")
                cands[tcores] = dw
            except Exception as e:  # noqa: BLE001 - one candidate failing must not hide the others
                print(f"  flashinfer L1 decode tc={tcores}: failed: {type(e).__name__}: {e}")
        l0 = {}
        for backend in ("auto", "fa2"):
            pw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend=backend)

            def plan0(pw=pw) -> None:
                pw.plan(h["qo0"], h["ip0"], h["idx0"], h["last0"], hq, hkv, D, P, causal=False, non_blocking=True, **kw)
            try:
                ms = host_ms(plan0)
                t, how = gpu_seconds(lambda pw=pw: pw.run(q, (kc, vc), out=o0, lse=s0, return_lse=True))
                print(f"  flashinfer L0 prefill {backend:4}: {rate(t, shared_b)}, plan {ms:.3f} ms host [{how}]")
                l0[backend] = pw
            except Exception as e:  # noqa: BLE001
                print(f"  flashinfer L0 prefill {backend}: failed: {type(e).__name__}: {e}")
        try:
            t, how = gpu_seconds(lambda: flashinfer.merge_state_in_place(o1, s1, o0, s0))
            print(f"  flashinfer merge_state_in_place: {t * 1e6:7.1f} us [{how}]")
        except Exception as e:  # noqa: BLE001
            print(f"  flashinfer merge_state_in_place: failed: {type(e).__name__}: {e}")
        for tcores, dw in cands.items():
            for backend, pw in l0.items():
                def pair(dw=dw, pw=pw) -> torch.Tensor:
                    pw.run(q, (kc, vc), out=o0, lse=s0, return_lse=True)
                    dw.run(q, (kc, vc), out=o1, lse=s1, return_lse=True)
                    flashinfer.merge_state_in_place(o1, s1, o0, s0)
                    return o1
                def pair2(dw=dw, pw=pw) -> torch.Tensor:
                    fork(lambda: pw.run(q, (kc, vc), out=o0, lse=s0, return_lse=True),
                         lambda: dw.run(q, (kc, vc), out=o1, lse=s1, return_lse=True))
                    flashinfer.merge_state_in_place(o1, s1, o0, s0)
                    return o1
                try:
                    e = err(pair())
                    t, how = gpu_seconds(pair)
                    print(f"  flashinfer pair L0 {backend:4} + L1 tc={tcores!s:5} + merge: "
                          f"{rate(t, shared_b + own_b)}, |d| {e:.4f} [{how}]")
                    e = err(pair2())
                    t, how = gpu_seconds(pair2)
                    print(f"  flashinfer pair, L0 on a second stream beside L1, + merge: {rate(t, shared_b + own_b)}, "
                          f"|d| {e:.4f} [{how}]")
                except Exception as e:  # noqa: BLE001
                    print(f"  flashinfer pair {backend} tc={tcores}: failed: {type(e).__name__}: {e}")
        try:
            mw = flashinfer.MultiLevelCascadeAttentionWrapper(2, ws, "HND")
            qo1 = torch.arange(rows + 1, dtype=torch.int32).pin_memory()

            def planm() -> None:
                mw.plan([h["qo0"], qo1], [h["ip0"], h["ip1"]], [h["idx0"], h["idx1"]], [h["last0"], h["last1"]],
                        hq, hkv, D, P, sm_scale=D ** -0.5, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            ms = host_ms(planm)
            e = err(mw.run(q, (kc, vc)))
            t, how = gpu_seconds(lambda: mw.run(q, (kc, vc)))
            print(f"  flashinfer MultiLevelCascade: {rate(t, shared_b + own_b)}, |d| {e:.4f}, "
                  f"plan {ms:.3f} ms host [{how}]")
        except Exception as e:  # noqa: BLE001
            print(f"  flashinfer MultiLevelCascade: failed: {type(e).__name__}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="256,128,32")
    ap.add_argument("--model", choices=sorted(HEADS), default="qwen3-0.6b")
    ap.add_argument("--part", choices=("all", "nbgen", "flashinfer"), default="all")
    args = ap.parse_args()
    t = time.perf_counter()
    for rows in [int(r) for r in args.rows.split(",")]:
        measure(args.model, rows, args.part)
    print(f"cascade_kernel: {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
