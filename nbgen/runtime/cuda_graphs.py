"""CUDA graphs for decode-only steps at padded batch sizes (flashinfer backend).

At start-up one graph per batch size in ``batch_sizes`` captures model.forward (embedding, all layers
with the KV writes and decode attention, final norm) over static input buffers; all graphs share one
memory pool (captured largest first, so smaller graphs reuse its blocks). A decode step of n seqs
replays the smallest graph with bs >= n: rows n..bs-1 are padding whose page table is the scratch
page 0 (one token) and whose KV slot is slot 0 of that page, so they never touch live pages.
Before each replay the bs-sized flashinfer wrapper is re-planned into its fixed GPU buffers.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from nbgen.attention.flashinfer_backend import FlashInferBackend, FlashInferMetadata, page_tables
from nbgen.runtime.batch import ScheduledBatch
from nbgen.runtime.pages import SCRATCH_PAGE

logger = logging.getLogger("nbgen")


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_bs (and max_bs itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def default_max_bs(device: torch.device) -> int:
    """256 on large GPUs (>= 40 GiB), 128 on mid-size ones, 64 on small ones."""
    total = torch.cuda.get_device_properties(device).total_memory
    return 256 if total >= 40 << 30 else (128 if total >= 16 << 30 else 64)


class CudaGraphRunner:
    """Captures and replays decode graphs; ``run`` returns the last hidden states [n, H]."""

    def __init__(self, model: torch.nn.Module, backend: FlashInferBackend, max_bs: int, max_context: int) -> None:
        self.model = model
        self.backend = backend
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev = backend.spec.device
        P = backend.spec.page_size
        # static inputs: row 0 token ids, row 1 positions, row 2 KV slots (one H2D copy per step)
        self.io = torch.zeros(3, self.max_bs, dtype=torch.long, device=dev)
        self.indptr = torch.zeros(self.max_bs + 1, dtype=torch.int32, device=dev)
        pages_per_seq = (max_context + P - 1) // P + 1
        self.indices = torch.zeros(self.max_bs * pages_per_seq, dtype=torch.int32, device=dev)
        self.last = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.wrappers: dict[int, Any] = {}
        self.pool = None
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(dev)[0]
        for bs in reversed(self.batch_sizes):
            self._capture(bs)
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = free0 - torch.cuda.mem_get_info(dev)[0]
        logger.info("captured %d decode graphs (bs %s) in %.1f s, %.0f MiB", len(self.graphs),
                    self.batch_sizes, self.capture_seconds, self.memory_bytes / 2**20)

    def _plan_padding(self, bs: int, n: int, kv_ptr: list[int], idx: list[int], last: list[int]) -> None:
        pad = bs - n
        kv_ptr = kv_ptr + [kv_ptr[-1] + i + 1 for i in range(pad)]
        self.backend.plan_decode(self.wrappers[bs], kv_ptr, idx + [SCRATCH_PAGE] * pad, last + [1] * pad)

    def _capture(self, bs: int) -> None:
        w = self.backend.make_decode_wrapper(self.indptr[: bs + 1], self.indices, self.last[:bs])
        self.wrappers[bs] = w
        self._plan_padding(bs, 0, [0], [], [])
        meta = FlashInferMetadata(self.backend, self.io[2, :bs], w)
        ids, pos = self.io[0, :bs], self.io[1, :bs]
        with torch.inference_mode():
            for _ in range(2):   # warm-up: kernel selection, lazy allocations, JIT loads
                self.model(ids, pos, meta)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.model(ids, pos, meta)
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[bs] = g
        self.outputs[bs] = out

    def can_run(self, batch: ScheduledBatch) -> bool:
        return batch.is_decode_only and len(batch.seqs) <= self.max_bs

    def run(self, batch: ScheduledBatch, ids: list[int], pos: list[int], slots: list[int],
            patch: Any = None) -> torch.Tensor:
        """Replay for a decode-only batch; ``patch(input_ids_view)`` may fill placeholder ids on the GPU."""
        n = len(batch.seqs)
        bs = next(b for b in self.batch_sizes if b >= n)
        pad = [0] * (bs - n)   # padding: token 0 at position 0 into slot 0 of the scratch page
        host = torch.tensor([ids + pad, pos + pad, slots + pad], dtype=torch.long).pin_memory()
        self.io[:, :bs].copy_(host, non_blocking=True)
        if patch is not None:
            patch(self.io[0, :bs])
        _, kv_ptr, idx, last = page_tables(batch, self.backend.spec.page_size)
        self._plan_padding(bs, n, kv_ptr, idx, last)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
