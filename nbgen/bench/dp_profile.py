"""Where a data-parallel run's time goes:
``python -m nbgen.bench.dp_profile --model DIR --load-format dummy --sizes 1,2``.

Runs a workload (W-nano by default) once per ``dp_size`` in ``--sizes``, one engine after the other in
this process, and prints per run: seconds and speed-up over the first size; per replica the requests
and output tokens routed to it, its steps, the first and last step (s into the timed run: start-up
delay and tail), ms per step split into the wait for the device and the host's own work, mean rows
per step over ten equal spans of the run; the CPU seconds of each thread of the process (the loop
threads, the caller's, others summed) as a share of the run; and a GIL probe's lateness (a thread
sleeping 1 ms at a time: how long it waits to run again).

``--shard K/N`` runs only the requests the data-parallel router would send to replica K of N (all
submitted in one call, as here; ``--step-cost``: its router's), and ``--start-at`` starts the timed run at a wall-clock time: N such
processes, one per GPU, are dp N without a shared process (the control for what one process costs).
``--switch-interval`` sets the interpreter's GIL switch interval (``sys.setswitchinterval``).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any, Optional

import torch

from nbgen.bench.dp_trace import GilProbe, ReplicaTrace, ThreadCpu
from nbgen.bench.floor import copy_bandwidth, model_bytes
from nbgen.bench.report import add_json_option, write_json
from nbgen.bench.workloads import make_workload
from nbgen.engine import Engine
from nbgen.runtime.dp_router import PlanItem, Router, request_cost

__all__ = ["main", "profile_run"]


def _route_counter(replica: Any, counts: list[int]) -> None:
    """Count the requests and output tokens submitted to ``replica`` into ``counts`` [requests, tokens]."""
    submit = replica.submit

    def counted(reqs: list[Any], sink: Any, stream: bool) -> None:
        counts[0] += len(reqs)
        counts[1] += sum(r.params.max_new_tokens or 0 for r in reqs)
        submit(reqs, sink, stream)
    replica.submit = counted


def shard(prompts: list[list[int]], outs: list[int], k: int, n: int,
          step_cost: int = 0) -> tuple[list[list[int]], list[int]]:
    """The requests a dp-``n`` router (``step_cost``: the engine's, the weights in KV tokens) plans
    for replica ``k`` when all are submitted in one call."""
    plan = Router(n, step_cost).plan([PlanItem(request_cost(len(p), o), max(o, 1)) for p, o in zip(prompts, outs)])
    keep = [i for i, r in enumerate(plan) if r == k]
    return [prompts[i] for i in keep], [outs[i] for i in keep]


def profile_run(model: Optional[str], load_format: str, device: str, dp_size: int,
                prompts: list[list[int]], outs: list[int], start_at: float = 0.0) -> dict[str, Any]:
    """One engine at ``dp_size``: the timed run of ``prompts`` with its replicas' traces (started no
    earlier than ``start_at``, a ``time.time()``)."""
    kw: dict[str, Any] = {"device": device, "load_format": load_format}
    if dp_size > 1:
        kw["dp_size"] = dp_size
    t0 = time.perf_counter()
    eng = Engine(model, **kw) if model else Engine(**kw)
    startup = time.perf_counter() - t0
    sps = [{"max_new_tokens": o, "temperature": 0.0, "ignore_eos": True} for o in outs]
    eng.generate(input_ids=[p[:64] for p in prompts[:4]], sampling_params={"max_new_tokens": 8, "ignore_eos": True},
                 use_tqdm=False)
    replicas = list(getattr(eng.loop, "replicas", [eng.loop]))
    runner = replicas[0].runner
    spec = runner.kv_spec
    wb, kvb = model_bytes(runner.model, runner.hf_config, spec.bytes_per_page() // spec.page_size)
    del runner, spec
    bw = copy_bandwidth(torch.device(device))
    traces = [ReplicaTrace(r) for r in replicas]
    routed = [[0, 0] for _ in replicas]
    for r, c in zip(replicas, routed):
        _route_counter(r, c)
    cpu, probe = ThreadCpu(), GilProbe()
    gc.collect()
    if start_at > time.time():
        time.sleep(start_at - time.time())
    cpu.start()
    probe.start()
    t0 = time.perf_counter()
    res = eng.generate(input_ids=prompts, sampling_params=sps, use_tqdm=False)
    t1 = time.perf_counter()
    gil = probe.stop()
    used = cpu.stop()
    names = ThreadCpu.names()
    loops = {t.tid: i for i, t in enumerate(traces)}
    threads: dict[str, float] = {}
    for tid, c in used.items():
        label = (f"replica {loops[tid]}" if tid in loops else names.get(tid, "native"))
        threads[label] = threads.get(label, 0.0) + c
    rows = [{"replica": i, "requests": routed[i][0], "max_new_tokens": routed[i][1],
             **t.summary(t0, t1, lambda kv: (wb + kv * kvb) / bw)} for i, t in enumerate(traces)]
    for t in traces:
        t.close()
    out = {"dp_size": dp_size, "seconds": t1 - t0, "startup_s": startup,
           "out_tokens": sum(r["meta_info"]["completion_tokens"] for r in res),
           "replicas": rows, "thread_cpu_s": threads, "gil_probe": gil, "copy_bw": bw,
           "weight_bytes": wb, "kv_bytes_per_token": kvb}
    eng.shutdown()
    del eng, res, traces, replicas
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()     # the next size's engine measures the free memory for its KV pool
    return out


def _print(run: dict[str, Any], base: Optional[float]) -> None:
    s = run["seconds"]
    print(f"\ndp {run['dp_size']}: {s:.2f} s, {run['out_tokens'] / s:.0f} out tok/s"
          + (f", {base / s:.2f}x the first size" if base else "") + f"  (startup {run['startup_s']:.1f} s; "
          f"copy {run['copy_bw'] / 1e9:.0f} GB/s, weights {run['weight_bytes'] / 1e9:.2f} GB, "
          f"KV {run['kv_bytes_per_token'] / 1e3:.1f} KB/token)")
    for r in run["replicas"]:
        if not r["steps"]:
            print(f"  replica {r['replica']}: no steps")
            continue
        print(f"  replica {r['replica']}: {r['requests']} reqs, {r['max_new_tokens']} out tok routed; "
              f"{r['steps']} steps ({r['prefill_steps']} with prefill), first {r['first_s'] * 1e3:.0f} ms, "
              f"last {r['last_s']:.2f} s (tail {s - r['last_s']:.2f} s); {r['step_ms']:.2f} ms/step = "
              f"device wait {r['wait_ms']:.2f} + host {r['host_ms']:.2f}; rows mean {r['rows_mean']:.0f}")
        print(f"    its steps {r['steps_s']:.2f} s against their floor {r['floor_s']:.2f} s "
              f"({100 * r['floor_s'] / r['steps_s']:.1f} % of floor); by tenth of the run:")
        for k in ("rows", "steps", "ms", "floor_ms"):
            print(f"      {k + '/step' if k == 'rows' else k:9s} {r[k + '_by_window']}")
    cpu = sorted(run["thread_cpu_s"].items(), key=lambda kv: -kv[1])
    print("  thread CPU (share of the run): " + ", ".join(f"{k} {100 * v / s:.0f}%" for k, v in cpu[:8])
          + f"; all {100 * sum(v for _, v in cpu) / s:.0f}%")
    g = run["gil_probe"]
    if g.get("wakes"):
        print(f"  GIL probe (1 ms sleeps): {g['wakes']} wakes, late mean {g['mean_ms']:.2f} ms, "
              f"p90 {g['p90_ms']:.2f} ms, max {g['max_ms']:.1f} ms")


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m nbgen.bench.dp_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF dir (config.json); default: the embedded model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--workload", default="nano", choices=["nano", "fixed"])
    ap.add_argument("--sizes", default="1,2", help="dp sizes to run, comma-separated (the first is the base)")
    ap.add_argument("--requests", type=int, default=None, help="only the workload's first N requests")
    ap.add_argument("--shard", default=None, metavar="K/N", help="only replica K's requests of a dp-N split")
    ap.add_argument("--step-cost", type=int, default=0,
                    help="the router's step cost for --shard (a dp engine's router.step_cost)")
    ap.add_argument("--start-at", type=float, default=0.0, help="time.time() at which the timed runs start")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)")
    add_json_option(ap, "the runs")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        raise ValueError(f"sizes must be comma-separated integers, got {args.sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be >= 1, got {args.sizes!r}")
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"requests must be >= 1, got {args.requests}")
    prompts, outs = make_workload(args.workload)
    if args.requests:
        prompts, outs = prompts[:args.requests], outs[:args.requests]
    if args.shard:
        try:
            k, n = (int(x) for x in args.shard.split("/"))
        except ValueError:
            raise ValueError(f"shard must be K/N, got {args.shard!r}") from None
        if not 0 <= k < n:
            raise ValueError(f"shard must be K/N with 0 <= K < N, got {args.shard!r}")
        prompts, outs = shard(prompts, outs, k, n, args.step_cost)
    if args.switch_interval is not None:
        if args.switch_interval <= 0:
            raise ValueError(f"switch_interval must be > 0, got {args.switch_interval}")
        sys.setswitchinterval(args.switch_interval)
    runs: list[dict[str, Any]] = []
    for n in sizes:
        runs.append(profile_run(args.model, args.load_format, args.device, n, prompts, outs, args.start_at))
        _print(runs[-1], runs[0]["seconds"] if len(runs) > 1 else None)
    write_json(args.json, runs)
    return runs


if __name__ == "__main__":
    main()
