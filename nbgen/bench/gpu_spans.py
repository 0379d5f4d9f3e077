"""Where the GPU's time goes between forwards, without the profiler: CUDA timing events around each
step's forward (CUDA only).

A step's forward is bracketed by two events recorded on the stream when the host queues it: ``S``
before its first kernel, ``E`` after its last. The GPU reaches ``S`` once the work queued before it
is done *and* the host has queued it, so over consecutive steps:

- forward span ``S_n -> E_n``: the forward's kernels plus any wait for the host's launches inside it;
- between forwards ``E_n -> S_n+1``: the step's tail (pooling or logits, sampling, copies to the host)
  plus the time the GPU sat idle waiting for the host to queue step n+1.

With the host one step ahead (the overlap stepper) the second number is the tail alone (well under a
millisecond); when it grows to milliseconds the host, not the GPU, sets the pace. ``--profile``'s
kernel busy time against the forward span tells the launch waits inside a forward.
"""
from __future__ import annotations

from typing import Any

import torch


class GpuSpans:
    """Wraps ``runner.hidden_states`` of an engine's loop while open (installed on the loop thread)."""

    def __init__(self, eng: Any) -> None:
        self._loop = eng.loop
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._loop.call(self._install)

    def _install(self) -> None:
        runner = self._loop.runner
        orig = runner.hidden_states
        events = self._events

        def timed(*a: Any, **k: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = orig(*a, **k)
            end.record()
            events.append((start, end))
            return out
        runner.hidden_states = timed

    def reset(self) -> None:
        self._loop.call(self._events.clear)

    def summary(self) -> dict[str, float]:
        """forwards, ms per forward span, ms between forwards (per gap), total seconds of each."""
        def read() -> dict[str, float]:
            torch.cuda.synchronize()
            ev = self._events
            fwd = [s.elapsed_time(e) for s, e in ev]                                 # ms
            gap = [e.elapsed_time(s2) for (_, e), (s2, _) in zip(ev, ev[1:])]
            n, g = max(len(fwd), 1), max(len(gap), 1)
            return {"forwards": len(fwd), "forward_ms": sum(fwd) / n, "between_ms": sum(gap) / g,
                    "forward_s": sum(fwd) / 1e3, "between_s": sum(gap) / 1e3}
        return self._loop.call(read)

    def close(self) -> None:
        def undo() -> None:
            runner = self._loop.runner
            if "hidden_states" in runner.__dict__:
                del runner.hidden_states
        self._loop.call(undo)
