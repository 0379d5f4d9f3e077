"""The image processor's pixel work in the background for ``image_data``: the processor's resize where the
device makes the patches (``engine_images_device.py``), else its whole output (resizing, normalising, patches).

An image's grid — and with it the prompt's slots, hashes and M-RoPE positions — follows from its size by
the processor's own resize rule (its module's ``smart_resize`` with its min / max pixels). So generate()
lays out the prompts at once and hands the requests to the engine while a thread pool still computes
the pixels, in prompt order; the loop thread waits for a request's pixels only when its first prompt
chunk reaches an image (``ImageInputs.pixels``): the first prefill steps overlap the rest of a batch's
preprocessing instead of following it. Processors whose rule is not known run on the caller's thread.
The pixel jobs of a batch start once its layout is done (``BackgroundPixels.held``): the workers' Python
holds the GIL a good part of their time, and run beside the layout they would slow it down several
times, holding back the first step, which needs the layout of every prompt but the pixels of a few.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from nbgen.engine_images_device import resized_rgb
from nbgen.models.vision_pixels import PixelRecipe, RawImages

Grid = tuple[int, int, int]
# Two workers: the processor's Python holds the GIL between its numpy calls, and every torch call of the
# loop thread releases and re-takes the GIL; with eight GIL-hungry workers the loop thread waited up to a
# switch interval (5 ms) for it at op after op, and the GPU sat idle inside the first steps' tower forwards
# (H200 profile, 256 448x448 images: gaps of 5-7 ms between tower kernels). Two keep well ahead of the
# tower (one 448x448 image takes ~2 ms of processor time, the GPU ~9 ms of step time per image).
_MAX_WORKERS = 2


def grids_ahead(proc: Any, pil: list[Any]) -> Optional[list[Grid]]:
    """The grids [(1, h, w)] ``proc`` gives these PIL images, from their sizes; None where its resize
    rule is not known (the count of patches is checked against the processor's own)."""
    grids = [_grid(proc, img.size[1], img.size[0]) for img in pil]
    return None if None in grids else grids


def _grid(proc: Any, h: int, w: int) -> Optional[Grid]:
    try:
        return _grid_of(proc, h, w)                     # cached: a batch has few sizes
    except TypeError:                                   # (an unhashable processor)
        return _grid_of.__wrapped__(proc, h, w)


@functools.lru_cache(maxsize=1024)
def _grid_of(proc: Any, h: int, w: int) -> Optional[Grid]:
    """``grids_ahead`` of one image size (ValueError for extreme shapes)."""
    resize = getattr(sys.modules.get(type(proc).__module__), "smart_resize", None)
    count = getattr(proc, "get_number_of_image_patches", None)
    if resize is None or count is None or not getattr(proc, "do_resize", False):
        return None
    try:
        lo, hi = int(proc.size["shortest_edge"]), int(proc.size["longest_edge"])
        p, m = int(proc.patch_size), int(proc.merge_size)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    rh, rw = resize(h, w, factor=p * m, min_pixels=lo, max_pixels=hi)
    return (1, rh // p, rw // p) if (rh // p) * (rw // p) == count(h, w) else None


def pixels_ahead(bg: "BackgroundPixels", proc: Any, recipe: Optional[PixelRecipe], pil: list[Any]
                 ) -> Optional[tuple[Any, list[Grid]]]:
    """(pixels, grids) of a prompt's images where the grids are known ahead, else None. Pixels: None when
    ``proc`` keeps every image at its size (their RGB bytes go to the device as they are), else a Future
    from ``bg`` of RawImages resized by ``proc`` (where ``recipe.resize``) or of ``proc``'s patches."""
    grids = grids_ahead(proc, pil)
    if grids is None:
        return None
    if recipe is not None and all(img.size == (w * recipe.patch, h * recipe.patch) for img, (_, h, w) in zip(pil, grids)):
        return None, grids
    return bg.submit(proc, pil, grids, recipe if recipe is not None and recipe.resize else None), grids


def _process(proc: Any, pil: list[Any], grids: list[Grid], recipe: Optional[PixelRecipe]) -> Any:
    """``proc``'s pixel patches [N, D] of ``pil`` (with ``recipe``: RawImages of ``proc``'s resized RGB
    bytes), checked against the grids the prompt was laid out for."""
    if recipe is not None:
        return RawImages([resized_rgb(proc, img, g) for img, g in zip(pil, grids)], recipe)
    out = proc(images=pil, return_tensors="pt")
    got = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
    if got != grids:
        raise RuntimeError(f"the image processor gave grids {got}, the prompt was laid out for {grids}")
    return out["pixel_values"]


class BackgroundPixels:
    """A thread pool (started on first use, shut down with its owner) running the processor's pixel work."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._holds = 0                                  # layouts in progress (``held``)
        self._queued: list[tuple[Future, Any, list[Any], list[Grid], Optional[PixelRecipe]]] = []

    @contextmanager
    def held(self) -> Iterator[None]:
        """Jobs submitted meanwhile (from any thread) start when it ends, in submission order (when
        layouts of several callers overlap: when the last one ends)."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                jobs, self._queued = (self._queued, []) if self._holds == 0 else ([], self._queued)
            for job in jobs:
                self._start(*job)

    @property
    def held_jobs(self) -> int:
        """Jobs waiting for the layouts in progress to end."""
        return len(self._queued)

    def submit(self, proc: Any, pil: list[Any], grids: list[Grid], recipe: Optional[PixelRecipe] = None) -> Future:
        """A Future of the pixel patches [N, D] of ``pil`` (whose grids are ``grids``); with ``recipe``, of
        their RawImages (resized by ``proc``)."""
        fut: Future = Future()
        with self._lock:
            if self._holds:
                self._queued.append((fut, proc, pil, grids, recipe))
                return fut
        self._start(fut, proc, pil, grids, recipe)
        return fut

    def _start(self, fut: Future, proc: Any, pil: list[Any], grids: list[Grid], recipe: Optional[PixelRecipe]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(min(_MAX_WORKERS, os.cpu_count() or 1), thread_name_prefix="nbgen-images")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        self._pool.submit(_fill, fut, proc, pil, grids, recipe)


def _fill(fut: Future, proc: Any, pil: list[Any], grids: list[Grid], recipe: Optional[PixelRecipe]) -> None:
    """Run one pixel job into its Future."""
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(_process(proc, pil, grids, recipe))
    except BaseException as e:   # noqa: BLE001 - the waiting step re-raises it
        fut.set_exception(e)
