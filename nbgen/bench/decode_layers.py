"""``python -m nbgen.bench.decode_layers`` — batch-1 decoder layers of Llama-3.1-8B as a decode step runs
them, bf16 or fp8, whole or as one tensor-parallel rank's shard, replayed from one CUDA graph (CUDA).

A layer is the engine's launch sequence for a folded layer at one row: the qkv GEMV (the input norm's
weight folded in), the fused RoPE with the norm's row factor and the K/V write (fp8: both in one launch,
``kernels/fp8_qkv_rope.py``, unless ``--sweep`` changes qkv's launch), decode attention over
``--kv`` cached tokens, o_proj added into the residual stream, gate|up with SiLU-and-mul in the epilogue,
down_proj added into the stream. bf16 runs ``kernels/small_gemm.py``'s one-row kernel, fp8
``kernels/fp8_row_gemv.py``'s. ``--tp N`` gives a rank's shard (heads and the intermediate size / N);
the two all-reduces a tp layer adds are not in it (``nbgen.bench.all_reduce`` times those), so the
difference to the engine's tp step is theirs. ``--layers`` layers of distinct weights (far more bytes than
the L2 cache) run ``--passes`` times in one graph, so the kernels' ramp-up and tail, the attention-sized
gaps and PDL's overlap between launches count as in the engine. Printed: µs a layer, TB/s of weight bytes,
the share of the copy rate and 32 layers' time, for the default launches, the linears alone (what RoPE and
attention cost) and the one-row kernel's alternative launches (``--sweep``: one linear's tiles changed at a
time; ``--sweep prefetch``, fp8: how many weight tiles the one-row kernels load before their PDL wait, 1, 2
or 4 for one linear and for all four; the default is the engine's: ``EARLY_TILES_AFTER_ATTENTION`` for o,
1 elsewhere).

    python -m nbgen.bench.decode_layers [--dtype bf16|fp8] [--tp 1] [--sweep [tiles|prefetch]] [--layers 8]
                                        [--passes 4] [--kv 512]
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from nbgen.bench.floor import copy_bandwidth
from nbgen.bench.fp8_kernels import graph_time
from nbgen.kernels import fp8_qkv_rope, fp8_row_gemv, gpu_ops
from nbgen.kernels import qk_norm_rope as rope
from nbgen.kernels import small_gemm
from nbgen.kernels import triton_decode as td
from nbgen.kernels.kv_write import KVTarget

HQ, HKV, D, HIDDEN, INTER, P = 32, 8, 128, 4096, 14336, 16       # Llama-3.1-8B, KV page size
LINEARS = ("qkv", "o", "gate_up", "down")

# alternative launches swept: small_gemm (BLOCK_N, BLOCK_K, warps, stages) at one row; fp8_row_gemv
# (BLOCK_N, BLOCK_K, warps, x_once)
BF16_CONFIGS = [(2, 1024, 4, 4), (2, 2048, 8, 4), (4, 512, 4, 4), (4, 1024, 4, 4), (4, 1024, 8, 4), (4, 1024, 8, 3),
                (4, 2048, 8, 4), (8, 512, 4, 4), (8, 1024, 4, 4), (8, 1024, 8, 4), (16, 512, 8, 4)]
FP8_CONFIGS = [(4, 2048, 4, True), (8, 1024, 4, True), (8, 2048, 4, True), (8, 2048, 8, True), (16, 1024, 4, True),
               (16, 1024, 8, True), (16, 2048, 4, True), (16, 2048, 8, False), (32, 1024, 8, True), (32, 2048, 8, True)]
# weight tiles the one-row fp8 kernels load before their PDL wait (``early_tiles``), swept on pick_config's tiles
EARLY_TILES = (1, 2, 4)


def _weight(n: int, k: int, fp8: bool, dev: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A random weight [n, k] (small: the residual stream stays finite): bf16, or e4m3 with per-row scales."""
    if not fp8:
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16).mul_(0.5 / k ** 0.5), None
    w = torch.empty(n, k, device=dev, dtype=torch.float8_e4m3fn)
    for r in range(0, n, 4096):
        w[r:r + 4096] = torch.randn(min(4096, n - r), k, device=dev).mul_(0.5).to(torch.float8_e4m3fn)
    return w, torch.rand(n, device=dev) / (448 * k ** 0.5)


