"""The Triton variants an engine start needs, compiled in worker processes before its runs meet them.

On a host whose Triton cache is empty, each variant a start-up launch meets (Qwen3-0.6B's start-up:
28, 0.5-0.8 s each on an H100 host) compiles when that launch first runs, one after the other on
the loop thread. ``Precompile`` runs the same steps once before: ``record(steps)`` dry-runs them with
this thread's Triton launches skipped (``triton_variants.Recorder``), and each variant missing from the
on-disk cache goes to a ``CompilePool`` as it is met (the pool starts at the first one). ``wait(mark)``
returns once the variants recorded up to a step are compiled, so the real run of that step loads them
from disk (~10 ms each). The dry run's results are meaningless: the caller runs the steps again for
real. When a record's first step finds nothing missing (a warm cache) its other steps are not run, and
no process starts; in a process whose kernels are loaded already no launch reaches the hook at all.

Any failure — a dry-run step that raises on what the skipped kernels left in their outputs, a compile
that fails, a worker that dies — only means the real run compiles those variants itself, as without
this. CPU devices and CPU-only installs do nothing here.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch

from nbgen.kernels.triton_pool import CompilePool, workers
from nbgen.kernels.triton_variants import Recorder, Variant, available

logger = logging.getLogger("nbgen")

# a pool that answers nothing for this long is given up (its variants then compile at their launches)
IDLE_S = 60.0


class Precompile:
    """One engine start's precompile (see the module docstring); a context manager that ends the pool."""

    def __init__(self, device: torch.device, n_workers: Optional[int] = None) -> None:
        self.enabled = device.type == "cuda" and available()
        self.n_workers = n_workers or workers()
        self.pool: Optional[CompilePool] = None
        self.recorded = 0                 # variants handed to the pool
        self.dry_s = 0.0                  # seconds spent in dry runs
        self.wait_s = 0.0                 # seconds spent waiting for the pool

    def _submit(self, v: Variant) -> None:
        if self.pool is None:
            try:
                self.pool = CompilePool(self.n_workers)
            except OSError as e:   # no process could start: the launches compile as they go
                logger.info("Triton precompile unavailable (%s)", e)
                self.enabled = False
                return
        self.pool.submit(v)
        self.recorded += 1

    def record(self, steps: Sequence[Callable[[], Any]]) -> list[int]:
        """Dry-run ``steps`` (see the module docstring); for each step, the number of variants recorded
        up to its end (``wait``'s mark before running it for real)."""
        marks: list[int] = []
        if self.enabled:
            t0 = time.perf_counter()
            with Recorder(self._submit) as rec:
                for i, step in enumerate(steps if rec.installed else ()):
                    if not self.enabled:
                        break
                    try:
                        step()
                    except Exception as e:   # noqa: BLE001 - the real run compiles what was not recorded
                        logger.debug("Triton precompile dry run stopped early (%s)", e)
                    marks.append(self.recorded)
                    if i == 0 and rec.missing == 0:   # nothing missing at the first step: a warm cache
                        break
            self.dry_s += time.perf_counter() - t0
        return marks + [self.recorded] * (len(steps) - len(marks))

    def wait(self, mark: int) -> None:
        """Return once the first ``mark`` recorded variants are compiled (or failed, or the pool is gone)."""
        if self.pool is not None and not self.pool.gone:
            t0 = time.perf_counter()
            self.pool.wait(mark, IDLE_S)
            self.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """End the pool (idempotent); log what it did."""
        if self.pool is not None:
            self.pool.close()
            p = self.pool
            logger.info("Triton precompile: %d variants in %d processes (%d failed), dry runs %.1f s, "
                        "waited %.1f s", self.recorded, self.n_workers, len(p.errors), self.dry_s, self.wait_s)
            for err in list(p.errors.values())[:3]:
                logger.debug("Triton precompile failure: %s", err)
            self.pool = None

    def __enter__(self) -> "Precompile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
