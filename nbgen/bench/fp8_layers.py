"""``python -m nbgen.bench.fp8_layers`` — batch-1 fp8 decoder layers of Llama-3.1-8B as a decode step runs
them, replayed from one CUDA graph (CUDA).

A layer is the engine's launch sequence for a folded fp8 layer at one row: the qkv GEMV (the input norm's
weight as column scale), the fused RoPE with the norm's row factor and the K/V write, decode attention over
``--kv`` cached tokens, o_proj added into the residual stream, gate|up with SiLU-and-mul in the epilogue,
down_proj added into the stream (``kernels/fp8_row_gemv.py`` for the four linears). ``--layers`` layers of
distinct weights (far more bytes than the L2 cache) run ``--passes`` times in one graph, so the kernels'
ramp-up and tail, the attention-sized gaps and PDL's overlap between launches count as in the engine.
Each variant of the one-row kernel's launch (tiling, L2 prefetches of the program's own rows or of the
next linear's weights) prints µs a layer, TB/s of weight bytes (218 MB a layer) and its share of the copy
rate; ``linears only`` drops RoPE and attention (what the gaps cost).

    python -m nbgen.bench.fp8_layers [--layers 8] [--passes 4] [--kv 512]
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from nbgen.bench.floor import copy_bandwidth
from nbgen.bench.kv_decode import median_seconds
from nbgen.kernels import gpu_ops
from nbgen.kernels import qk_norm_rope as rope
from nbgen.kernels import triton_decode as td
from nbgen.kernels.fp8_row_gemv import fp8_row_gemv
from nbgen.kernels.kv_write import KVTarget

HQ, HKV, D, HIDDEN, INTER, P = 32, 8, 128, 4096, 14336, 16       # Llama-3.1-8B, KV page size
LINEARS = ("qkv", "o", "gate_up", "down")
MB = 1 << 20


def _weight(n: int, k: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight [n, k] and its per-row scales (small: the residual stream stays finite)."""
    w = torch.empty(n, k, device=dev, dtype=torch.float8_e4m3fn)
    for r in range(0, n, 4096):
        w[r:r + 4096] = torch.randn(min(4096, n - r), k, device=dev).mul_(0.5).to(torch.float8_e4m3fn)
    return w, torch.rand(n, device=dev) / (448 * k ** 0.5)