class Layers:
    """``n`` layers' weights (one rank's shard at ``tp``), KV caches and the step's buffers;
    ``run(i, configs, gaps, early)`` launches layer i."""

    def __init__(self, n: int, kv: int, fp8: bool, tp: int, dev: torch.device) -> None:
        self.fp8, self.hq, self.hkv, inter = fp8, HQ // tp, max(HKV // tp, 1), INTER // tp
        # fp8 one-row launches' early tiles, as the engine's (o_proj follows attention)
        self.early = {name: 1 for name in LINEARS}
        self.early["o"] = fp8_row_gemv.EARLY_TILES_AFTER_ATTENTION if fp8 else 1
        shapes = {"qkv": ((self.hq + 2 * self.hkv) * D, HIDDEN), "o": (HIDDEN, self.hq * D),
                  "gate_up": (2 * inter, HIDDEN), "down": (HIDDEN, inter)}
        self.w = [{name: _weight(*shapes[name], fp8, dev) for name in LINEARS} for _ in range(n)]
        self.g = [(torch.rand(HIDDEN, device=dev) + 0.5).bfloat16() for _ in range(2 * n)]
        pages = -(-(kv + 1) // P)
        self.caches = [(torch.randn(pages + 1, self.hkv, P, D, device=dev).bfloat16(),
                        torch.randn(pages + 1, self.hkv, P, D, device=dev).bfloat16()) for _ in range(n)]
        self.slots = torch.tensor([P + kv], device=dev)               # token kv, on page 1 onward
        self.pos = torch.tensor([kv], device=dev)
        self.cos_sin = torch.randn(kv + 1, D, device=dev)
        self.dec = td.TritonDecodeWrapper(self.hq, self.hkv, D, P, dev)
        self.dec.plan(torch.tensor([0, pages], dtype=torch.int32).pin_memory(),     # the plan's host tables
                      torch.arange(1, pages + 1, dtype=torch.int32).pin_memory(),
                      torch.tensor([(kv + 1) - (pages - 1) * P], dtype=torch.int32).pin_memory())
        self.h = torch.randn(1, HIDDEN, device=dev).bfloat16()
        self.qkv = torch.empty(1, shapes["qkv"][0], device=dev, dtype=torch.bfloat16)
        self.attn = torch.empty(1, self.hq, D, device=dev, dtype=torch.bfloat16)
        self.act = torch.empty(1, inter, device=dev, dtype=torch.bfloat16)

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w, _ in self.w[0].values())

    def _linear(self, name: str, i: int, x: torch.Tensor, cfg: Optional[tuple], out: Optional[torch.Tensor] = None,
                accumulate: bool = False, silu_eps: Optional[float] = None, early: int = 1) -> torch.Tensor:
        """One linear of layer i at one row, as the engine launches it -> its output; ``early``: fp8's
        early tiles."""
        w, sw = self.w[i][name]
        if self.fp8:   # a folded norm's weight is the quantizer's column scale
            col = {"qkv": self.g[2 * i], "gate_up": self.g[2 * i + 1]}.get(name)
            return fp8_row_gemv.fp8_row_gemv(x, w, sw, out, col_scale=col, accumulate=accumulate, silu_eps=silu_eps,
                                             config=cfg, early_tiles=early)
        # bf16: a folded norm's weight is in W, its row factor in the RoPE kernel (qkv) or the epilogue
        return small_gemm.small_gemm(x, w, silu_mul=silu_eps is not None, row_scale_eps=silu_eps,
                                     accumulate=out if accumulate else None, config=cfg)

    def run(self, i: int, configs: dict[str, Optional[tuple]], gaps: bool = True,
            early: Optional[dict[str, int]] = None) -> None:
        """Layer i's launches; ``configs``: the one-row kernel's launch per linear (missing: the default);
        ``gaps``: with RoPE and attention between qkv and o; ``early``: fp8 early tiles per linear (missing:
        the engine's)."""
        h, eps, c = self.h, 1e-5, configs.get
        e = {**self.early, **(early or {})}
        kv = KVTarget(*self.caches[i], self.slots)
        if gaps and self.fp8 and c("qkv") is None:   # the engine's fp8 launch: projection + RoPE + K/V write
            w, sw = self.w[i]["qkv"]
            qkv = fp8_qkv_rope.qkv_rope(h, w, sw, None, self.g[2 * i], self.pos, self.cos_sin, self.hq, self.hkv, D,
                                        kv, row_scale_eps=eps, early_tiles=e["qkv"])
        else:
            qkv = self._linear("qkv", i, h, c("qkv"), out=self.qkv, early=e["qkv"])
            if gaps:
                rope.qk_norm_rope_(qkv, self.pos, None, None, 0.0, self.cos_sin, self.hq, self.hkv, D, kv=kv,
                                   row_scale=(h, eps))
        if gaps:
            self.dec.run(qkv[:, :self.hq * D].view(1, self.hq, D), self.caches[i], out=self.attn)
        self._linear("o", i, self.attn.view(1, self.hq * D), c("o"), out=h, accumulate=True, early=e["o"])
        act = self._linear("gate_up", i, h, c("gate_up"), out=self.act, silu_eps=eps, early=e["gate_up"])
        self._linear("down", i, act, c("down"), out=h, accumulate=True, early=e["down"])


