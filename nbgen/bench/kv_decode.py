"""``python -m nbgen.bench.kv_decode`` — attention over model-dtype against e4m3 KV pages (CUDA).

One layer's decode attention (nbgen's Triton kernel, ``kernels/triton_decode.py``) at the heads of
Qwen3-0.6B and Llama-3.1-8B, several batch sizes and KV lengths, launches replayed from a CUDA graph
(``fp8_kernels.graph_time``): µs per launch and the KV read rate (GB/s) for bf16 pages and for e4m3
pages, each checked against the fp32 attention of the dequantized pages; then flashinfer's paged
prefill (one layer, causal chunks after a cached prefix) planned for bf16 and for e4m3 pages (bf16
queries over e4m3 pages take flashinfer's fa2 kernels, with or without split KV; bf16 pages its SM90
ones on Hopper), against nbgen's Triton chunk attention (``kernels/triton_extend.py``: its default
launch shape and a few others, with the largest difference from flashinfer's output).
"""
from __future__ import annotations

import argparse

import torch

from nbgen.attention import kv_quant
from nbgen.bench.fp8_kernels import graph_time
from nbgen.kernels import triton_decode as td
from nbgen.kernels import triton_extend as tx

HEADS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}
CASES = [(1, 1024), (1, 8192), (32, 1024), (256, 600), (256, 1024)]     # (batch, KV tokens a sequence)
P = 16


