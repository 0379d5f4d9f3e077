"""The content ids of a prompt's images: each image's RGB bytes and size hashed (sha256, with its grid) into
the id its slots hold (past the vocabulary), and the bytes kept as the device's input where the processor
keeps the image at its size.

Reading and hashing the bytes is most of generate()'s layout time for a batch of images (~1 ms an image,
much of it holding the GIL), and only the prefix cache needs the ids. So for a batch (``IdPool``) the
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
    rgb = None
    if src and isinstance(src[0], tuple):
        idents = src
    else:
        # the RGB bytes and the size identify the processed image (~10x cheaper to hash than patches)
        rgb = [img.tobytes() for img in src]
        idents = [(b, str(img.size).encode()) for b, img in zip(rgb, src)]
    hashes = []
    for ident, (t, h, w) in zip(idents, grids):
        digest = hashlib.sha256()
        for part in ident:
            digest.update(part)
        digest.update(f"{t},{h},{w}".encode())
        hashes.append(digest.hexdigest())
    pads = [vocab_size + int(h[:15], 16) % HASH_SPACE for h in hashes]
    raw = None
    if recipe is not None and rgb is not None:
        raw = RawImages([np.frombuffer(b, np.uint8).reshape(img.height, img.width, 3) for b, img in zip(rgb, src)],
                        recipe)
    return hashes, pads, raw


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
