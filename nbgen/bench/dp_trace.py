"""Per-replica traces of a run for ``bench.dp_profile``: each replica's scheduled batches over time,
its waits for the device, the CPU time of the process's threads, and a GIL probe.

``ReplicaTrace`` wraps a replica loop's public ``scheduler.schedule`` and ``runner.resolve`` (CUDA;
``runner.forward`` on a CPU): a clock read and a list append per step, on that replica's loop thread.
``ThreadCpu`` reads ``/proc/self/task/<tid>/stat`` (Linux) before and after. ``GilProbe`` runs a
thread that sleeps 1 ms over and over and records how late it wakes: with the GIL held by other
threads a waking thread waits for it (up to the switch interval), so the lateness is the GIL's queue.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["GilProbe", "ReplicaTrace", "ThreadCpu"]


class ReplicaTrace:
    """Each scheduled batch (clock, rows, prefill tokens, KV tokens its attention reads) and each device
    wait of one replica loop."""

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        # (perf_counter at schedule, rows, prefill tokens, KV tokens read: each row's context after the step)
        self.steps: list[tuple[float, int, int, int]] = []
        self.wait_s = 0.0                                 # summed waits for the device
        self.waits = 0
        self.tid = loop.call(threading.get_native_id)
        loop.call(self._install)

    def _install(self) -> None:
        sched, runner = self._loop.scheduler, self._loop.runner
        schedule, steps, clock = sched.schedule, self.steps, time.perf_counter
        name = "resolve" if getattr(runner, "on_gpu", False) else "forward"
        wait = getattr(runner, name)

        def traced_schedule(*a: Any, **k: Any) -> Any:
            t = clock()
            batch = schedule(*a, **k)
            if batch is not None:
                seqs = batch.seqs
                steps.append((t, len(seqs), batch.num_prefill_tokens,
                              sum(w.start_pos + len(w.token_ids) for w in seqs)))
            return batch

        def timed_wait(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return wait(*a, **k)
            finally:
                self.wait_s += clock() - t0
                self.waits += 1

        sched.schedule = traced_schedule
        setattr(runner, name, timed_wait)
        self._undo: Callable[[], None] = lambda: (delattr(sched, "schedule"), delattr(runner, name))

    def reset(self) -> None:
        def zero() -> None:
            self.steps.clear()
            self.wait_s, self.waits = 0.0, 0
        self._loop.call(zero)

    def summary(self, t0: float, t1: float, step_floor: Callable[[int], float], windows: int = 10) -> dict[str, Any]:
        """The steps between ``t0`` and ``t1`` (perf_counter): counts, first and last step (s after
        ``t0``), ms per step, device wait ms per step, and over ``windows`` equal spans of the run its
        steps, mean rows per step, ms per step and the floor's ms per step (``step_floor``: seconds of
        a step that reads the weights and this many KV tokens, at the copy bandwidth)."""
        st = self._loop.call(lambda: list(self.steps))
        wait_s = self._loop.call(lambda: self.wait_s)
        if not st:
            return {"steps": 0}
        first, last = st[0][0] - t0, st[-1][0] - t0
        span = (t1 - t0) / windows
        win: list[list[int]] = [[] for _ in range(windows)]     # step indices per span
        for j, s in enumerate(st):
            win[min(int((s[0] - t0) / span), windows - 1)].append(j)
        ends = [s[0] for s in st[1:]] + [t1]                    # a step lasts until the next one's schedule
        floors = [step_floor(s[3]) for s in st]
        busy = st[-1][0] - st[0][0]
        n = len(st)

        def ms(js: list[int], xs: list[float]) -> float:
            return round(1e3 * sum(xs[j] for j in js) / len(js), 2) if js else 0.0
        took = [e - s[0] for e, s in zip(ends, st)]
        return {"steps": n, "first_s": first, "last_s": last, "step_ms": 1e3 * busy / max(n - 1, 1),
                "wait_ms": 1e3 * wait_s / n, "host_ms": 1e3 * (busy - wait_s) / max(n - 1, 1),
                "prefill_steps": sum(1 for s in st if s[2]), "rows_mean": sum(s[1] for s in st) / n,
                "floor_s": sum(floors), "steps_s": sum(took),
                "rows_by_window": [round(sum(st[j][1] for j in js) / len(js)) if js else 0 for js in win],
                "steps_by_window": [len(js) for js in win],
                "ms_by_window": [ms(js, took) for js in win], "floor_ms_by_window": [ms(js, floors) for js in win]}

    def close(self) -> None:
        self._loop.call(self._undo)


class ThreadCpu:
    """CPU seconds (user + system) of each thread of this process between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._start: dict[int, float] = {}

    def _read(self) -> dict[int, float]:
        out: dict[int, float] = {}
        if not sys.platform.startswith("linux"):
            return out
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue             # the thread ended meanwhile
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / self._tick    # utime, stime
        return out

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict[int, float]:
        """tid -> CPU seconds used since ``start`` (threads that used any)."""
        end = self._read()
        return {tid: c - self._start.get(tid, 0.0) for tid, c in end.items() if c - self._start.get(tid, 0.0) > 0}

    @staticmethod
    def names() -> dict[int, str]:
        """tid -> the Python thread's name, for the threads Python knows."""
        return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


class GilProbe:
    """A thread sleeping ``period`` s at a time, recording how late each wake-up runs (seconds)."""

    def __init__(self, period: float = 1e-3) -> None:
        self.period = period
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self.late.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nbgen-gil-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        clock, period, late = time.perf_counter, self.period, self.late
        while not self._stop.is_set():
            t = clock()
            time.sleep(period)
            late.append(clock() - t - period)

    def stop(self) -> dict[str, float]:
        """Wake-ups, mean / p90 / max lateness in ms."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        xs = sorted(self.late)
        if not xs:
            return {"wakes": 0}
        return {"wakes": len(xs), "mean_ms": 1e3 * sum(xs) / len(xs), "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))],
                "max_ms": 1e3 * xs[-1]}
