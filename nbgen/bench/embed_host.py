"""Host cost of an embedding run without a model: ``python -m nbgen.bench.embed_host``.

Drives nbgen's own torch-free Scheduler (page pool, prefix cache) over the embedding bench's workload
(``bench.embed.make_texts``: random-id texts of ``randint(64, 512)`` tokens) with a fake runner that
returns a vector for every finished prompt, and times the host's share of each step: ``schedule()``
(admission, page allocation, prefix-cache match, eviction when the pool is full) and ``update()``
(prefix-cache inserts, finishing, freeing pages). The KV pool size defaults to what Qwen3-0.6B gets on
an 80 GB card (``--num-pages``), so the cache fills and evicts as on the GPU host. A second number
times ``PrefixCache.insert`` alone: ``--insert-prompts`` prompts of ``--insert-tokens`` tokens (one
step's finished prompts) into a cache already holding other prompts (median over 50 such steps).

The runner's share of a step (inputs, attention plan, graph launches) and delivery are not included:
they need the model; ``bench.embed`` reports the whole step on the GPU.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from nbgen.bench.embed import make_texts
from nbgen.core.batch import StepOutput
from nbgen.core.request import EmbedRequest, Request
from nbgen.core.sampling import SamplingParams
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.runtime.pages import PagePool
from nbgen.runtime.prefix_cache import PrefixCache
from nbgen.runtime.scheduler import Scheduler


def run_scheduler(texts: list[list[int]], chunk: int, num_pages: int, page_size: int,
                  max_running: int) -> dict[str, Any]:
    """Schedule every text to its end with a fake runner; host seconds of schedule() and update()."""
    sched = Scheduler(SchedulerConfig(page_size=page_size, num_pages=num_pages, max_running_requests=max_running,
                                      chunked_prefill_size=chunk))
    params, spec = SamplingParams(max_new_tokens=0), EmbedRequest()
    for i, ids in enumerate(texts):
        sched.add(Request(rid=str(i), prompt_ids=ids, params=params, embed=spec))
    t_sched = t_update = 0.0
    steps = finished = 0
    vec = [0.0]
    while sched.has_work():
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        if batch is None:
            raise RuntimeError("the scheduler stalled")
        n = len(batch.seqs)
        out = StepOutput(next_token_ids=[-1] * n, output_logprobs=[None] * n, prompt_logprobs=[None] * n,
                         pool_states=[None] * n,
                         embeddings=[vec if s.kv_len >= len(s.req.prompt_ids) else None for s in batch.seqs])
        t2 = time.perf_counter()
        finished += len(sched.update(batch, out))
        t3 = time.perf_counter()
        t_sched += t1 - t0
        t_update += t3 - t2
        steps += 1
    if finished != len(texts):
        raise RuntimeError(f"{finished} of {len(texts)} requests finished")
    return {"steps": steps, "schedule_ms_per_step": 1e3 * t_sched / steps,
            "update_ms_per_step": 1e3 * t_update / steps, "host_s": t_sched + t_update,
            "texts_per_step": len(texts) / steps}


def time_inserts(n_prompts: int, n_tokens: int, page_size: int, rounds: int) -> float:
    """Microseconds per ``PrefixCache.insert`` of one ``n_tokens``-token prompt (new to the cache):
    the median over ``rounds`` steps' worth of inserts (the cache grows from round to round)."""
    rng = random.Random(0)
    per_round = n_prompts * (n_tokens // page_size)
    pool = PagePool(per_round * (rounds + 1) + 1, page_size)
    cache = PrefixCache(pool)
    times = []
    for _ in range(rounds):
        prompts = [[rng.randrange(10000) for _ in range(n_tokens)] for _ in range(n_prompts)]
        pages = [pool.alloc(n_tokens // page_size) for _ in prompts]
        t0 = time.perf_counter()
        for ids, pg in zip(prompts, pages):
            cache.insert(ids, pg)
        times.append(time.perf_counter() - t0)
        for pg in pages:
            pool.unref(pg)                  # the requests finish; the cache keeps its ref
    return 1e6 * statistics.median(times) / n_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-texts", type=int, default=10000)
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--num-pages", type=int, default=32768, help="KV pool pages (Qwen3-0.6B on 80 GB: ~32k)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--insert-prompts", type=int, default=28)
    ap.add_argument("--insert-tokens", type=int, default=288)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    texts = make_texts(args.num_texts, args.min_tokens, args.max_tokens)
    res = run_scheduler(texts, args.chunked_prefill_size, args.num_pages, args.page_size, args.max_running_requests)
    res["insert_us"] = time_inserts(args.insert_prompts, args.insert_tokens, args.page_size, rounds=50)
    if args.json:
        print(json.dumps(res))
        return
    print(f"{args.num_texts} texts, chunk {args.chunked_prefill_size}: {res['steps']} steps "
          f"({res['texts_per_step']:.1f} texts each); host per step: schedule {res['schedule_ms_per_step']:.3f} ms, "
          f"update {res['update_ms_per_step']:.3f} ms")
    print(f"PrefixCache.insert of a {args.insert_tokens}-token prompt: {res['insert_us']:.1f} us "
          f"({args.insert_prompts} per step: {res['insert_us'] * args.insert_prompts / 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
