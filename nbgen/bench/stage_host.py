"""Host cost of a decode step's runner side without a GPU: ``python -m nbgen.bench.stage_host``.

Drives nbgen's torch-free Scheduler (page pool, prefix cache) over W-nano's shape — 256 requests,
prompts and outputs of ``randint(100, 1024)`` tokens, greedy, ``ignore_eos`` — or W-prefix's
(``--workload prefix``: 8 shared 2,000-token prefixes, so the shared-prefix plan finds chunks), with a
fake model whose sampled ids are overlap placeholders, as the overlap stepper applies them. On every
decode-only step it times the runner-side host work the GPU path runs for it:

- ``stage``: ``DecodeStaging.write`` into a staging buffer laid out as the decode graphs' (Qwen3-0.6B's
  heads): page tables, token ids / positions / KV slots, the longest-first order and the shared-prefix
  plan where the batch size has those graphs;
- ``rows``: the forward's batch checks (``is_decode_only``, the sampling rows);
- ``sample``: the sampler's call on [rows, ``--vocab``] float32 logits (a small vocabulary: its host
  work, not the argmax).

Reported: medians per step in µs (thread CPU time by default: the machine may be shared; ``--clock wall``),
over the decode steps with at least ``--min-rows`` rows. The CUDA launches, the one host-to-device copy
and the staging ring's events are not included: ``bench.grammar --phases`` measures those on a GPU.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.page_tables import DecodeTables
from nbgen.bench.report import add_json_option, write_json
from nbgen.bench.workloads import make_workload, prefix_workload
from nbgen.core.batch import StepOutput
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.kernels.batch_sizes import graph_batch_sizes
from nbgen.runtime import cascade_graphs
from nbgen.runtime.decode_staging import DecodeStaging, StagingLayout
from nbgen.runtime.sampler import Sampler
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.step_inputs import placeholder, sampling_rows

PAGE_SIZE = 16
NUM_PAGES = 37521          # Qwen3-0.6B's KV pool on an 80 GB card


class _Backend:
    """What the shared-prefix tables read of the attention backend: its KV spec (Qwen3-0.6B's heads)."""

    def __init__(self, max_bs: int) -> None:
        self.spec = KVCacheSpec(num_layers=28, num_pages=NUM_PAGES, page_size=PAGE_SIZE, num_q_heads=16,
                                num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=torch.device("cpu"))
        self.triton_decode = True


def run(workload: str, steps: int, min_rows: int, vocab: int, clock: Callable[[], float]) -> dict[str, Any]:
    """Schedule the workload with a fake model; per-phase host seconds of every decode-only step."""
    if workload == "prefix":
        prompts, outs, _groups = prefix_workload()
    else:
        prompts, outs = make_workload("nano")
    mb = 256
    sched = Scheduler(SchedulerConfig(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_running_requests=mb,
                                      chunked_prefill_size=8192))
    for i, (p, n) in enumerate(zip(prompts, outs)):
        sched.add(Request(rid=str(i), prompt_ids=p, params=SamplingParams(temperature=0.0, max_new_tokens=n,
                                                                          ignore_eos=True)))
    sizes = graph_batch_sizes(mb)
    casc = cascade_graphs.CascadeTables(_Backend(mb), mb)
    layout = StagingLayout(mb, 4096, PAGE_SIZE, casc.size)
    staging = DecodeStaging(layout, DecodeTables(PAGE_SIZE), sizes, casc, mrope=False)
    bufs = [np.zeros(layout.size, dtype=np.int32) for _ in range(2)]     # the staging ring's two sets
    sampler = Sampler(vocab, torch.device("cpu"))
    logits = torch.randn(mb, vocab)
    times: dict[str, list[float]] = {"stage": [], "rows": [], "sample": []}
    rows_seen, planned, k = [], 0, 0
    while sched.has_work() and len(times["stage"]) < steps:
        batch = sched.schedule()
        if batch is None:
            raise RuntimeError("the scheduler stalled")
        n = len(batch.seqs)
        if batch.is_decode_only and n >= min_rows:
            k ^= 1
            t0 = clock()
            host = staging.write(bufs[k], batch.seqs, None, staging.bs_of[n] >= cascade_graphs.MIN_BS)
            t1 = clock()
            decode = batch.is_decode_only
            seqs, _rows = sampling_rows(batch)
            t2 = clock()
            sampler(logits[: len(seqs)], seqs)
            t3 = clock()
            assert decode
            times["stage"].append(t1 - t0)
            times["rows"].append(t2 - t1)
            times["sample"].append(t3 - t2)
            rows_seen.append(n)
            planned += host.plan is not None
        fake, j = [-1] * n, 0
        for i, s in enumerate(batch.seqs):
            if s.sample:
                fake[i], j = placeholder(j), j + 1
        sched.update(batch, StepOutput(fake, [None] * n, [None] * n))
    med = {name: 1e6 * statistics.median(v) for name, v in times.items() if v}
    return {"workload": workload, "steps": len(rows_seen), "rows_median": statistics.median(rows_seen) if rows_seen else 0,
            "cascade_steps": planned, "us_per_step": {**med, "total": sum(med.values())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="nano", choices=["nano", "prefix"])
    ap.add_argument("--steps", type=int, default=400, help="decode steps timed")
    ap.add_argument("--min-rows", type=int, default=192, help="time the decode steps with at least this many rows")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--clock", default="thread", choices=["thread", "wall"])
    add_json_option(ap, "the results")
    args = ap.parse_args()
    random.seed(0)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    res = run(args.workload, args.steps, args.min_rows, args.vocab, clock)
    us = res["us_per_step"]
    print(f"workload {res['workload']}: {res['steps']} decode steps (median {res['rows_median']:.0f} rows, "
          f"{res['cascade_steps']} with a shared-prefix plan), {args.clock} clock, µs per step (median): "
          + ", ".join(f"{k} {v:.1f}" for k, v in us.items()))
    write_json(args.json, res)


if __name__ == "__main__":
    main()