def _time(lay: Layers, configs: dict[str, Optional[tuple]], gaps: bool, early: dict[str, int],
          args: argparse.Namespace) -> Optional[float]:
    """Seconds a layer: every layer ``args.passes`` times in one graph, median of ``args.reps`` replays;
    None when this GPU refuses a launch."""
    try:
        return graph_time(lambda i: lay.run(i, configs, gaps, early), args.layers, args.passes * args.layers,
                          args.reps)
    except Exception as e:   # noqa: BLE001 - a launch this GPU refuses: report and go on
        print(f"  {configs} failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
        return None


def main(argv: Optional[list[str]] = None) -> None:
    """Run the bench and print it (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="the linears' weights")
    ap.add_argument("--tp", type=int, default=1, help="one rank's shard of a tp layer (no all-reduce)")
    ap.add_argument("--sweep", nargs="?", const="tiles", choices=("tiles", "prefetch"),
                    help="the one-row kernel's alternative launches: tiles, or (fp8) the tiles loaded before its wait")
    ap.add_argument("--layers", type=int, default=8, help="layers of distinct weights")
    ap.add_argument("--passes", type=int, default=4, help="passes over them in one graph")
    ap.add_argument("--kv", type=int, default=512, help="cached tokens attention reads")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the decode layer bench needs a CUDA GPU")
    if args.tp not in (1, 2, 4, 8):
        raise SystemExit(f"--tp {args.tp}: 1, 2, 4 or 8")
    if args.sweep == "prefetch" and args.dtype != "fp8":
        raise SystemExit("--sweep prefetch: fp8 (the one-row fp8 kernels)")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gpu_ops.enable_fused()
    fp8 = args.dtype == "fp8"
    lay = Layers(args.layers, args.kv, fp8, args.tp, dev)
    wbytes = lay.weight_bytes()
    print(f"device: {torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s; {args.dtype} tp {args.tp}: "
          f"{wbytes / 1e6:.0f} MB of weights a layer ({wbytes / bw * 1e6:.1f} µs at the copy rate), "
          f"{args.layers} layers x {args.passes} passes a graph")
    rows: list[tuple[str, dict[str, Optional[tuple]], bool, dict[str, int]]] = [
        ("default", {}, True, {}), ("linears only", {}, False, {})]
    if args.sweep == "tiles":
        swept = FP8_CONFIGS if fp8 else BF16_CONFIGS
        rows += [(f"{name} {cfg}", {name: cfg}, True, {}) for name in LINEARS for cfg in swept]
    elif args.sweep == "prefetch":
        for early in EARLY_TILES:
            rows += [(f"all early {early}", {}, True, {name: early for name in LINEARS})]
            rows += [(f"{name} early {early}", {}, True, {name: early}) for name in LINEARS
                     if early != lay.early[name]]
    for name, configs, gaps, early in rows:
        t = _time(lay, configs, gaps, early, args)
        if t is not None:
            tbs = wbytes / t / 1e12
            print(f"{name:<32} {t * 1e6:7.1f} µs a layer  {tbs:5.2f} TB/s  {tbs * 1e12 / bw:5.1%} of copy  "
                  f"(x32 layers: {t * 32e3:5.2f} ms)")


if __name__ == "__main__":
    main()
