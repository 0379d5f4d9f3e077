"""torch.profiler over the engine's steps (SGLang's ``start_profile`` / ``stop_profile``).

The profiler runs on the loop thread, which runs every step, so a trace shows the host work of the
scheduler, runner and sampler beside the kernels. It stops on ``stop_profile()`` or by itself after
``num_steps`` engine steps, and writes a Chrome / Perfetto trace (``.trace.json.gz``, as SGLang
names it: ``<output_dir>/<profile id>-TP-0.trace.json.gz``) plus a per-op summary.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

ACTIVITIES = ("CPU", "GPU", "MEM")


@dataclass
class ProfileOptions:
    """What to record (SGLang's start_profile arguments, validated)."""

    output_dir: str
    num_steps: Optional[int] = None
    activities: tuple[str, ...] = ("CPU", "GPU")
    with_stack: bool = False
    record_shapes: bool = False


@dataclass
class ProfileResult:
    """A finished profile: the trace file, the steps it covers and its top ops."""

    path: str
    steps: int
    seconds: float
    ops: list[dict[str, Any]] = field(default_factory=list)  # name, calls, cpu_us, device_us (totals)


def profile_options(output_dir: Optional[str] = None, num_steps: Optional[int] = None,
                    activities: Optional[Sequence[str]] = None, with_stack: Optional[bool] = None,
                    record_shapes: Optional[bool] = None) -> ProfileOptions:
    """Validate start_profile's arguments (ValueError naming the bad one)."""
    if num_steps is not None and (not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1):
        raise ValueError(f"num_steps must be an int >= 1 or None, got {num_steps!r}")
    acts = tuple(a.upper() for a in (activities or ("CPU", "GPU")))
    bad = [a for a in acts if a not in ACTIVITIES]
    if bad:
        raise ValueError(f"activities {bad} are not supported; choose from {list(ACTIVITIES)}")
    out = output_dir if output_dir is not None else tempfile.gettempdir()
    if not isinstance(out, (str, os.PathLike)):
        raise ValueError(f"output_dir must be a path, got {output_dir!r}")
    return ProfileOptions(str(out), num_steps, acts, bool(with_stack), bool(record_shapes))


def _top_ops(prof: Any, limit: int = 40) -> list[dict[str, Any]]:
    rows = []
    for e in prof.key_averages():
        device_us = float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0) or 0.0)
        rows.append({"name": e.key, "calls": int(e.count), "cpu_us": float(e.cpu_time_total),
                     "self_cpu_us": float(e.self_cpu_time_total), "device_us": device_us})
    rows.sort(key=lambda r: (r["device_us"], r["self_cpu_us"]), reverse=True)
    return rows[:limit]


class StepProfiler:
    """Owned by the loop thread: start, count steps, stop and export."""

    def __init__(self) -> None:
        self._prof: Any = None
        self._opts: Optional[ProfileOptions] = None
        self._steps = 0
        self._t0 = 0.0
        self.last: Optional[ProfileResult] = None   # set when a profile stops (by call or by num_steps)
        self._unclaimed = False   # stopped by num_steps; the next stop() returns it

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, opts: ProfileOptions, cuda: bool) -> None:
        """Begin recording (RuntimeError if a profile already runs)."""
        if self._prof is not None:
            raise RuntimeError("a profile is already running; call stop_profile() first")
        acts = [ProfilerActivity.CPU]
        if "GPU" in opts.activities and cuda:
            acts.append(ProfilerActivity.CUDA)
        os.makedirs(opts.output_dir, exist_ok=True)
        self._prof = profile(activities=acts, with_stack=opts.with_stack, record_shapes=opts.record_shapes,
                             profile_memory="MEM" in opts.activities)
        self._prof.__enter__()
        self._opts, self._steps, self._t0, self.last = opts, 0, time.perf_counter(), None
        self._unclaimed = False
        if cuda:
            torch.cuda.synchronize()

    def after_step(self) -> None:
        """Count one engine step; stop once ``num_steps`` ran."""
        self._steps += 1
        if self._opts is not None and self._opts.num_steps is not None and self._steps >= self._opts.num_steps:
            self.stop()
            self._unclaimed = True

    def stop(self) -> ProfileResult:
        """Stop, write the trace, keep the summary in ``last`` (RuntimeError if none runs)."""
        if self._prof is None:
            if self._unclaimed:   # stopped by num_steps since it started
                self._unclaimed = False
                return self.last
            raise RuntimeError("no profile is running; call start_profile() first")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        prof, opts = self._prof, self._opts
        self._prof = None
        prof.__exit__(None, None, None)
        path = os.path.join(opts.output_dir, f"{time.time():.6f}-TP-0.trace.json.gz")
        prof.export_chrome_trace(path)
        self.last = ProfileResult(path, self._steps, time.perf_counter() - self._t0, _top_ops(prof))
        return self.last