class Layers:
    """``n`` layers' weights, KV caches and the step's buffers; ``run(i, variant)`` launches layer i."""

    def __init__(self, n: int, kv: int, dev: torch.device) -> None:
        self.w = [{name: _weight(nn, kk, dev) for name, nn, kk in
                   (("qkv", (HQ + 2 * HKV) * D, HIDDEN), ("o", HIDDEN, HQ * D), ("gate_up", 2 * INTER, HIDDEN),
                    ("down", HIDDEN, INTER))} for _ in range(n)]
        self.g = [(torch.rand(HIDDEN, device=dev) + 0.5).bfloat16() for _ in range(2 * n)]
        pages = -(-(kv + 1) // P)
        self.caches = [(torch.randn(pages + 1, HKV, P, D, device=dev).bfloat16(),
                        torch.randn(pages + 1, HKV, P, D, device=dev).bfloat16()) for _ in range(n)]
        self.slots = torch.tensor([P + kv], device=dev)               # token kv, on page 1 onward
        self.pos = torch.tensor([kv], device=dev)
        self.cos_sin = torch.randn(kv + 1, D, device=dev)
        self.dec = td.TritonDecodeWrapper(HQ, HKV, D, P, dev)
        pin = (lambda t: t.pin_memory()) if dev.type == "cuda" else (lambda t: t)
        self.dec.plan(pin(torch.tensor([0, pages], dtype=torch.int32)),
                      pin(torch.arange(1, pages + 1, dtype=torch.int32)),
                      pin(torch.tensor([(kv + 1) - (pages - 1) * P], dtype=torch.int32)))
        self.h = torch.randn(1, HIDDEN, device=dev).bfloat16()
        self.qkv = torch.empty(1, (HQ + 2 * HKV) * D, device=dev, dtype=torch.bfloat16)
        self.attn = torch.empty(1, HQ, D, device=dev, dtype=torch.bfloat16)
        self.act = torch.empty(1, INTER, device=dev, dtype=torch.bfloat16)
        self.n = n

    def next_weight(self, i: int, name: str) -> torch.Tensor:
        """The weight read after linear ``name`` of layer i (the next layer's qkv after down)."""
        j = LINEARS.index(name) + 1
        return self.w[i][LINEARS[j]][0] if j < 4 else self.w[(i + 1) % self.n]["qkv"][0]

    def run(self, i: int, variant: Callable[["Layers", int, str], dict], gaps: bool = True) -> None:
        """Layer i's launches; ``variant(self, i, linear)`` -> the extra keywords of that linear's GEMV."""
        w, h, eps = self.w[i], self.h, 1e-5
        fp8_row_gemv(h, *w["qkv"], self.qkv, col_scale=self.g[2 * i], **variant(self, i, "qkv"))
        if gaps:
            rope.qk_norm_rope_(self.qkv, self.pos, None, None, 0.0, self.cos_sin, HQ, HKV, D,
                               kv=KVTarget(*self.caches[i], self.slots), row_scale=(h, eps))
            self.dec.run(self.qkv[:, :HQ * D].view(1, HQ, D), self.caches[i], out=self.attn)
        fp8_row_gemv(self.attn.view(1, HQ * D), *w["o"], h, accumulate=True, **variant(self, i, "o"))
        fp8_row_gemv(h, *w["gate_up"], self.act, col_scale=self.g[2 * i + 1], silu_eps=eps,
                     **variant(self, i, "gate_up"))
        fp8_row_gemv(self.act, *w["down"], h, accumulate=True, **variant(self, i, "down"))


def _kw(config: Optional[tuple] = None, pf_self: bool = False, nxt: Optional[dict] = None, at: int = 2,
        pf_min: int = 256) -> Callable[[Layers, int, str], dict]:
    """A variant: launch ``config`` (None: ``pick_config``'s), own rows prefetched before the PDL wait,
    ``nxt``: linear -> MB of the next weight it prefetches into L2 (0: all of it), at ``at`` (1: the
    program's start, 2: after its weight loop)."""
    def kw(lay: Layers, i: int, name: str) -> dict:
        out: dict = dict(config=config, pf_self=pf_self)
        if nxt and name in nxt:
            out.update(prefetch=lay.next_weight(i, name), pf_bytes=(nxt[name] * MB) or None, pf_at=at,
                       pf_min=pf_min)
        return out
    return kw


VARIANTS: dict[str, Callable[[Layers, int, str], dict]] = {
    "base": _kw(),
    "own rows before the wait": _kw(pf_self=True),
    "qkv -> all of o": _kw(nxt={"qkv": 0}),
    "qkv -> all of o, at start": _kw(nxt={"qkv": 0}, at=1),
    "qkv -> all of o, 2 KB a thread": _kw(nxt={"qkv": 0}, pf_min=2048),
    "qkv -> o, own rows": _kw(pf_self=True, nxt={"qkv": 0}),
    "each -> next 8 MB": _kw(nxt={"qkv": 8, "o": 8, "gate_up": 8, "down": 8}),
    "qkv -> o, others -> next 8 MB": _kw(nxt={"qkv": 0, "o": 8, "gate_up": 8, "down": 8}),
    "qkv -> o, others -> next 16 MB": _kw(nxt={"qkv": 0, "o": 16, "gate_up": 16, "down": 16}),
    "qkv -> o, o -> 16 MB of gate_up": _kw(nxt={"qkv": 0, "o": 16}),
    "qkv -> o, down -> 12 MB of qkv": _kw(nxt={"qkv": 0, "down": 12}),
    "(8, 2048, 8)": _kw(config=(8, 2048, 8, True)),
    "(4, 2048, 8)": _kw(config=(4, 2048, 8, True)),
    "(16, 1024, 8)": _kw(config=(16, 1024, 8, True)),
    "(8, 2048, 8) qkv -> o": _kw(config=(8, 2048, 8, True), nxt={"qkv": 0}),
    "(8, 2048, 8) qkv -> o, own rows": _kw(config=(8, 2048, 8, True), pf_self=True, nxt={"qkv": 0}),
}


def main(argv: Optional[list[str]] = None) -> None:
    """Run the bench and print it (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="layers of distinct weights")
    ap.add_argument("--passes", type=int, default=4, help="passes over them in one graph")
    ap.add_argument("--kv", type=int, default=512, help="cached tokens attention reads")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variants", nargs="*", default=None, help="names of VARIANTS (default: all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the fp8 layer bench needs a CUDA GPU")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gpu_ops.enable_fused()
    lay = Layers(args.layers, args.kv, dev)
    wbytes = sum(w.numel() for w, _ in lay.w[0].values())
    print(f"device: {torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s; {wbytes / 1e6:.0f} MB of weights a "
          f"layer ({wbytes / bw * 1e6:.1f} µs at the copy rate), {args.layers} layers x {args.passes} passes a graph")
    rows = [(name, VARIANTS[name], True) for name in (args.variants or VARIANTS)]
    rows.insert(1, ("base, linears only", VARIANTS["base"], False))
    for name, variant, gaps in rows:
        def step(v=variant, g=gaps) -> None:
            for _ in range(args.passes):
                for i in range(args.layers):
                    lay.run(i, v, g)
        try:
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            t = median_seconds(graph.replay, args.reps) / (args.passes * args.layers)
        except Exception as e:   # noqa: BLE001 - a launch this GPU refuses: report and go on
            print(f"{name:<36} failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
            continue
        tbs = wbytes / t / 1e12
        print(f"{name:<36} {t * 1e6:7.1f} µs a layer  {tbs:5.2f} TB/s  {tbs * 1e12 / bw:5.1%} of copy  "
              f"(x32 layers: {t * 32e3:5.2f} ms)")


if __name__ == "__main__":
    main()
