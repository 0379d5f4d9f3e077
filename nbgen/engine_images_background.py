"""The image processor's pixel work (resizing, normalising, patches) in the background for ``image_data``.

An image's grid — and with it the prompt's slots, hashes and M-RoPE positions — follows from its size by
the processor's own resize rule (its module's ``smart_resize`` with its min / max pixels). So generate()
lays out the prompts at once and hands the requests to the engine while a thread pool still computes
the pixels, in prompt order; the loop thread waits for a request's pixels only when its first prompt
chunk reaches an image (``ImageInputs.pixels``): the first prefill steps overlap the rest of a batch's
preprocessing instead of following it. Processors whose rule is not known run on the caller's thread.
"""
from __future__ import annotations

import os
import sys
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

Grid = tuple[int, int, int]
_MAX_WORKERS = 8


def grids_ahead(proc: Any, pil: list[Any]) -> Optional[list[Grid]]:
    """The grids [(1, h, w)] ``proc`` gives these PIL images, from their sizes; None where its resize
    rule is not known (the count of patches is checked against the processor's own)."""
    resize = getattr(sys.modules.get(type(proc).__module__), "smart_resize", None)
    count = getattr(proc, "get_number_of_image_patches", None)
    if resize is None or count is None or not getattr(proc, "do_resize", False):
        return None
    try:
        lo, hi = int(proc.size["shortest_edge"]), int(proc.size["longest_edge"])
        p, m = int(proc.patch_size), int(proc.merge_size)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    grids = []
    for img in pil:
        w, h = img.size
        rh, rw = resize(h, w, factor=p * m, min_pixels=lo, max_pixels=hi)   # ValueError for extreme shapes
        if (rh // p) * (rw // p) != count(h, w):
            return None
        grids.append((1, rh // p, rw // p))
    return grids


def _process(proc: Any, pil: list[Any], grids: list[Grid]) -> torch.Tensor:
    """``proc``'s pixel patches [N, D] of ``pil``, checked against the grids the prompt was laid out for."""
    out = proc(images=pil, return_tensors="pt")
    got = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
    if got != grids:
        raise RuntimeError(f"the image processor gave grids {got}, the prompt was laid out for {grids}")
    return out["pixel_values"]


class BackgroundPixels:
    """A thread pool (started on first use, shut down with its owner) running the processor's pixel work."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None

    def submit(self, proc: Any, pil: list[Any], grids: list[Grid]) -> Future:
        """A Future of the pixel patches [N, D] of ``pil`` (whose grids are ``grids``)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(min(_MAX_WORKERS, os.cpu_count() or 1), thread_name_prefix="nbgen-images")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool.submit(_process, proc, pil, grids)
