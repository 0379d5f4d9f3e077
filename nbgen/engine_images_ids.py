"""The content ids of a prompt's images: each image's RGB bytes and size hashed (sha256, with its grid) into
the id its slots hold (past the vocabulary), and the bytes kept as the device's input where the processor
keeps the image at its size.

Reading and hashing the bytes is most of generate()'s layout time for a batch of images, and only the
prefix cache needs the ids. The bytes are Pillow's own memory where it exports it (``pixel_bytes``): a copy
(``tobytes``) holds the GIL, and the loop thread, launching the first steps, waits for it. So for a batch (``IdPool``) the
layout hands every prompt's grids, slots and positions on at once and the ids are computed on a pool, in
prompt order; the requests go to the engine in that order as their ids are ready
(``core/multimodal.submit_in_order``): the first prefill steps run while later images are still hashed.
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np

from nbgen.models.vision_pixels import PixelRecipe, RawImages

Grid = tuple[int, int, int]
HASH_SPACE = 1 << 30          # pad ids are vocab_size + (hash mod HASH_SPACE)
_WORKERS = 4                  # hashing releases the GIL; reading the bytes does not


def image_ids(src: list[Any], grids: list[Grid], vocab_size: int, recipe: Optional[PixelRecipe]
              ) -> tuple[list[str], list[int], Optional[RawImages]]:
    """(content hashes, slot ids, RawImages of the bytes when ``recipe`` is given) of one prompt's images;
    ``src``: the PIL images, or an identity (tuple of bytes) per image."""
    views = None
    if src and isinstance(src[0], tuple):
        idents = src
    else:
        # the pixels and the size identify the processed image (~10x cheaper to hash than patches)
        bufs, views = zip(*(pixel_bytes(img) for img in src))
        idents = [(b, str(img.size).encode()) for b, img in zip(bufs, src)]
    hashes = []
    for ident, (t, h, w) in zip(idents, grids):
        digest = hashlib.sha256()
        for part in ident:
            digest.update(part)
        digest.update(f"{t},{h},{w}".encode())
        hashes.append(digest.hexdigest())
    pads = [vocab_size + int(h[:15], 16) % HASH_SPACE for h in hashes]
    raw = RawImages(list(views), recipe) if recipe is not None and views is not None else None
    return hashes, pads, raw


def pixel_bytes(img: Any) -> tuple[Any, np.ndarray]:
    """(a buffer of an RGB PIL image's pixels to hash, its [H, W, 3] uint8 view): Pillow's own memory through
    its Arrow export (RGBX rows, no copy, ~30 us holding the GIL) where it gives one, else ``tobytes`` (a
    copy, ~0.2-0.5 ms of a 448x448 image holding the GIL, which the loop thread then waits for)."""
    h, w = img.height, img.width
    try:
        import pyarrow as pa
    except ImportError:
        pa = None
    if pa is not None:
        try:
            arr = pa.array(img)                                                # Pillow >= 11.2, one memory block
            if pa.types.is_fixed_size_list(arr.type) and arr.type.list_size == 4 and len(arr) == h * w:
                flat = arr.values.to_numpy(zero_copy_only=True)                # [H * W * 4] RGBX
                if flat.size == h * w * 4:
                    return flat, flat.reshape(h, w, 4)[..., :3]
        except (pa.ArrowException, AttributeError, TypeError, ValueError, NotImplementedError):
            pass
    b = img.tobytes()
    return b, np.frombuffer(b, np.uint8).reshape(h, w, 3)


class IdPool:
    """A thread pool (started on first use, shut down with its owner) computing ``image_ids`` jobs."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], tuple[list[str], list[int], Optional[RawImages]]]) -> tuple[Future, Future]:
        """(Future of (hashes, slot ids), Future of the RawImages) of ``job``; jobs start in submission order."""
        ids: Future = Future()
        raw: Future = Future()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="nbgen-image-ids")
                weakref.finalize(self, self._pool.shutdown, wait=False)
            self._pool.submit(_run, job, ids, raw)
        return ids, raw


def _run(job: Callable[[], tuple[list[str], list[int], Optional[RawImages]]], ids: Future, raw: Future) -> None:
    try:
        hashes, pads, pixels = job()
    except BaseException as e:   # noqa: BLE001 - the waiting caller re-raises it
        ids.set_exception(e)
        raw.set_exception(e)
        return
    ids.set_result((hashes, pads))
    raw.set_result(pixels)
