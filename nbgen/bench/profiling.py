"""What the bench watches besides throughput: cyclic-GC pauses and the GPU's busy time under torch.profiler."""
from __future__ import annotations

import gc
import time
from typing import Any, Optional

from nbgen.bench.layer_trace import print_layer_table

class GcPauses:
    """Cyclic-GC pauses in any thread while it is open (a full collection stalls the engine's loop
    thread, and with it the GPU, for as long as it walks the heap)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []     # (generation, seconds)
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def close(self) -> None:
        gc.callbacks.remove(self._cb)

    def summary(self, wall: float) -> str:
        total = sum(t for _, t in self.pauses)
        full = [t for g, t in self.pauses if g == 2]
        longest = max((t for _, t in self.pauses), default=0.0)
        return (f"GC during the timed runs ({wall:.2f} s): {len(self.pauses)} collections, {1e3 * total:.1f} ms; "
                f"{len(full)} full, {1e3 * sum(full):.1f} ms; longest {1e3 * longest:.1f} ms")


def print_gpu_profile(prof: Any, wall: float) -> float:
    """GPU busy time (sum of kernel times) against wall time, and the kernels that take the most;
    returns the busy seconds."""
    ev = [e for e in prof.key_averages() if getattr(e, "device_type", None) is not None]
    dev_t = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    ev.sort(key=dev_t, reverse=True)
    busy = sum(dev_t(e) for e in ev) / 1e6
    print(f"profile: wall {wall:.2f} s, GPU kernels busy {busy:.2f} s ({100 * busy / wall:.0f}%)")
    for e in ev[:24]:
        print(f"  {dev_t(e) / 1e6:8.3f} s {e.count:8d}x  {e.key[:110]}")
    return busy


class RunProfiles:
    """The timed runs' optional profiles, started at construction and printed by ``report``: torch.profiler
    over the GPU (``gpu``; with ``layer_anchor`` also the decode layer's kernels cut at that kernel,
    bench/layer_trace.py, its Chrome trace written to ``trace``) and cProfile of the engine's loop thread,
    where all host work of a step runs (``host``)."""

    def __init__(self, eng: Any, gpu: bool, host: bool, layer_anchor: Optional[str] = None,
                 trace: Optional[str] = None) -> None:
        self._eng, self._anchor, self._trace = eng, layer_anchor, trace or "/tmp/nbgen_bench_trace.json"
        self._prof: Any = None
        self._host: Any = None
        if gpu:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.__enter__()
        if host:
            import cProfile

            self._host = cProfile.Profile()
            eng.loop.call(self._host.enable)

    def report(self, wall: float) -> None:
        """Stop the profiles and print them (``wall``: the profiled runs' seconds)."""
        if self._host is not None:
            import pstats

            self._eng.loop.call(self._host.disable)
            print(f"host profile (loop thread, wall {wall:.2f} s under cProfile):")
            pstats.Stats(self._host).sort_stats("tottime").print_stats(22)
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            print_gpu_profile(self._prof, wall)
            if self._anchor:
                print_layer_table(self._prof, self._anchor, self._trace)


class StepTimer:
    """Per-step times of an engine's loop thread while open: the step's wall time, the part spent
    waiting for the device (CUDA: the sampled ids' sync in ``resolve``; CPU: the model's forward,
    which is the device work there) and the rest, the host's own work (scheduling, Python, grammar
    fills and accepts not hidden behind the device). Installed on the loop thread between steps."""

    def __init__(self, eng: Any, wait_on: Optional[tuple[Any, str]] = None) -> None:
        """``wait_on``: (object or class, method name) where a step waits for the device, when not
        the runner's ``resolve`` (CUDA) / ``forward`` (CPU): embedding steps wait in
        ``(pooling.PendingVectors, "wait")`` on CUDA and in ``(runner, "hidden_states")`` on the CPU."""
        self._loop = eng.loop
        self.steps = 0
        self.step_s = 0.0
        self.wait_s = 0.0
        runner = self._loop.runner
        self._wait_on = wait_on or (runner, "resolve" if getattr(runner, "on_gpu", False) else "forward")
        self._wait_orig = self._wait_on[0].__dict__.get(self._wait_on[1])   # a class's own function, if any
        self._loop.call(self._install)

    def _install(self) -> None:
        loop = self._loop
        target, name = self._wait_on
        step, wait = loop._step, getattr(target, name)
        if isinstance(target, type):     # a class: wrap its function, bound per instance as before
            wait = self._wait_orig

        def timed_step() -> None:
            t0 = time.perf_counter()
            step()
            self.steps += 1
            self.step_s += time.perf_counter() - t0

        def timed_wait(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return wait(*a, **k)
            finally:
                self.wait_s += time.perf_counter() - t0

        loop._step = timed_step
        setattr(target, name, timed_wait)

    def reset(self) -> None:
        self._loop.call(lambda: self.__dict__.update(steps=0, step_s=0.0, wait_s=0.0))

    def summary(self) -> dict[str, float]:
        """steps, ms per step, ms waiting for the device per step, host ms per step (read on the loop
        thread, after the step that delivered the last result has been counted)."""
        return self._loop.call(self._summary)

    def _summary(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"steps": self.steps, "step_ms": 1e3 * self.step_s / n, "wait_ms": 1e3 * self.wait_s / n,
                "host_ms": 1e3 * (self.step_s - self.wait_s) / n}

    def close(self) -> None:
        def undo() -> None:
            del self._loop._step
            target, name = self._wait_on
            if isinstance(target, type):
                setattr(target, name, self._wait_orig)
            elif getattr(type(target), name, None) is not None:
                delattr(target, name)
        self._loop.call(undo)
