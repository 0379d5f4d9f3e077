"""The environment variables nbgen reads, all of them (documented in docs/api.md).

Kept at the bottom layer so that every layer reads its settings from here; everything else a user
sets is an ``Engine`` argument.
- ``NBGEN_CACHE_DIR``: cache root (embedded model, converted GGUF weights, built CPU kernels);
  default ``~/.cache/nbgen``.
- ``NBGEN_CPU_KERNELS``: ``0`` / ``false`` / ``no`` / ``off`` turns nbgen's C kernels off (torch ops instead).
- ``NBGEN_GRAMMAR_THREADS``: threads of xgrammar's batch bitmask fill; default half the cores, at most 4;
  read at every batch fill, so a change applies to the next step.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """nbgen's cache root: $NBGEN_CACHE_DIR, else ~/.cache/nbgen."""
    root = os.environ.get("NBGEN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nbgen")
    return Path(root)


def cpu_kernels_enabled() -> bool:
    """False when NBGEN_CPU_KERNELS turns the C kernels off."""
    return os.environ.get("NBGEN_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def grammar_threads() -> int:
    """Threads of xgrammar's batch bitmask fill: NBGEN_GRAMMAR_THREADS, else half the cores (<= 4).

    xgrammar starts and joins its threads inside every fill call, so past a few threads their start
    costs more than the split saves, and they compete with the loop thread on a busy host."""
    env = os.environ.get("NBGEN_GRAMMAR_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(4, (os.cpu_count() or 2) // 2))