def _pages(bs: int, n: int, hkv: int, D: int) -> tuple[torch.Tensor, ...]:
    """bf16 HND caches holding ``bs`` sequences of ``n`` tokens on shuffled pages, and the page tables."""
    per = -(-n // P)
    total = bs * per
    kc = torch.randn(total + 1, hkv, P, D, device="cuda").bfloat16()
    vc = torch.randn_like(kc)
    indices = (torch.randperm(total) + 1).to(torch.int32)
    indptr = torch.arange(bs + 1, dtype=torch.int32) * per
    last = torch.full((bs,), n - (per - 1) * P, dtype=torch.int32)
    return kc, vc, indptr, indices, last


def _reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
               n: int) -> torch.Tensor:
    """fp32 attention of the first two sequences (enough to catch a wrong variant)."""
    hq, hkv, D = q.shape[1], kc.shape[1], kc.shape[3]
    out = []
    for b in range(min(2, q.shape[0])):
        pg = indices[indptr[b]: indptr[b + 1]].long().cuda()
        k = kc[pg].float().transpose(1, 2).reshape(-1, hkv, D)[:n].repeat_interleave(hq // hkv, 1)
        v = vc[pg].float().transpose(1, 2).reshape(-1, hkv, D)[:n].repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * D ** -0.5
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


def decode_rows(model: str) -> list[dict]:
    """The decode kernel per case: bf16 pages, then e4m3 pages."""
    hq, hkv, D = HEADS[model]
    rows = []
    for bs, n in CASES:
        kc, vc, indptr, indices, last = _pages(bs, n, hkv, D)
        k8, v8 = kv_quant.store(kc, 1.0, kv_quant.FP8), kv_quant.store(vc, 1.0, kv_quant.FP8)
        q = torch.randn(bs, hq, D, device="cuda").bfloat16()
        w = td.TritonDecodeWrapper(hq, hkv, D, P, torch.device("cuda"))
        w.plan(indptr.pin_memory(), indices.pin_memory(), last.pin_memory())
        for pages in ("bf16", "e4m3"):
            caches = (kc, vc) if pages == "bf16" else (k8, v8)
            err = (w.run(q, caches)[:2].float() - _reference(q, *caches, indptr, indices, n)).abs().max().item()
            secs = graph_time(lambda _i: w.run(q, caches), 1, 20, 10)
            kv_bytes = 2 * bs * n * hkv * D * caches[0].element_size()
            rows.append({"model": model, "batch": bs, "kv_len": n, "pages": pages,
                         "us": secs * 1e6, "GB/s": kv_bytes / secs / 1e9, "max_err": err})
        del kc, vc, k8, v8
    return rows


# ragged batches (rows, shortest and longest KV) as W-nano's decode steps meet them, and the launch variants timed
RAGGED_CASES = [(256, 128, 2048), (128, 256, 2048), (32, 512, 2048)]
RAGGED_VARIANTS: dict[str, dict] = {
    "default": {}, "2 splits": {"num_splits": lambda *a: 2}, "4 splits": {"num_splits": lambda *a: 4},
    "3 stages": {"FP8_STAGES": 3}, "2 stages": {"FP8_STAGES": 2}, "ahead": {"FP8_AHEAD_ROWS": 4096},
    "64-token tiles": {"block_n": lambda bs, d: 64}}


def ragged_rows(model: str) -> list[dict]:
    """The decode kernel over e4m3 pages at ``RAGGED_CASES`` (row lengths uniform at random, seeded), its
    default launch against ``RAGGED_VARIANTS`` (module attributes of kernels/triton_decode.py replaced while
    timed; the split scratch enlarged so that any split count fits), each checked on its first two rows."""
    hq, hkv, D = HEADS[model]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs, lo, hi in RAGGED_CASES:
        lens = torch.randint(lo, hi + 1, (bs,), generator=gen)
        per = (lens + P - 1) // P
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), per.cumsum(0)]).to(torch.int32)
        total = int(indptr[-1])
        kc = torch.randn(total + 1, hkv, P, D, device="cuda").bfloat16()
        vc = torch.randn_like(kc)
        indices = (torch.randperm(total) + 1).to(torch.int32)
        last = (lens - (per - 1) * P).to(torch.int32)
        caches = (kv_quant.store(kc, 1.0, kv_quant.FP8), kv_quant.store(vc, 1.0, kv_quant.FP8))
        del kc, vc
        q = torch.randn(bs, hq, D, device="cuda").bfloat16()
        w = td.TritonDecodeWrapper(hq, hkv, D, P, torch.device("cuda"))
        cells = bs * hkv * td.MAX_SPLITS
        w.part = torch.empty(cells * w.g2 * D, dtype=torch.float32, device="cuda")
        w.ml = torch.empty(cells * 2 * w.g2, dtype=torch.float32, device="cuda")
        w.count = torch.zeros(cells, dtype=torch.int32, device="cuda")
        w.plan(indptr.pin_memory(), indices.pin_memory(), last.pin_memory())
        kv_bytes = 2 * int(lens.sum()) * hkv * D
        for name, attrs in RAGGED_VARIANTS.items():
            saved = {a: getattr(td, a) for a in attrs}
            for a, v in attrs.items():
                setattr(td, a, v)
            try:
                got = w.run(q, caches)[:2].float()
                err = max((got[b] - _reference(q[b: b + 1], *caches, indptr[b: b + 2] - indptr[b],
                                                indices[int(indptr[b]):], int(lens[b]))[0]).abs().max().item()
                          for b in range(2))
                secs = graph_time(lambda _i: w.run(q, caches), 1, 20, 10)
            finally:
                for a, v in saved.items():
                    setattr(td, a, v)
            rows.append({"model": model, "case": f"{bs} x {lo}-{hi}", "variant": name, "us": secs * 1e6,
                         "GB/s": kv_bytes / secs / 1e9, "max_err": err})
    return rows


# (chunks, cached, chunk tokens): long chunks, a paced mixed step's small ones, then 256 and 512 tokens of
# 128-token chunks (where the Triton chunk attention stops paying: attention/prefill_plans.EXTEND_MAX_TOKENS)
PREFILL_CASES = [(8, 1536, 512), (1, 512, 128), (1, 896, 128), (2, 640, 64), (2, 640, 128), (4, 640, 128)]
# the Triton kernel's launch shapes beside its default (tile rows, KV tokens a tile, warps, stages, ahead, splits)
EXTEND_SHAPES = {"bm32": tx.ExtendShape(32, 64, 4, 3), "bm16": tx.ExtendShape(16, 64, 4, 3),
                 "bn32": tx.ExtendShape(64, 32, 4, 4), "nosplit": tx.ExtendShape(64, 64, 4, 3, splits=1)}


