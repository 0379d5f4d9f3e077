"""``python -m nbgen.bench.fp8_layers`` — batch-1 fp8 decoder layers of Llama-3.1-8B as a decode step runs
them, replayed from one CUDA graph (CUDA).

A layer is the engine's launch sequence for a folded fp8 layer at one row: the qkv GEMV (the input norm's
weight as column scale), the fused RoPE with the norm's row factor and the K/V write, decode attention over
``--kv`` cached tokens, o_proj added into the residual stream, gate|up with SiLU-and-mul in the epilogue,
down_proj added into the stream (``kernels/fp8_row_gemv.py`` for the four linears). ``--layers`` layers of
distinct weights (far more bytes than the L2 cache) run ``--passes`` times in one graph, so the kernels'
ramp-up and tail, the attention-sized gaps and PDL's overlap between launches count as in the engine (the
per-kernel view is ``nbgen.bench.fp8_gemv``). Per launch of the one-row kernel (``pick_config``'s and the
``CONFIGS`` alternatives): µs a layer, TB/s of weight bytes (218 MB a layer), the share of the copy rate
and 32 layers' time; ``linears only`` drops RoPE and attention (what the gaps between the linears cost).

    python -m nbgen.bench.fp8_layers [--layers 8] [--passes 4] [--kv 512]
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from nbgen.bench.floor import copy_bandwidth, median_seconds
from nbgen.kernels import gpu_ops
from nbgen.kernels import qk_norm_rope as rope
from nbgen.kernels import triton_decode as td
from nbgen.kernels.fp8_row_gemv import fp8_row_gemv
from nbgen.kernels.kv_write import KVTarget

HQ, HKV, D, HIDDEN, INTER, P = 32, 8, 128, 4096, 14336, 16       # Llama-3.1-8B, KV page size


def _weight(n: int, k: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight [n, k] and its per-row scales (small: the residual stream stays finite)."""
    w = torch.empty(n, k, device=dev, dtype=torch.float8_e4m3fn)
    for r in range(0, n, 4096):
        w[r:r + 4096] = torch.randn(min(4096, n - r), k, device=dev).mul_(0.5).to(torch.float8_e4m3fn)
    return w, torch.rand(n, device=dev) / (448 * k ** 0.5)


class Layers:
    """``n`` layers' weights, KV caches and the step's buffers; ``run(i, config)`` launches layer i."""

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

    def run(self, i: int, config: Optional[tuple] = None, gaps: bool = True) -> None:
        """Layer i's launches; ``config``: the one-row kernel's launch (None: ``pick_config``'s); ``gaps``:
        with RoPE and attention between qkv and o."""
        w, h, eps = self.w[i], self.h, 1e-5
        fp8_row_gemv(h, *w["qkv"], self.qkv, col_scale=self.g[2 * i], config=config)
        if gaps:
            rope.qk_norm_rope_(self.qkv, self.pos, None, None, 0.0, self.cos_sin, HQ, HKV, D,
                               kv=KVTarget(*self.caches[i], self.slots), row_scale=(h, eps))
            self.dec.run(self.qkv[:, :HQ * D].view(1, HQ, D), self.caches[i], out=self.attn)
        fp8_row_gemv(self.attn.view(1, HQ * D), *w["o"], h, accumulate=True, config=config)
        fp8_row_gemv(h, *w["gate_up"], self.act, col_scale=self.g[2 * i + 1], silu_eps=eps, config=config)
        fp8_row_gemv(self.act, *w["down"], h, accumulate=True, config=config)


# the one-row kernel's launches compared: (BLOCK_N, BLOCK_K, warps, x_once); None: pick_config's
CONFIGS: list[Optional[tuple]] = [None, (8, 2048, 8, True), (16, 1024, 8, True), (4, 2048, 8, True)]


def main(argv: Optional[list[str]] = None) -> None:
    """Run the bench and print it (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="layers of distinct weights")
    ap.add_argument("--passes", type=int, default=4, help="passes over them in one graph")
    ap.add_argument("--kv", type=int, default=512, help="cached tokens attention reads")
    ap.add_argument("--reps", type=int, default=10)
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
    rows = [(f"{cfg or 'pick_config'}", cfg, True) for cfg in CONFIGS]
    rows.insert(1, ("pick_config, linears only", None, False))
    for name, cfg, gaps in rows:
        def step(c: Optional[tuple] = cfg, g: bool = gaps) -> None:
            for _ in range(args.passes):
                for i in range(args.layers):
                    lay.run(i, c, g)
        try:
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            t = median_seconds(graph.replay, torch.device("cuda"), args.reps) / (args.passes * args.layers)
        except Exception as e:   # noqa: BLE001 - a launch this GPU refuses: report and go on
            print(f"{name:<36} failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
            continue
        tbs = wbytes / t / 1e12
        print(f"{name:<36} {t * 1e6:7.1f} µs a layer  {tbs:5.2f} TB/s  {tbs * 1e12 / bw:5.1%} of copy  "
              f"(x32 layers: {t * 32e3:5.2f} ms)")


if __name__ == "__main__":
    main()
