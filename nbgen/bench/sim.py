"""Schedule cost model: ``python -m nbgen.bench.sim --schedule-policy lof --chunked-prefill-size 8192,512,384``.

Runs nbgen's own torch-free Scheduler over a bench workload with a fake runner (every request runs to
its ``max_new_tokens``, as the bench's ignore_eos requests do), records the shape of each step, and
prices the steps with a model of one GPU step:

- the decoder's linear layers: a measured time for the step's row count, padded as the engine pads
  it (decode-only steps to a decode graph size, steps with a prefill chunk to a prefill-graph bucket);
- decode attention: the KV it reads at the copy bandwidth; prefill attention: its FLOPs at the matmul rate;
- the LM head: its weight read, or its FLOPs where more rows are sampled than that covers;
- everything else (norm/RoPE/SiLU kernels, launches): a rough per-step plus per-row term from a profile.

The defaults describe Llama-3.1-8B on the H100 of docs/benchmarks.md (GEMM times from a cuBLAS
sweep); there the model is a few percent below measured times (it is optimistic) and ranks the
schedules as the GPU does. ``--ideal-gemm-tflops R`` replaces the measured GEMMs with a GEMM that reads its weights
at the copy bandwidth while computing at R TFLOP/s (whichever is slower): what no real kernel does near
the ridge point, so the answer bounds what a better GEMM could buy for a given schedule.
"""
from __future__ import annotations

import argparse
import bisect
from dataclasses import dataclass, replace
from typing import Optional

from nbgen.bench.floor import floor_seconds
from nbgen.bench.workloads import make_workload
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.core.batch import StepOutput
from nbgen.kernels.batch_sizes import padded_batch_size
from nbgen.runtime.prefill_graphs import DEFAULT_MAX_TOKENS, bucket_for, token_buckets
from nbgen.core.request import LogprobRequest, Request
from nbgen.runtime.scheduler import Scheduler
from nbgen.core.sampling import SamplingParams

# Llama-3.1-8B's 32 layers of qkv, o, gate|up, down in one CUDA graph, cuBLAS, H100 (rows, seconds);
# measured in one CUDA graph per row count. The cost is bumpy (448 rows take longer than 512).
H100_LLAMA8B_GEMM = [(16, 5.303e-3), (32, 5.384e-3), (64, 5.462e-3), (96, 5.651e-3), (128, 5.780e-3),
                     (160, 5.973e-3), (192, 5.932e-3), (224, 6.559e-3), (256, 6.753e-3), (288, 8.246e-3),
                     (320, 7.983e-3), (352, 9.078e-3), (384, 9.030e-3), (416, 10.501e-3), (448, 14.284e-3),
                     (480, 11.562e-3), (512, 11.359e-3), (640, 14.217e-3), (768, 16.672e-3),
                     (1024, 21.114e-3), (2048, 41.390e-3), (8192, 164.237e-3)]


@dataclass(frozen=True)
class StepShape:
    """What one scheduled step computes."""

    rows: int              # tokens through the linear layers (decode rows + prefill chunk tokens)
    padded_rows: int       # rows as the engine's graphs pad them
    decode_kv: int         # KV tokens the step's output-token rows read (their lengths, new token included)
    prefill_pairs: int     # causal (query, key) pairs of the step's prompt rows
    sampled: int           # rows whose logits are computed


