"""Host cost of streaming without a GPU: ``python -m nbgen.bench.stream_host``.

The real engine (facade, loop thread, scheduler, tracking, detokenizer, hand-off to the caller's event
loop) runs W-nano's shape — 256 requests, prompts and outputs of ``randint(100, 1024)`` tokens, as text
through a real tokenizer — with the model's step replaced by a fake GPU: each step takes ``--step-ms``
of device time plus ``--prefill-us`` per prompt token (a sleep, which releases the interpreter lock
as a CUDA wait does) and ``--launch-ms``
of host Python (holding the lock, as the runner's launch work does). The step is pipelined like overlap
scheduling on the GPU: the loop thread waits only for the previous step's device time, so its host
work (scheduling, delivery, detokenization, chunks) is hidden as long as it fits in a step.

Modes, each on the same engine: ``ids`` (input and output ids, ``generate``), ``text`` (text prompts and
outputs, ``generate``), ``stream`` (text, each prompt its own ``stream=True`` request through
``async_generate``, all at once), ``sync-stream`` (the same through ``generate(stream=True)`` iterators
on 8 threads). Reported per mode: wall seconds and % of the ids-only run, the loop thread's host time per
step (what is not the fake device wait) and its CPU time, chunks the consumers received, chunks/s and
the consumers' CPU time per chunk. Every mode's texts are checked against the first mode's.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import random
import tempfile
import threading
import time
import zlib
from typing import Any, Optional

from nbgen.bench.report import add_json_option, write_json
from nbgen.core.batch import ScheduledBatch, StepOutput
from nbgen.engine import Engine
from nbgen.models.embedded import default_model_path

# a Llama-shaped config small enough that the dummy weights and KV pool cost nothing on a CPU
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
               "num_key_value_heads": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
               "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
               "torch_dtype": "float32"}


CONSUMER_CPU: list[float] = []   # CPU seconds of the consuming threads in the last streamed run


class FakeDevice:
    """Stands in for ``ModelRunner.step``: ``launch_s`` of host Python, then the tokens, while the
    previous step's ``step_s`` of device time is waited for (one step ahead, as overlap scheduling)."""

    def __init__(self, step_s: float, launch_s: float, vocab: int, prefill_s: float = 0.0) -> None:
        self.step_s = step_s
        self.prefill_s = prefill_s    # device seconds per prompt token of a step
        self.launch_s = launch_s
        rng = random.Random(0)
        self.table = [rng.randrange(100, min(vocab, 10000)) for _ in range(1 << 16)]   # W-nano's id range
        self.busy_until = 0.0
        self.steps = 0
        self.waited = 0.0      # seconds the loop thread slept on the fake device
        self.device_s = 0.0    # fake device seconds of all steps

    def token(self, rid: str, pos: int) -> int:
        """The id a request samples at output position ``pos`` (the same in every mode)."""
        return self.table[(zlib.crc32(rid.encode()) + pos) & 0xFFFF]

    def step(self, batch: ScheduledBatch) -> StepOutput:
        t = time.perf_counter() + self.launch_s
        while time.perf_counter() < t:     # the launch's host work holds the interpreter lock
            pass
        now = time.perf_counter()
        if self.busy_until > now:           # the previous step is still on the device
            time.sleep(self.busy_until - now)
            self.waited += time.perf_counter() - now
        dev = self.step_s + self.prefill_s * batch.num_prefill_tokens
        self.busy_until = max(now, self.busy_until) + dev
        self.device_s += dev
        self.steps += 1
        n = len(batch.seqs)
        ids = [self.token(s.req.rid, s.out_index) if s.sample else -1 for s in batch.seqs]
        return StepOutput(next_token_ids=ids, output_logprobs=[None] * n, prompt_logprobs=[None] * n)