def prefill_rows(model: str) -> list[dict]:
    """flashinfer's paged prefill, causal chunks after cached tokens (``PREFILL_CASES``: 8 chunks of 512 after
    1536; the small chunks of a paced mixed step), bf16 pages, e4m3 pages, and e4m3 pages planned without
    split KV (no merge launch; a small chunk then has fewer programs); then nbgen's Triton chunk attention
    over bf16 and e4m3 pages (default launch shape, then ``EXTEND_SHAPES``), ``max_err`` its largest
    difference from flashinfer's output over the same pages."""
    import flashinfer

    hq, hkv, D = HEADS[model]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for bs, cached, chunk in PREFILL_CASES:
        n = cached + chunk
        kc, vc, indptr, indices, last = _pages(bs, n, hkv, D)
        q = torch.randn(bs * chunk, hq, D, device="cuda").bfloat16()
        out = torch.empty_like(q)
        qo = torch.arange(bs + 1, dtype=torch.int32) * chunk
        e4m3 = (kv_quant.store(kc, 1.0, kv_quant.FP8), kv_quant.store(vc, 1.0, kv_quant.FP8))
        flops = 4 * hq * D * bs * chunk * (cached + chunk / 2)
        fi_out = {}
        for pages, caches, nosplit in (("bf16", (kc, vc), False), ("e4m3", e4m3, False),
                                       ("e4m3 nosplit", e4m3, True)):
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend="auto")
            w.plan(qo, indptr, indices, last, hq, hkv, D, P, causal=True, sm_scale=D ** -0.5,
                   q_data_type=torch.bfloat16, kv_data_type=caches[0].dtype, disable_split_kv=nosplit)
            secs = graph_time(lambda _i, w=w, caches=caches: w.run(q, caches, out=out), 1, 20, 10)
            fi_out.setdefault(pages.split()[0], out.clone())
            rows.append({"model": model, "case": f"{bs}x{chunk} after {cached}", "pages": pages, "us": secs * 1e6,
                         "TFLOP/s": flops / secs / 1e12})
        for name, shape in (("", None), *EXTEND_SHAPES.items()):
            t = tx.TritonExtendWrapper(hq, hkv, D, P, torch.device("cuda"), shape)
            t.plan(qo, indptr, indices, last)
            for pages, caches in (("bf16", (kc, vc)), ("e4m3", e4m3)):
                err = (t.run(q, caches, out=out).float() - fi_out[pages].float()).abs().max().item()
                secs = graph_time(lambda _i, t=t, caches=caches: t.run(q, caches, out=out), 1, 20, 10)
                rows.append({"model": model, "case": f"{bs}x{chunk} after {cached}", "us": secs * 1e6,
                             "pages": f"{pages} triton {name}".strip(), "TFLOP/s": flops / secs / 1e12,
                             "max_err": err, "splits": t.planned.splits})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(HEADS), action="append", help="head shapes (default: both)")
    ap.add_argument("--no-prefill", action="store_true", help="the decode kernel only")
    ap.add_argument("--ragged", action="store_true", help="only the decode kernel's ragged batches and variants")
    args = ap.parse_args()
    for model in args.model or sorted(HEADS):
        if args.ragged:
            print(f"decode attention over e4m3 pages, ragged rows, one layer, {model} heads {HEADS[model]}")
            for r in ragged_rows(model):
                print(f"{r['case']:>16} {r['variant']:>15}: {r['us']:8.1f} us {r['GB/s']:6.0f} GB/s "
                      f"max_err {r['max_err']:.4f}", flush=True)
            continue
        print(f"decode attention, one layer, {model} heads {HEADS[model]}")
        print(f"{'batch':>5} {'kv_len':>6} {'pages':>5} {'us':>8} {'GB/s':>7} {'max_err':>8}")
        for r in decode_rows(model):
            print(f"{r['batch']:>5} {r['kv_len']:>6} {r['pages']:>5} {r['us']:>8.1f} "
                  f"{r['GB/s']:>7.0f} {r['max_err']:>8.4f}", flush=True)
        for r in ([] if args.no_prefill else prefill_rows(model)):
            extra = f", {r['splits']} splits, max_err {r['max_err']:.4f}" if "max_err" in r else ""
            print(f"prefill {r['case']:>16} {r['pages']:>20}: {r['us']:.1f} us, {r['TFLOP/s']:.0f} TFLOP/s{extra}")


if __name__ == "__main__":
    main()
