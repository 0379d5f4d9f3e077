"""The loop thread's own host time per step on the CPU: ``python -m nbgen.bench.loop_replay``.

The engine's real Scheduler, Delivery (outputs, stats snapshot) and OverlapStepper drive a fake runner
whose forward, sampling and wait cost nothing: ids come from a seeded RNG, as a free (unconstrained,
``ignore_eos``) run of ``bench/grammar.py`` gets them from the GPU. Per step the loop thread's CPU time
(``time.thread_time``: other processes on a shared machine do not count) is split into schedule,
apply (``Scheduler.update``), deliver, the fake runner's calls (left out) and the rest of the stepper
(its resolve walk, placeholders, bookkeeping). Reported: medians over the steps that decode the full
batch, and the mean over every step of the run (finishes and admissions included).
Workloads: ``free`` (``--num`` requests, prompts of 30-60 tokens, ``--max-new-tokens`` each) and
``nano`` (W-nano's lengths: input and output ``randint(100, 1024)``).
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any, Callable, Optional

from nbgen.core.batch import ScheduledBatch
from nbgen.core.request import LogprobRequest, Request
from nbgen.core.sampling import SamplingParams
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.runtime.delivery import Delivery, RidRegistry
from nbgen.runtime.loop_stats import LoopStats
from nbgen.runtime.overlap import OverlapStepper
from nbgen.runtime.step_handles import Forwarded, Launched
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.tracker import Update

PHASES = ("schedule", "apply", "deliver", "runner", "step")


class FakeRunner:
    """The runner calls the stepper makes, free of cost: sampled ids drawn from a pool of random ids."""

    overlap = True

    def __init__(self, vocab_size: int, seed: int) -> None:
        rng = random.Random(seed)
        self._pool = [rng.randrange(vocab_size) for _ in range(1 << 16)]   # ids handed out in turn
        self._at = 0
        self._ids: dict[int, list[int]] = {}      # id(Launched) -> its sampled ids

    def prepare(self, batch: ScheduledBatch, n_prev: int) -> None:
        return None

    def forward(self, batch: ScheduledBatch, staged: Any = None) -> Forwarded:
        return Forwarded(batch, [s for s in batch.seqs if s.sample], None)

    def sample(self, fwd: Forwarded, fill: Any = None) -> Launched:
        n, at = len(fwd.seqs), self._at
        if at + n > len(self._pool):
            at = 0
        self._at = at + n
        launched = Launched(fwd.batch, None, None, None)
        self._ids[id(launched)] = self._pool[at:at + n]
        return launched

    def resolve(self, launched: Launched) -> list[int]:
        it = iter(self._ids.pop(id(launched)))
        return [next(it) if s.sample else -1 for s in launched.batch.seqs]


class Clock:
    """Thread CPU time of wrapped calls, per phase, for the current step."""

    def __init__(self) -> None:
        self.now: dict[str, int] = dict.fromkeys(PHASES, 0)

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        now, clock = self.now, time.thread_time_ns

        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                now[label] += clock() - t0
        return timed

    def take(self) -> dict[str, int]:
        out = dict(self.now)
        for k in self.now:
            self.now[k] = 0
        return out


def workload(name: str, num: int, max_new_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) per request."""
    rng = random.Random(seed)
    if name == "free":
        return [([rng.randrange(1000, 30000) for _ in range(rng.randint(30, 60))], max_new_tokens)
                for _ in range(num)]
    if name == "nano":
        return [([rng.randrange(1000, 30000) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
                for _ in range(num)]
    raise ValueError(f"workload must be 'free' or 'nano', got {name!r}")


def run(name: str, num: int, max_new_tokens: int, seed: int = 0) -> dict[str, Any]:
    """One run of a workload; per-step phase times (ns) of the full-batch decode steps and totals."""
    reqs = workload(name, num, max_new_tokens, seed)
    tokens = sum(len(p) + o for p, o in reqs)
    cfg = SchedulerConfig(page_size=16, num_pages=tokens // 16 + 2 * num + 2, max_running_requests=num,
                          chunked_prefill_size=16384)
    sched = Scheduler(cfg)
    rids = RidRegistry()
    delivery = Delivery(sched, None, 151936, 16, LoopStats(), rids, lambda fn, *a: fn(*a))
    clock = Clock()
    runner = FakeRunner(151936, seed)
    for attr in ("prepare", "forward", "sample", "resolve"):
        setattr(runner, attr, clock.wrap("runner", getattr(runner, attr)))
    sched.schedule = clock.wrap("schedule", sched.schedule)
    sched.update = clock.wrap("apply", sched.update)
    stepper = OverlapStepper(runner, sched, clock.wrap("deliver", delivery.deliver), _fail, _no_sync,
                             delivery.release_wakes)
    done: list[Update] = []
    requests = [Request(rid=str(k), prompt_ids=p, params=SamplingParams(max_new_tokens=o, ignore_eos=True),
                        stop_ids=frozenset(), logprobs=LogprobRequest()) for k, (p, o) in enumerate(reqs)]
    rids.claim([r.rid for r in requests])
    delivery.add(requests, done.append, False)
    full: list[dict[str, int]] = []
    every: list[dict[str, int]] = []
    gc.collect()
    gc.freeze()
    while sched.has_work() or stepper.busy:
        t0 = time.thread_time_ns()
        rows = len(stepper.pending[0].batch.seqs) if stepper.pending is not None else 0
        stepper.step()
        t = clock.take()
        t["step"] = time.thread_time_ns() - t0
        every.append(t)
        if rows == num and stepper.pending is not None and len(stepper.pending[0].batch.seqs) == num \
                and stepper.pending[0].batch.is_decode_only:
            full.append(t)
    gc.unfreeze()
    assert len(done) == num and all(u.finished for u in done), "every request must finish"
    bad = [(u.rid, len(u.output["output_ids"]), o, u.output["meta_info"]["finish_reason"]) for u, (_, o) in zip(sorted(done, key=lambda u: int(u.rid)), reqs) if len(u.output["output_ids"]) != o]
    assert not bad, bad[:3]
    return {"name": name, "steps": len(every), "full_steps": len(full), "full": full, "every": every}


def _fail(batch: ScheduledBatch, e: Exception) -> None:
    raise e


def _no_sync(batch: ScheduledBatch) -> None:
    raise AssertionError("the replay's batches all overlap")


def summary(steps: list[dict[str, int]], agg: Callable[[list[int]], float]) -> dict[str, float]:
    """Per-phase us per step; ``ours``: the step without the fake runner, ``rest``: what is left of
    it after schedule, apply and deliver (the stepper's own walk and bookkeeping)."""
    if not steps:
        return {}
    d = {k: agg([s[k] for s in steps]) / 1e3 for k in PHASES}
    d["ours"] = agg([s["step"] - s["runner"] for s in steps]) / 1e3
    d["rest"] = agg([s["step"] - s["runner"] - s["schedule"] - s["apply"] - s["deliver"] for s in steps]) / 1e3
    return d


def line(label: str, d: dict[str, float]) -> str:
    keys = ("schedule", "apply", "deliver", "rest", "ours")
    return f"{label:22s} " + ", ".join(f"{k} {d.get(k, 0.0):7.1f}" for k in keys) + " us/step"


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="free,nano", help="comma-separated: free, nano")
    ap.add_argument("--num", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256, help="free: each request's output length")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    for name in args.workload.split(","):
        full: list[dict[str, int]] = []
        every: list[dict[str, int]] = []
        for r in range(args.repeats):
            res = run(name, args.num, args.max_new_tokens, seed=r)
            full += res["full"]
            every += res["every"]
        print(f"{name}: {len(every) // args.repeats} steps a run, {len(full) // args.repeats} full-batch decode steps")
        print(line(f"{name} full, median", summary(full, statistics.median)))
        print(line(f"{name} every, mean", summary(every, statistics.fmean)))


if __name__ == "__main__":
    main()
