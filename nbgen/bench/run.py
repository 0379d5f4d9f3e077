"""Throughput benchmark: ``python -m nbgen.bench --model DIR --load-format dummy --workload nano``.

Workloads (DESIGN.md "Benchmarks"; all ignore_eos, greedy, ``random.seed(0)``, random ids < 10000):
  nano   256 seqs, input and output lengths randint(100, 1024)
  fixed  256 seqs, input randint(100, 1024), output exactly 512 (comparable with HF generate_batch)
  bs1    1 seq, 256 in / 256 out (decode latency)
  prefix 256 seqs = 8 shared 2,000-token prefixes + own randint(50, 300) tokens, outputs randint(100, 512);
         also measured against the shared floor (each distinct KV token read once per step, each
         prefix prefilled once: what a shared-prefix attention would need)
  chat32 (CPU mode) 32 chat-templated short questions x 64 new tokens
``--temperature 0.6`` samples instead (nano-vllm's bench does); ``--text`` sends the prompts as text
(each prompt's ids decoded with the tokenizer, ``--tokenizer-path`` for a directory without one) and
the outputs come back as text (incremental detokenization of every token): the path a notebook
user's prompts take, against the ids-only run; ``--stream`` sends every prompt as its own
``stream=True`` request, all at once.
The floor is the bytes a perfect engine must read in its decode steps (weights once per step plus
every live sequence's KV), divided by the device copy bandwidth measured in the same run (on CUDA the
faster of one copy test before and one after the engines; on a CPU after them only). Decode
steps are counted as if all sequences ran together (step j reads (in_i + j) KV tokens of each seq
with out_i > j); prefill is not in the floor. A second figure adds the prompts' prefill FLOPs at the
bf16 matmul rate measured in the same run ("floor+pf"; see ``nbgen.bench.floor``).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from typing import Any, Optional

import torch

from nbgen.bench.floor import (copy_bandwidth, floor_seconds, matmul_rate, model_bytes, prefill_flops,
                               roofline_seconds, shared_floor_seconds)
from nbgen.bench.hf import run_hf
from nbgen.bench.phases import PhaseTimer
from nbgen.bench.profiling import GcPauses, RunProfiles, StepTimer
from nbgen.bench.report import add_json_option, write_json
from nbgen.bench.workloads import (PREFIX_LEN, PREFIXES, QUESTIONS, chat32_prompts, make_workload,
                                   prefix_workload, text_prompts)
from nbgen.engine import Engine

__all__ = ["QUESTIONS", "main", "make_workload", "run_nbgen"]

def run_nbgen(args: argparse.Namespace, prompts: Any, outs: list[int]) -> dict[str, Any]:
    kw: dict[str, Any] = {"device": args.device, "load_format": args.load_format}
    for k in ("disable_cuda_graph", "disable_piecewise_cuda_graph", "disable_overlap_schedule"):
        if getattr(args, k):
            kw[k] = True
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.page_size:
        kw["page_size"] = args.page_size
    if args.chunked_prefill_size:
        kw["chunked_prefill_size"] = args.chunked_prefill_size
    if args.schedule_policy:
        kw["schedule_policy"] = args.schedule_policy
    if args.cpu_offload_gb:
        kw["cpu_offload_gb"] = args.cpu_offload_gb
    if args.tokenizer_path:
        kw["tokenizer_path"] = args.tokenizer_path
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.kv_cache_dtype:
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tp_size > 1:
        kw["tp_size"] = args.tp_size
    if args.dp_size > 1:
        kw["dp_size"] = args.dp_size
    if args.disable_custom_all_reduce:
        kw["disable_custom_all_reduce"] = True
    t0 = time.perf_counter()
    eng = Engine(args.model, **kw) if args.model else Engine(**kw)
    startup = time.perf_counter() - t0
    info = eng.get_server_info()
    sps = [{"max_new_tokens": o, "temperature": args.temperature, "ignore_eos": True} for o in outs]
    warm = prompts[:4] if isinstance(prompts[0], str) else [p[:64] for p in prompts[:4]]
    eng.generate(**_inputs(warm), sampling_params={"max_new_tokens": 8, "ignore_eos": True}, use_tqdm=False)
    if args.device != "cpu":
        torch.cuda.synchronize()
    profiles = RunProfiles(eng, args.profile, args.host_profile, args.layer_anchor, args.trace)
    # --phases: (step times, host time by phase) on the loop thread
    probes: Optional[tuple[StepTimer, PhaseTimer]] = (StepTimer(eng), PhaseTimer(eng)) if args.phases else None
    gcs = GcPauses()
    runs: list[float] = []
    for i in range(args.repeat):
        if i:
            eng.flush_cache()        # each repeat prefills its prompts again (no prefix-cache hits)
        if probes is not None:
            for p in probes:
                p.reset()
        t0 = time.perf_counter()
        res = (_stream_all(eng, prompts, sps) if args.stream
               else eng.generate(**_inputs(prompts), sampling_params=sps, use_tqdm=False))
        runs.append(time.perf_counter() - t0)
        if probes is not None:
            timer, phases = probes
            st = timer.summary()
            print(f"run {i + 1}: {runs[-1]:.2f} s, {st['steps']} steps: {st['step_ms']:.2f} ms/step, "
                  f"device wait {st['wait_ms']:.2f}, host {st['host_ms']:.2f}", flush=True)
            print(f"run {i + 1}: {phases.line(st['steps'])}", flush=True)
    gcs.close()
    if probes is not None:
        probes[1].close()                           # before the step timer: its wrappers are on top
        probes[0].close()
    secs = statistics.median(runs)
    print(gcs.summary(sum(runs)))
    if len(runs) > 1:
        print("nbgen runs: " + ", ".join(f"{r:.2f}" for r in runs) + f" s (median {secs:.2f} s is reported)")
    profiles.report(sum(runs))
    n_in = sum(r["meta_info"]["prompt_tokens"] for r in res)
    n_out = sum(r["meta_info"]["completion_tokens"] for r in res)
    runner = eng.loop.runner
    # bytes actually read: fp8 weights 1 byte a parameter, an fp8 KV pool 1 byte a value
    wb, kvb = model_bytes(runner.model, runner.hf_config, runner.kv_spec.bytes_per_page() // runner.kv_spec.page_size)
    pf = prefill_flops(runner.model, runner.hf_config, [r["meta_info"]["prompt_tokens"] for r in res])
    # W-prefix with a perfect prefix cache: each prefix prefilled once, every suffix after its prefix
    pf_shared = pf - (len(res) - PREFIXES) * prefill_flops(runner.model, runner.hf_config, [PREFIX_LEN], lm_head=False)
    info = {k: info[k] for k in ("num_pages", "page_size", "attention_backend", "cuda_graph_batch_sizes",
                                "piecewise_cuda_graph_tokens", "startup_s")}
    for k in ("kv_layout", "use_tensor_cores"):        # flashinfer backend's kernel choices
        if hasattr(runner.backend, k):
            info[k] = getattr(runner.backend, k)
    # decode steps replayed on the shared-prefix (cascade) graphs, over all runs
    info["cascade_steps"] = runner.graphs.cascade_steps if runner.graphs is not None else 0
    if info["cascade_steps"]:
        print(f"shared-prefix decode steps: {info['cascade_steps']}")
    out = {"engine": "nbgen", "seconds": secs, "runs_s": runs, "in_tokens": n_in, "out_tokens": n_out, "startup_s": startup,
           "weight_bytes": wb, "kv_bytes_per_token": kvb, "prefill_flops": pf, "prefill_flops_shared": pf_shared,
           "row_flops": prefill_flops(runner.model, runner.hf_config, [1]),
           "cached_tokens": sum(r["meta_info"].get("cached_tokens", 0) for r in res), "prompt_lens": [r["meta_info"]["prompt_tokens"] for r in res],
           "server_info": info, "gc_pauses_s": [round(t, 4) for _, t in gcs.pauses if t >= 1e-3],
           "first_ids": res[0]["output_ids"][:16], "text_chars": sum(len(r.get("text") or "") for r in res)}
    del runner           # the engine's shutdown frees the model and its graphs: hold none of it
    eng.shutdown()
    del eng, res
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _inputs(prompts: Any) -> dict[str, Any]:
    return {"prompt": prompts} if isinstance(prompts[0], str) else {"input_ids": prompts}


def _stream_all(eng: Engine, prompts: Any, sps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every prompt as its own ``stream=True`` request, all at once (asyncio, the way a notebook
    streams many cells or a UI many chats); each result holds its chunks' text joined and the
    last chunk's output."""
    async def one(i: int) -> dict[str, Any]:
        parts: list[str] = []
        last: dict[str, Any] = {}
        async for chunk in await eng.async_generate(**_inputs(prompts[i:i + 1]), sampling_params=sps[i], stream=True):
            parts.append(chunk.get("text") or "")
            last = chunk
        return {**last, "text": "".join(parts)}

    async def every() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    return asyncio.run(every())


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m nbgen.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF dir (config.json); default: the embedded model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--workload", default=None, choices=["nano", "fixed", "bs1", "prefix", "chat32"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--page-size", type=int, default=None, help="KV page size (default: the engine's)")
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="token budget per step (default: the engine's)")
    ap.add_argument("--schedule-policy", default=None, choices=["fcfs", "lpm", "lof"],
                    help="admission order (default: the engine's: fcfs, or lof with prefill pacing for a "
                         "large model); lof with a small --chunked-prefill-size spreads prefill over decode steps")
    ap.add_argument("--peer", default=None, choices=["hf"])
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); nano-vllm samples at 0.6")
    ap.add_argument("--text", action="store_true", help="text prompts (the workload's ids decoded) and text outputs")
    ap.add_argument("--stream", action="store_true",
                    help="each prompt as its own stream=True request, all at once (with --text: W-text streamed)")
    ap.add_argument("--tokenizer-path", default=None, help="tokenizer for --text when the model dir has none")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="fp8 weights (default: the checkpoint's)")
    ap.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8_e4m3"])
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--disable-piecewise-cuda-graph", action="store_true",
                    help="steps with prefill chunks run eagerly (A/B of the piecewise prefill graphs)")
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--cpu-offload-gb", type=float, default=0.0,
                    help="GiB of weights kept in host memory (the floor still counts them as read from the GPU)")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="tensor parallel GPUs (the floor reads each shard at the measured one-GPU bandwidth)")
    ap.add_argument("--dp-size", type=int, default=1, help="data parallel replicas, one per GPU")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="tensor parallelism: NCCL for every all-reduce (A/B of the peer-to-peer one)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler over the timed run (CUDA)")
    ap.add_argument("--layer-anchor", default=None, metavar="KERNEL",
                    help="with --profile: a layer's kernels as the GPU ran them, cut at each launch of this kernel "
                         "(a once-a-layer kernel's name or part of it, e.g. _qk_rope_kernel; bench/layer_trace.py)")
    ap.add_argument("--trace", default=None, metavar="FILE", help="with --layer-anchor: where the Chrome trace goes")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the engine loop thread")
    ap.add_argument("--phases", action="store_true",
                    help="each timed run also prints its loop steps' time: device wait and host ms a step, and the "
                         "host time by phase (bench/phases.py)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time nbgen's workload this many times on one engine (cache flushed between); report the median")
    add_json_option(ap, "the rows")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {args.repeat}")
    if args.layer_anchor and not args.profile:
        raise ValueError("layer_anchor needs --profile")
    workload = args.workload or ("chat32" if args.device == "cpu" else "nano")
    dev = torch.device(args.device)
    if workload == "chat32":
        # nbgen runs its CPU default dtype (bf16 where the CPU has native bf16); the HF peer runs
        # fp32 (padded batch, same weights); --dtype overrides nbgen's
        prompts: Any = chat32_prompts(args.model)
        outs = [64] * len(prompts)
    elif workload == "prefix":
        prompts, outs, groups = prefix_workload()
    else:
        prompts, outs = make_workload(workload)
        if args.text:
            prompts = text_prompts(prompts, args.tokenizer_path or args.model)
    bw0 = None
    if dev.type == "cuda":
        # also measured before the engines: after a long run the same copy can measure slower;
        # the floor takes the faster of the two (the stricter floor)
        bw0 = copy_bandwidth(dev)
        torch.cuda.empty_cache()
    mm = matmul_rate(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rows = [run_nbgen(args, prompts, outs)]
    if args.peer == "hf":
        try:
            rows.append(run_hf(args, prompts, outs))
        except Exception as e:  # noqa: BLE001 - report the peer's failure, keep nbgen's numbers
            rows.append({"engine": "hf", "error": f"{type(e).__name__}: {e}"})
    # measured last: on a CPU its large buffers change malloc's behaviour for the rest of the process
    bw_after = copy_bandwidth(dev)
    bw = max(bw_after, bw0 or 0.0)
    if bw0 is not None:
        print(f"\ncopy bandwidth before the engines {bw0 / 1e9:.0f} GB/s, after {bw_after / 1e9:.0f} GB/s")
    ins = rows[0]["prompt_lens"]
    # weight and KV bytes and prefill FLOPs are rank 0's shard (tp ranks read theirs in parallel, each
    # at its own bandwidth); dp replicas each read all the weights in their own steps, while the
    # sequences' KV and the prefill compute spread over them
    wb, kvb = rows[0]["weight_bytes"], rows[0]["kv_bytes_per_token"]
    floor = floor_seconds(ins, outs, wb, 0, bw) + floor_seconds(ins, outs, 0, kvb, bw * args.dp_size)
    floor_pf = floor + rows[0]["prefill_flops"] / (mm * args.dp_size)
    # on a CPU the measured rate is fp32's while bf16 models run oneDNN's bf16 kernels: no roofline there
    roof = roofline_seconds(ins, outs, wb, kvb, bw, rows[0]["row_flops"], mm, args.dp_size) + \
        rows[0]["prefill_flops"] / (mm * args.dp_size) if dev.type == "cuda" else float("nan")
    mode = ((f"temperature {args.temperature}" if args.temperature else "greedy")
            + (", text in/out" if args.text else "") + (", streamed" if args.stream else ""))
    print(f"\nworkload {workload} ({mode})  model {args.model or 'embedded'}  device {args.device}  "
          f"copy bandwidth {bw / 1e9:.0f} GB/s  tp {args.tp_size} dp {args.dp_size}  floor {floor:.2f} s  "
          f"startup {rows[0]['startup_s']:.1f} s")
    print(f"floor bytes: weights {rows[0]['weight_bytes'] / 1e9:.3f} GB per decode step, KV "
          f"{rows[0]['kv_bytes_per_token'] / 1e3:.1f} KB per token (quantization {args.quantization or 'checkpoint'}, "
          f"kv_cache_dtype {args.kv_cache_dtype or 'auto'})")
    print(f"prefill {rows[0]['prefill_flops'] / 1e12:.3g} TFLOP at the measured matmul rate {mm / 1e12:.3g} TFLOP/s: "
          f"floor+pf {floor_pf:.2f} s (decode floor plus prefill compute; the targets use the floor)")
    if dev.type == "cuda":
        print(f"roofline {roof:.2f} s (floor+pf with each decode step the longer of its weight read and its "
              f"{rows[0]['row_flops'] / 1e9:.3g} GFLOP per row at the matmul rate)")
    shared = None
    if workload == "prefix" and args.dp_size == 1:
        shared = shared_floor_seconds(PREFIX_LEN, groups, ins, outs, rows[0]["weight_bytes"],
                                      rows[0]["kv_bytes_per_token"], bw)      # rank 0's shard, one GPU's rate
        shared += rows[0]["prefill_flops_shared"] / mm
        print(f"shared floor {shared:.2f} s (each distinct KV token read once per decode step, each prefix "
              f"prefilled once); cached_tokens {rows[0]['cached_tokens']} of "
              f"{(len(prompts) - PREFIXES) * PREFIX_LEN} shareable")
    print(f"server: {rows[0]['server_info']}")
    print(f"{'engine':<20}{'seconds':>9}{'out tok/s':>11}{'total tok/s':>13}{'copy GB/s':>11}{'floor s':>9}"
          f"{'% floor':>9}{'% floor+pf':>12}{'% roofline':>12}")
    for r in rows:
        r.update(workload=workload, copy_bw=bw, copy_bw_before=bw0, copy_bw_after=bw_after, floor_s=floor,
                 matmul_flops=mm, floor_pf_s=floor_pf, roofline_s=roof)
        if "error" in r:
            print(f"{r['engine']:<20} error: {r['error']}")
            continue
        r["out_tok_s"] = r["out_tokens"] / r["seconds"]
        r["total_tok_s"] = (r["out_tokens"] + r["in_tokens"]) / r["seconds"]
        r["pct_floor"] = 100 * floor / r["seconds"]
        r["pct_floor_pf"] = 100 * floor_pf / r["seconds"]
        r["pct_roofline"] = 100 * roof / r["seconds"]
        if shared is not None:
            r.update(shared_floor_s=shared, pct_shared_floor=100 * shared / r["seconds"])
        print(f"{r['engine']:<20}{r['seconds']:>9.2f}{r['out_tok_s']:>11.0f}{r['total_tok_s']:>13.0f}"
              f"{bw / 1e9:>11.0f}{floor:>9.2f}{r['pct_floor']:>8.1f}%{r['pct_floor_pf']:>11.1f}%"
              + (f"{r['pct_roofline']:>11.1f}%" if dev.type == "cuda" else f"{'-':>12}")
              + (f"  {r['pct_shared_floor']:.1f}% of the shared floor" if shared is not None else ""))
    if len(rows) > 1 and "error" not in rows[1]:
        print(f"nbgen / {rows[1]['engine']}: {rows[0]['out_tok_s'] / rows[1]['out_tok_s']:.1f}x output tok/s")
    write_json(args.json, [{k: v for k, v in r.items() if k != "prompt_lens"} for r in rows])
    return rows


if __name__ == "__main__":
    main()
