"""Soak run: ``python -m nbgen.bench.soak [--model DIR] [--device cpu|cuda] [--minutes M] [--batch B]
[--report-every S]``.

Loops for M minutes over rounds of mixed requests on one Engine (the embedded default model unless
``--model``): greedy and sampled batches, streams read to the end, streams and ``generate_iter`` calls
closed early (aborts), invalid params that must raise ValueError, sometimes ``n > 1`` or a regex.
Every S seconds one line: elapsed time, requests done, errors, RSS (anonymous memory), live threads
and the engine's running / waiting / KV pages. The summary gives RSS growth from the first report to
the last: steady growth over a long run is a leak. Not a CI test.
"""
from __future__ import annotations

import argparse
import math
import random
import threading
import time
from typing import Any, Callable, Optional

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three colors:", "Explain gravity to a child.", "1, 2, 3, 4,", "Hello! How are you today?"]
# each must raise ValueError (a TypeError or an accepted call counts as an error)
INVALID = [{"top_p": 2.0}, {"temperature": float("nan")}, {"n": 0}, {"max_new_tokens": -1},
           {"logit_bias": {"x": 1.0}}, {"regex": "("}, {"temprature": 0.5}, {"top_k": 0}, {"json_schema": "{"}]


def rss_mb() -> float:
    """Resident anonymous memory of this process in MB (RssAnon; VmRSS where the kernel lacks it)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return math.nan
    for key in ("RssAnon", "VmRSS"):
        if key in fields:
            return int(fields[key].split()[0]) / 1024   # the kernel reports kB
    return math.nan


def _round(eng: Any, rng: random.Random, batch: int) -> int:
    """One mixed request; returns how many requests it finished or rejected. Raises on a defect."""
    prompts = [rng.choice(PROMPTS) for _ in range(batch)]
    mnt = rng.randint(1, 32)
    kind = rng.choice(["greedy", "sampled", "stream", "stream_abort", "iter_abort", "invalid", "n", "regex"])
    if kind == "invalid":
        try:
            eng.generate(prompts[0], dict(rng.choice(INVALID)))
        except ValueError:
            return 1
        raise AssertionError("invalid params were accepted")
    if kind in ("stream", "stream_abort"):
        it = eng.generate(prompts[0], {"max_new_tokens": mnt, "temperature": 0.7}, stream=True)
        chunks = [next(it)] if kind == "stream_abort" else list(it)
        it.close()   # an unfinished stream is aborted
        if kind == "stream" and chunks[-1]["meta_info"]["finish_reason"] is None:
            raise AssertionError("a stream ended without a finish_reason")
        return 1
    if kind == "iter_abort":
        it = eng.generate_iter(prompts, {"max_new_tokens": 64, "ignore_eos": True})
        next(it)
        it.close()   # the rest of the batch is aborted
        return batch
    sp: dict[str, Any] = {"max_new_tokens": mnt}
    if kind == "greedy":
        sp.update(temperature=0, ignore_eos=rng.random() < 0.5)
    elif kind == "n":
        sp.update(temperature=1.0, n=rng.randint(2, 3))
    elif kind == "regex":
        sp.update(temperature=0.8, regex="[a-z ]+")
    else:
        sp.update(temperature=rng.choice([0.5, 1.0]), top_p=0.9, sampling_seed=rng.randrange(2**31))
    outs = eng.generate(prompts, sp, use_tqdm=False)
    if any(o["meta_info"]["finish_reason"]["type"] not in ("stop", "length") for o in outs):
        raise AssertionError(f"unexpected finish: {[o['meta_info']['finish_reason'] for o in outs]}")
    return len(outs)


def _line(t0: float, done: int, errors: int, eng: Any) -> tuple[float, int, str]:
    """(rss MB, threads, one report line)."""
    s = eng.stats()
    rss, threads = rss_mb(), threading.active_count()
    return rss, threads, (f"t={time.time() - t0:7.1f}s  requests={done:7d}  errors={errors:4d}  rss={rss:8.1f}MB  "
                          f"threads={threads:3d}  running={s['running']}  waiting={s['waiting']}  "
                          f"kv_pages={s['kv_pages_used']}/{s['kv_pages_total']}")


def soak(eng: Any, minutes: float, batch: int, report_every: float,
         out: Callable[[str], None] = print, seed: int = 0) -> dict[str, Any]:
    """Run the loop; returns the summary numbers."""
    rng = random.Random(seed)
    t0 = time.time()
    done = errors = 0
    last_error: Optional[str] = None
    reports: list[tuple[float, int]] = []
    next_report = t0 + report_every   # the first line after one interval: past start-up allocations
    try:
        while True:
            now = time.time()
            if now >= next_report or now - t0 >= minutes * 60:
                rss, threads, line = _line(t0, done, errors, eng)
                reports.append((rss, threads))
                out(line)
                next_report = now + report_every
                if now - t0 >= minutes * 60:
                    break
            try:
                done += _round(eng, rng, batch)
            except Exception as e:  # noqa: BLE001 - counted and reported; the soak goes on
                errors += 1
                last_error = f"{type(e).__name__}: {e}"
    except KeyboardInterrupt:
        out("interrupted")
    elapsed = time.time() - t0
    (rss0, th0), (rss1, th1) = reports[0], reports[-1]
    summary = {"seconds": elapsed, "requests": done, "errors": errors, "last_error": last_error,
               "rss_first_mb": rss0, "rss_last_mb": rss1, "rss_growth_pct": 100.0 * (rss1 - rss0) / rss0,
               "threads_first": th0, "threads_last": th1}
    out(f"summary: {elapsed:.0f}s, {done} requests ({done / max(elapsed, 1e-9):.1f}/s), {errors} errors; "
        f"rss {rss0:.1f} -> {rss1:.1f} MB ({summary['rss_growth_pct']:+.1f}%); threads {th0} -> {th1}"
        + (f"; last error: {last_error}" if last_error else ""))
    return summary


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded default model)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=8, help="prompts per generate() call")
    ap.add_argument("--report-every", type=float, default=30.0, help="seconds between report lines")
    args = ap.parse_args(argv)
    import nbgen

    eng = nbgen.Engine(args.model, device=args.device)
    try:
        soak(eng, args.minutes, args.batch, args.report_every)
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
