"""TowerGraphs: CUDA graphs of a vision tower over chunks of equal images, so that an image prefill step
launches a few graph replays instead of ~10 kernels per block and image batch (the tower is launch-bound).

The tower encodes every image on its own (attention stays within an image or its windows), so a step's
images split into chunks of ``k`` equal consecutive images with ``k`` on a power-of-two ladder (at most
``MAX_GRAPH_PATCHES`` patches a chunk): 27 images of 448x448 are chunks of 8, 8, 8, 2 and 1 images, and
every later step with such images replays the same few graphs. A chunk key (grid, k) runs eagerly the
first time it is seen (that run compiles and selects its kernels) and is captured the second time, so
one-off sizes never pay a capture. At most ``MAX_GRAPHS`` graphs are kept (least recently used dropped);
all share one memory pool. Each graph holds its static pixel buffer, its output and the tower plan
(``vision_plan.TowerPlan``) its kernels read. Images larger than a chunk run eagerly.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

logger = logging.getLogger("nbgen")

Grid = tuple[int, int, int]
Key = tuple[Grid, int]                 # (grid of each image, images in the chunk)
MAX_GRAPH_PATCHES = 8192               # patches of one captured chunk (8 images of 448x448)
MAX_CHUNK_IMAGES = 16
MAX_GRAPHS = 16
_MAX_SEEN = 1024                       # chunk keys remembered as seen once


@dataclass
class TowerGraph:
    """One captured chunk: replay after copying the chunk's pixels into ``pixels``."""

    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor               # [k * patches, C * tp * p * p] static input, model dtype
    out: torch.Tensor                  # [k * tokens, H] static output
    plan: Any                          # the tower plan the graph reads (kept alive with it)


def chunk_images(grids: Sequence[Grid], max_patches: int = MAX_GRAPH_PATCHES,
                 max_images: int = MAX_CHUNK_IMAGES) -> list[tuple[Grid, int, bool]]:
    """[(grid, k, graphable)]: consecutive runs of equal grids cut into power-of-two counts of images
    (largest first) of at most ``max_patches`` patches; a run of images larger than that is one eager chunk."""
    out: list[tuple[Grid, int, bool]] = []
    i = 0
    while i < len(grids):
        g = tuple(int(v) for v in grids[i])
        j = i
        while j < len(grids) and tuple(int(v) for v in grids[j]) == g:
            j += 1
        n, cap = j - i, min(max_images, max_patches // (g[0] * g[1] * g[2]))
        if cap == 0:
            out.append((g, n, False))
        while n > 0 and cap > 0:
            k = 1 << (min(n, cap).bit_length() - 1)
            out.append((g, k, True))
            n -= k
        i = j
    return out


class TowerGraphs:
    """Chunked CUDA-graph encoding for a model with ``encode_images(pixels, grids, plan)`` and
    ``image_plan(grids, device)``."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device
        self.graphs: OrderedDict[Key, TowerGraph] = OrderedDict()
        self.seen: set[Key] = set()
        self.pool: Optional[Any] = None
        self.enabled = True                # False after a failed capture: eager from then on
        self.captures = 0
        self.capture_seconds = 0.0
        self.replays = 0
        self._stream = torch.cuda.Stream(device)

    def drop(self) -> None:
        """Free every graph (the weights they read moved); chunks are captured again when seen twice."""
        self.graphs.clear()
        self.seen.clear()
        self.pool = None

    def encode(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Token embeddings [sum tokens, H] of the images ``grids`` whose patches are ``pixels`` [N, D]."""
        if not self.enabled:
            return self.model.encode_images(pixels, grids)
        outs, row = [], 0
        for g, k, graphable in chunk_images(grids):
            n = k * g[0] * g[1] * g[2]
            rows = pixels[row: row + n]
            row += n
            tg = self._graph((g, k), rows) if graphable else None
            if tg is None:
                outs.append(self.model.encode_images(rows, [g] * k))
                continue
            tg.pixels.copy_(rows)
            tg.graph.replay()
            self.replays += 1
            outs.append(tg.out.clone())      # the next replay of this graph overwrites ``out``
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _graph(self, key: Key, rows: torch.Tensor) -> Optional[TowerGraph]:
        tg = self.graphs.get(key)
        if tg is not None:
            self.graphs.move_to_end(key)
            return tg
        if key not in self.seen:             # first sighting: eager (kernels compiled, plan cached)
            if len(self.seen) >= _MAX_SEEN:
                self.seen.clear()
            self.seen.add(key)
            return None
        try:
            tg = self._capture(key, rows)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            logger.warning("vision tower CUDA graph capture failed (%s); the tower runs eagerly", e)
            self.enabled = False
            self.drop()
            return None
        self.graphs[key] = tg
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return tg

    def _capture(self, key: Key, rows: torch.Tensor) -> TowerGraph:
        t0 = time.perf_counter()
        grids = [key[0]] * key[1]
        plan = self.model.image_plan(grids, rows.device)      # built outside the capture (host copies)
        pixels = rows.clone()
        cur = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(cur)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = self.model.encode_images(pixels, grids, plan)
            finally:
                g.capture_end()
        cur.wait_stream(self._stream)
        if self.pool is None:
            self.pool = g.pool()
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        logger.info("captured a vision tower graph for %d image(s) of grid %s", key[1], key[0])
        return TowerGraph(g, pixels, out, plan)
