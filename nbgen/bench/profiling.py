"""What the bench watches besides throughput: cyclic-GC pauses and the GPU's busy time under torch.profiler."""
from __future__ import annotations

import gc
import time
from typing import Any

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


def print_gpu_profile(prof: Any, wall: float) -> None:
    """GPU busy time (sum of kernel times) against wall time, and the kernels that take the most."""
    ev = [e for e in prof.key_averages() if getattr(e, "device_type", None) is not None]
    dev_t = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    ev.sort(key=dev_t, reverse=True)
    busy = sum(dev_t(e) for e in ev) / 1e6
    print(f"profile: wall {wall:.2f} s, GPU kernels busy {busy:.2f} s ({100 * busy / wall:.0f}%)")
    for e in ev[:24]:
        print(f"  {dev_t(e) / 1e6:8.3f} s {e.count:8d}x  {e.key[:110]}")
