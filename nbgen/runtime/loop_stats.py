"""The engine loop's counters, read by ``Engine.stats()`` and the dashboard from any thread.

The loop thread publishes a snapshot of scheduler state after every step and every posted call,
adds each step's token counts, and counts finished and aborted requests; callers copy it under one lock.
Rates are tokens per second over a sliding window of recent steps.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Rates:
    """Input / output tokens per second over a sliding window (seconds)."""

    window: float = 2.0
    events: deque = field(default_factory=deque)  # (time, input tokens, output tokens)

    def add(self, n_in: int, n_out: int) -> None:
        now = time.time()
        self.events.append((now, n_in, n_out))
        while self.events and now - self.events[0][0] > self.window:
            self.events.popleft()

    def rates(self) -> tuple[float, float]:
        now = time.time()
        ev = [e for e in self.events if now - e[0] <= self.window]
        if not ev:
            return 0.0, 0.0
        span = max(now - ev[0][0], 0.25)
        return sum(e[1] for e in ev) / span, sum(e[2] for e in ev) / span


class LoopStats:
    """Snapshot + totals + rates (written by the loop thread, read by any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap: dict[str, Any] = {}
        self._rates = Rates()
        self._totals = {"total_input_tokens": 0, "total_output_tokens": 0,
                        "total_cached_tokens": 0, "total_finished": 0, "total_aborted": 0}
        self._t0 = time.time()
        # speculative decoding (runtime/spec_step.py): decode steps of requests, tokens they produced,
        # drafts proposed and accepted
        self._spec = {"spec_verify_steps": 0, "spec_tokens": 0, "spec_drafts": 0, "spec_accepted": 0}

    def publish(self, snapshot: dict[str, Any]) -> None:
        with self._lock:
            self._snap.update(snapshot)

    def account(self, n_in: int, n_out: int, snapshot: dict[str, Any]) -> None:
        """One step's tokens, with the scheduler state after it."""
        self._rates.add(n_in, n_out)
        with self._lock:
            self._snap.update(snapshot)
            self._totals["total_input_tokens"] += n_in
            self._totals["total_output_tokens"] += n_out

    def spec_step(self, steps: int, tokens: int, drafts: int, accepted: int) -> None:
        """One speculative step: ``steps`` requests verified, producing ``tokens`` tokens from
        ``drafts`` proposed drafts of which ``accepted`` were accepted."""
        with self._lock:
            for k, v in zip(self._spec, (steps, tokens, drafts, accepted)):
                self._spec[k] += v

    def finished(self, cached_tokens: int, aborted: bool = False) -> None:
        """One request ended: finished (stop / length) or aborted (by the caller, or failed)."""
        with self._lock:
            self._totals["total_aborted" if aborted else "total_finished"] += 1
            self._totals["total_cached_tokens"] += cached_tokens

    def read(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self._snap)
            s.update(self._totals)
            if self._spec["spec_verify_steps"]:   # SGLang's names: tokens per verify step, accepted / drafted
                sp = self._spec
                s.update(sp)
                s["spec_accept_length"] = sp["spec_tokens"] / sp["spec_verify_steps"]
                s["spec_accept_rate"] = sp["spec_accepted"] / max(sp["spec_drafts"], 1)
        s["input_tok_s"], s["output_tok_s"] = self._rates.rates()
        s["uptime_s"] = time.time() - self._t0
        s["time"] = time.time()
        return s