@dataclass(frozen=True)
class CostModel:
    """One GPU step's cost; defaults: Llama-3.1-8B (bf16) on an H100."""

    gemm_points: tuple[tuple[int, float], ...] = tuple(H100_LLAMA8B_GEMM)
    bandwidth: float = 2.95e12             # bytes/s, the bench's copy bandwidth
    matmul_rate: float = 7.0e14            # FLOP/s reached by large matmuls
    kv_bytes_per_token: int = 131072       # 32 layers x 8 kv heads x 128 x (K, V) x bf16
    layer_weight_bytes: float = 13.96e9    # the decoder linears (read once a step)
    lm_head_bytes: float = 1.05e9          # 128 256 x 4 096 bf16
    attn_flops_per_pair: float = 4 * 32 * 32 * 128   # q.K^T and P.V, 32 layers x 32 heads x head dim 128
    per_step_s: float = 0.25e-3            # launches, norms, argmax (rough, from the lof-384 profile)
    per_row_s: float = 1.5e-6              # SiLU, RoPE, KV writes per row
    ideal_gemm_rate: Optional[float] = None  # FLOP/s: an ideal GEMM instead of the measured points

    def gemm_seconds(self, rows: int) -> float:
        """The linear layers of one step over ``rows`` rows."""
        if self.ideal_gemm_rate is not None:
            flops = rows * self.layer_weight_bytes          # 2 FLOPs per bf16 weight (2 bytes) and row
            return max(self.layer_weight_bytes / self.bandwidth, flops / self.ideal_gemm_rate)
        pts = self.gemm_points
        i = bisect.bisect_left([m for m, _ in pts], rows)
        if i == len(pts):                                   # beyond the table: the last point's time per row
            return pts[-1][1] * rows / pts[-1][0]
        if i == 0 or pts[i][0] == rows:                     # at a point, or below the first
            return pts[i][1]
        (m0, t0), (m1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (rows - m0) / (m1 - m0)

    def parts(self, s: StepShape) -> dict[str, float]:
        """Seconds of one step by part."""
        head = max(self.lm_head_bytes / self.bandwidth, s.sampled * self.lm_head_bytes / self.matmul_rate)
        return {"gemm": self.gemm_seconds(s.padded_rows),
                "attention": s.decode_kv * self.kv_bytes_per_token / self.bandwidth
                + s.prefill_pairs * self.attn_flops_per_pair / self.matmul_rate,
                "lm_head": head, "other": self.per_step_s + self.per_row_s * s.rows}


def trace(prompts: list[list[int]], outs: list[int], policy: str, budget: int,
          max_running: int = 256, page_size: int = 16, pacing: int = 0) -> list[StepShape]:
    """Every step nbgen's scheduler builds for the workload (KV cache large enough for all of it);
    ``pacing``: the scheduler's ``prefill_pacing_min_tokens`` (0: off)."""
    pages = sum(len(p) + o for p, o in zip(prompts, outs)) // page_size + 2 * len(prompts) + 2
    sched = Scheduler(SchedulerConfig(page_size=page_size, num_pages=pages, max_running_requests=max_running,
                                      chunked_prefill_size=budget, schedule_policy=policy,
                                      prefill_pacing_min_tokens=pacing))
    for k, (p, o) in enumerate(zip(prompts, outs)):
        sched.add(Request(rid=str(k), prompt_ids=list(p), params=SamplingParams(max_new_tokens=o, ignore_eos=True),
                          stop_ids=frozenset(), logprobs=LogprobRequest()))
    buckets = token_buckets(min(budget, DEFAULT_MAX_TOKENS))
    steps: list[StepShape] = []
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None, "the scheduler has work but built no step"
        rows = sum(s.q_len for s in batch.seqs)
        padded = padded_batch_size(rows) if batch.is_decode_only else bucket_for(buckets, rows)
        decode_kv = pairs = 0
        for s in batch.seqs:
            if s.start_pos < len(s.req.prompt_ids):          # prompt rows: a chunk, or a prompt's last token alone
                pairs += s.q_len * s.start_pos + s.q_len * (s.q_len + 1) // 2
            else:                                            # an output token's row: a decode
                decode_kv += s.kv_len
        steps.append(StepShape(rows=rows, padded_rows=padded, decode_kv=decode_kv, prefill_pairs=pairs,
                               sampled=sum(1 for s in batch.seqs if s.sample)))
        n = len(batch.seqs)
        sched.update(batch, StepOutput(next_token_ids=[7 if s.sample else -1 for s in batch.seqs],
                                       output_logprobs=[None] * n, prompt_logprobs=[None] * n))
    return steps


def price(steps: list[StepShape], model: CostModel) -> dict[str, float]:
    """Seconds of the whole trace by part, and in all ("total")."""
    tot: dict[str, float] = {}
    for s in steps:
        for k, v in model.parts(s).items():
            tot[k] = tot.get(k, 0.0) + v
    tot["total"] = sum(tot.values())
    return tot


def main(argv: Optional[list[str]] = None) -> list[dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="nano", choices=["nano", "fixed"])
    ap.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lof"])
    ap.add_argument("--chunked-prefill-size", default="8192", help="one budget or a comma-separated list")
    ap.add_argument("--ideal-gemm-tflops", type=float, default=None)
    ap.add_argument("--prefill-pacing", type=int, default=0,
                    help="the scheduler's prefill_pacing_min_tokens (runtime/prefill_pacing.py); 0: off")
    args = ap.parse_args(argv)
    prompts, outs = make_workload(args.workload)
    model = CostModel()
    if args.ideal_gemm_tflops:
        model = replace(model, ideal_gemm_rate=args.ideal_gemm_tflops * 1e12)
    weights = model.layer_weight_bytes + model.lm_head_bytes
    floor = floor_seconds([len(p) for p in prompts], outs, int(weights), model.kv_bytes_per_token, model.bandwidth)
    rows: list[dict[str, float]] = []
    print(f"workload {args.workload}, policy {args.schedule_policy}, floor {floor:.2f} s"
          + (f", prefill pacing from {args.prefill_pacing} tokens" if args.prefill_pacing else "")
          + (f", ideal GEMM at {args.ideal_gemm_tflops:g} TFLOP/s" if args.ideal_gemm_tflops else ", measured GEMMs"))
    print(f"{'budget':>7} {'steps':>6} {'gemm':>6} {'attn':>6} {'head':>6} {'other':>6} {'total':>7} {'% floor':>8}")
    for b in (int(x) for x in args.chunked_prefill_size.split(",")):
        steps = trace(prompts, outs, args.schedule_policy, b, pacing=args.prefill_pacing)
        t = price(steps, model)
        print(f"{b:7d} {len(steps):6d} {t['gemm']:6.2f} {t['attention']:6.2f} {t['lm_head']:6.2f} "
              f"{t['other']:6.2f} {t['total']:7.2f} {100 * floor / t['total']:7.1f}%")
        rows.append({"budget": b, "steps": len(steps), **t, "floor": floor})
    return rows


if __name__ == "__main__":
    main()