def workload(n: int, scale: float, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """W-nano: ``n`` prompts of random ids < 10000, prompt and output lengths ``randint(100, 1024)``
    (times ``scale``)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 9999) for _ in range(max(1, int(rng.randint(100, 1024) * scale)))]
               for _ in range(n)]
    outs = [max(1, int(rng.randint(100, 1024) * scale)) for _ in range(n)]
    return prompts, outs


def _stream_async(eng: Engine, prompts: list[str], sps: list[dict[str, Any]], rids: list[str]) -> tuple[list[str], int]:
    async def one(i: int) -> tuple[str, int]:
        parts: list[str] = []
        async for chunk in await eng.async_generate(prompts[i], sps[i], stream=True, rid=rids[i]):
            parts.append(chunk["text"])
        return "".join(parts), len(parts)

    async def every() -> list[tuple[str, int]]:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    cpu = time.thread_time()
    res = asyncio.run(every())
    CONSUMER_CPU.append(time.thread_time() - cpu)
    return [t for t, _ in res], sum(c for _, c in res)


def _stream_threads(eng: Engine, prompts: list[str], sps: list[dict[str, Any]], rids: list[str],
                    threads: int = 8) -> tuple[list[str], int]:
    """Sync ``generate(stream=True)`` iterators, consumed round-robin by ``threads`` threads."""
    texts: list[str] = [""] * len(prompts)
    counts = [0] * len(prompts)

    def worker(k: int) -> None:
        cpu = time.thread_time()
        its = {i: eng.generate(prompts[i], sps[i], stream=True, rid=rids[i])
               for i in range(k, len(prompts), threads)}
        parts: dict[int, list[str]] = {i: [] for i in its}
        while its:                       # round-robin: a chunk of each live stream in turn
            for i, it in list(its.items()):
                chunk = next(it, None)
                if chunk is None:
                    del its[i]
                    texts[i] = "".join(parts[i])
                    continue
                parts[i].append(chunk["text"])
                counts[i] += 1
        CONSUMER_CPU.append(time.thread_time() - cpu)
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return texts, sum(counts)


def _medians(rows: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    """One row per mode: the run of median seconds (all runs' seconds kept in ``runs_s``)."""
    out = []
    for m in modes:
        runs = sorted((r for r in rows if r["mode"] == m), key=lambda r: r["seconds"])
        mid = dict(runs[len(runs) // 2])
        mid["runs_s"] = [round(r["seconds"], 3) for r in rows if r["mode"] == m]
        mid["texts_equal"] = all(r["texts_equal"] for r in runs)
        out.append(mid)
        print(f"{m}: runs " + ", ".join(f"{t:.2f}" for t in mid["runs_s"]) + " s")
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    tok_dir = args.tokenizer_path or default_model_path()
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(TINY_CONFIG, f)
        eng = Engine(d, load_format="dummy", tokenizer_path=tok_dir, device="cpu", dtype="float32",
                     max_running_requests=args.requests, max_total_tokens=args.requests * 2100,
                     disable_radix_cache=True, log_level="warning")
    try:
        fake = FakeDevice(args.step_ms / 1e3, args.launch_ms / 1e3, len(eng.tokenizer), args.prefill_us / 1e6)
        runner = eng.loop.runner          # the bench swaps the model's step for the fake device
        eng.loop.call(lambda: setattr(runner, "step", fake.step))
        ids, outs = workload(args.requests, args.scale)
        v = len(eng.tokenizer)
        texts = [eng.tokenizer.decode([t % v for t in p], skip_special_tokens=True) for p in ids]
        sps = [{"max_new_tokens": o, "temperature": 0, "ignore_eos": True} for o in outs]
        rows: list[dict[str, Any]] = []
        ref: Optional[list[str]] = None
        for mode in [m for _ in range(args.repeat) for m in args.modes]:   # interleaved repeats
            rids = [f"r{i}" for i in range(len(ids))]   # the same in every mode: so are the fake's tokens
            steps0, wait0, dev0 = fake.steps, fake.waited, fake.device_s
            CONSUMER_CPU.clear()
            loop_cpu0 = eng.loop.call(time.thread_time)
            prof = cProfile.Profile() if args.host_profile else None
            if prof is not None:
                eng.loop.call(prof.enable)
            t0 = time.perf_counter()
            chunks = len(ids)
            if mode == "ids":     # the fake's tokens depend on rid and position only: the same texts
                got = [o["text"] for o in eng.generate(input_ids=ids, sampling_params=sps, rid=rids, use_tqdm=False)]
            elif mode == "text":
                got = [o["text"] for o in eng.generate(texts, sps, rid=rids, use_tqdm=False)]
            elif mode == "stream":
                got, chunks = _stream_async(eng, texts, sps, rids)
            elif mode == "sync-stream":
                got, chunks = _stream_threads(eng, texts, sps, rids)
            else:
                raise ValueError(f"mode must be ids, text, stream or sync-stream, got {mode!r}")
            wall = time.perf_counter() - t0
            if prof is not None:
                eng.loop.call(prof.disable)
                print(f"loop thread profile, mode {mode}:")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            loop_cpu = eng.loop.call(time.thread_time) - loop_cpu0
            steps, waited = fake.steps - steps0, fake.waited - wait0
            row = {"mode": mode, "seconds": wall, "steps": steps,
                   "host_ms_per_step": 1e3 * (wall - waited) / max(steps, 1),
                   "loop_cpu_ms_per_step": 1e3 * loop_cpu / max(steps, 1),
                   "consumer_cpu_s": sum(CONSUMER_CPU),
                   "device_s": fake.device_s - dev0, "chunks": chunks, "chunks_per_s": chunks / wall,
                   "out_tokens": sum(outs)}
            ref = got if ref is None else ref
            row["texts_equal"] = got == ref      # against the first mode's texts
            rows.append(row)
    finally:
        eng.shutdown()
    rows = _medians(rows, args.modes) if args.repeat > 1 else rows
    base = next((r["seconds"] for r in rows if r["mode"] == "ids"), None)
    print(f"{args.requests} requests, {sum(outs)} output tokens, fake step {args.step_ms} ms device "
          f"(+ {args.prefill_us} us per prompt token) + {args.launch_ms} ms host launch, tokenizer {tok_dir}")
    print(f"{'mode':<13}{'seconds':>9}{'% ids':>8}{'steps':>7}{'host ms/step':>14}{'loop CPU ms/step':>18}"
          f"{'chunks':>9}{'chunks/s':>10}{'consumer CPU us/chunk':>23}  texts")
    for r in rows:
        pct = f"{100 * base / r['seconds']:.1f}" if base else "-"
        r["pct_of_ids"] = 100 * base / r["seconds"] if base else None
        per = f"{1e6 * r['consumer_cpu_s'] / r['chunks']:.1f}" if r["consumer_cpu_s"] else "-"
        print(f"{r['mode']:<13}{r['seconds']:>9.2f}{pct:>8}{r['steps']:>7}{r['host_ms_per_step']:>14.2f}"
              f"{r['loop_cpu_ms_per_step']:>18.2f}{r['chunks']:>9}{r['chunks_per_s']:>10.0f}{per:>23}"
              f"  {r.get('texts_equal', '')}")
    return rows


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m nbgen.bench.stream_host", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--scale", type=float, default=1.0, help="prompt and output lengths times this")
    ap.add_argument("--step-ms", type=float, default=6.0, help="fake device time per step")
    ap.add_argument("--launch-ms", type=float, default=1.0, help="fake host launch work per step (holds the GIL)")
    ap.add_argument("--prefill-us", type=float, default=2.0,
                    help="fake device time per prompt token (Qwen3-0.6B on an H100: ~2 us)")
    ap.add_argument("--modes", nargs="+", default=["ids", "text", "stream"],
                    choices=["ids", "text", "stream", "sync-stream"])
    ap.add_argument("--tokenizer-path", default=None, help="default: the embedded model's tokenizer")
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode (interleaved); the median is reported")
    ap.add_argument("--host-profile", action="store_true", help="cProfile of the loop thread per mode")
    add_json_option(ap, "the rows")
    args = ap.parse_args(argv)
    rows = run(args)
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
