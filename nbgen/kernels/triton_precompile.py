"""Triton variants a forward needs, compiled in parallel before it runs (start-up).

A first start on a host with an empty Triton cache compiles every kernel variant the decode graphs use
(Qwen3-0.6B: 25 of them, ~0.45 s each on an H100 host) one after the other, each at the launch that
first needs it. Most of a compile runs without the GIL — ptxas in a subprocess, MLIR passes, LLVM's
optimizer and code generation in C++ (a cProfile of eight sm_90 compiles under Triton 3.6: 3.1 s
waiting for ptxas, 3.5 s in libtriton's passes, ~0.7 s of Python) — so several compile at once on a
thread pool.

``precompiled(steps, device)`` runs the steps once as a dry run: a Triton launch whose variant is not
compiled yet is not launched, its compile goes to the pool instead (Triton's ``jit_cache_hook``,
answered only on this thread: launches on other threads are untouched); torch's ops run as usual on
whatever the skipped kernels left in their outputs. When the first step finds nothing to compile (a
warm cache) the others are not run. Then it waits for the compiles, which leave each variant in
Triton's in-memory and on-disk caches, where the real runs that follow find them. The dry run's
results are meaningless: callers run the steps again for real (the decode graphs: every batch size's
forward dry-run first, then the captures). Any failure only means the real run compiles as it would
have anyway.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from typing import Any, Callable, Sequence

import torch

try:
    from triton import knobs
except ImportError:  # pragma: no cover - no Triton, or one without knobs: runs compile as they go
    knobs = None

logger = logging.getLogger("nbgen")

# compile threads (ptxas processes at once); the GPU hosts have 16 cores
MAX_WORKERS = 12


def workers() -> int:
    """Compile threads for this host."""
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))


def _compile(jit_function: Any, data: str, device: torch.device) -> None:
    torch.cuda.set_device(device)      # this thread compiles for the engine's GPU
    jit_function.preload(data)         # compiles, fills the kernel caches


def precompiled(steps: Sequence[Callable[[], Any]], device: torch.device) -> int:
    """Dry-run ``steps`` with their missing Triton variants compiled on a pool (see the module docstring);
    the number of variants compiled."""
    if knobs is None or device.type != "cuda" or knobs.runtime.jit_cache_hook is not None:
        return 0
    owner = threading.get_ident()
    seen: set[Any] = set()
    jobs: list[cf.Future] = []
    pool = cf.ThreadPoolExecutor(workers(), thread_name_prefix="nbgen-triton")

    def hook(*, key: Any, fn: Any, compile: dict, **_: Any) -> bool:
        if threading.get_ident() != owner:
            return False               # the pool's own compiles, other threads' launches: as usual
        k = (id(fn.jit_function), str(key))
        if k not in seen:
            seen.add(k)
            jobs.append(pool.submit(_compile, fn.jit_function, compile["specialization_data"], device))
        return True                    # not compiled here, not launched

    knobs.runtime.jit_cache_hook = hook
    try:
        for i, step in enumerate(steps):
            try:
                step()
            except Exception as e:     # a dry run's garbage may trip host-side checks: compile what was found
                logger.debug("Triton precompile dry run stopped early (%s)", e)
            if i == 0 and not jobs:    # nothing missing: a warm cache
                break
    finally:
        knobs.runtime.jit_cache_hook = None
    failed = 0
    for job in jobs:
        try:
            job.result()
        except Exception as e:         # the real run compiles it again and reports the error there
            failed += 1
            logger.debug("Triton precompile failed (%s)", e)
    pool.shutdown()
    return len(jobs) - failed
