"""CUDA graphs for decode-only steps at padded batch sizes (flashinfer backend).

At start-up one graph per batch size in ``batch_sizes`` captures model.forward (embedding, all layers
with the KV writes and decode attention, final norm) over static input buffers; all graphs share one
memory pool (captured largest first, so smaller graphs reuse its blocks). A decode step of n seqs
replays the smallest graph with bs >= n: rows n..bs-1 are padding whose page table is the scratch
page 0 (one token) and whose KV slot is slot 0 of that page, so they never touch live pages.

Per replay the host does numpy work only: the step's token ids, positions, KV slots, placeholder
sources and page tables go to the GPU in one copy from a pinned staging buffer into the buffer the
graph and nbgen's decode kernel read (flashinfer's decode wrapper, above the Triton kernel's batch
sizes, is re-planned). Overlap placeholders (``step_inputs.placeholder(k)`` = "row k of the previous
step's sampled ids") are resolved inside the graph from ``prev``, where greedy sampling writes its ids directly
(``ModelRunner.sample``; other sampled ids are copied there): no host->device transfer for them.
Staging buffers alternate between two slots, each guarded by an event (a step's copies may still be
queued on the GPU while the host prepares the next step). Before the captures, each graph's forward is
dry-run once: the Triton variants they need compile in worker processes meanwhile.

Where rows share leading KV pages (a cached prompt prefix), a second graph per batch size >= 8 runs the
shared-prefix decode attention instead (runtime/cascade_graphs.py): ``stage`` plans it from the page
tables, writes its tables into the same input buffer, and the step replays that graph.

A ``GraphVariant`` (LoRA: the adapters' kernels) adds a second graph per batch size, captured with
its context active into the same pool; a step replays it only when the variant says the batch
needs it, so steps that do not (no adapter row) run the plain graphs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import numpy as np
import torch

from nbgen.attention.flashinfer_backend import FlashInferBackend, FlashInferMetadata
from nbgen.kernels.triton_decode import TritonDecodeWrapper, longest_first
from nbgen.core.batch import ScheduledBatch
from nbgen.kernels.batch_sizes import graph_batch_sizes
from nbgen.kernels.triton_precompile import Precompile
from nbgen.runtime import cascade_graphs
from nbgen.runtime.cascade_graphs import blocks128
from nbgen.runtime.pages import SCRATCH_PAGE
from nbgen.runtime.step_inputs import is_placeholder, placeholder_row, rope_deltas

logger = logging.getLogger("nbgen")

# previous step's sampled ids that placeholders can refer to inside a graph (larger batches: eager)
PREV_CAPACITY = 4096


@dataclass
class Staged:
    """A decode step whose inputs and plan are queued for replay of the bs-sized graph."""

    n: int                 # live rows
    bs: int                # graph batch size (rows n..bs-1 are padding)
    placeholders: bool     # some token ids come from the previous step's sampled ids
    variant: bool = False  # replay the variant's graph (GraphVariant)
    cascade: bool = False  # replay the shared-prefix graph (runtime/cascade_graphs.py)


@dataclass
class GraphVariant:
    """Second graphs captured inside ``capturing()``, replayed for the batches ``wanted`` accepts."""

    capturing: Callable[[], ContextManager[None]]
    wanted: Callable[[ScheduledBatch], bool]


class StagingRing:
    """Two sets of pinned host buffers used in turn for host->device copies: a set is handed out again
    only once the GPU has run the copies queued from it (an event per set; see the module docstring)."""

    def __init__(self, make: Callable[[], list[torch.Tensor]]) -> None:
        self._sets = [[t.pin_memory() for t in make()] for _ in range(2)]
        self._np = [[t.numpy() for t in st] for st in self._sets]
        self._events: list[Optional[torch.cuda.Event]] = [None, None]
        self._i = 0

    def next(self) -> tuple[list[torch.Tensor], list[np.ndarray]]:
        """The next set (pinned tensors, their numpy views), once its previous copies have run."""
        self._i ^= 1
        ev = self._events[self._i]
        if ev is not None:
            ev.synchronize()
        return self._sets[self._i], self._np[self._i]

    def done(self) -> None:
        """Mark the copies from the current set as queued (recorded behind them on the stream)."""
        ev = torch.cuda.Event()
        ev.record()
        self._events[self._i] = ev


class CudaGraphRunner:
    """Captures and replays decode graphs; ``run`` returns the last hidden states [n, H]."""

    def __init__(self, model: torch.nn.Module, backend: FlashInferBackend, max_bs: int, max_context: int,
                 variant: Optional[GraphVariant] = None, precompile: Optional[Precompile] = None) -> None:
        self.model = model
        self.variant = variant
        self.backend = backend
        self.mrope = hasattr(model, "encode_images")   # vision-language models decode at p + rope_delta
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev = backend.spec.device
        P = backend.spec.page_size
        mb = self.max_bs
        # every per-step input in one int32 buffer, so that a step's inputs go to the GPU in one copy
        # from a pinned twin of it: io (4 * mb int64: row 0 token ids, row 1 positions, row 2 KV slots,
        # row 3 placeholder source row or -1; a graph of bs reads the first 4 * bs as [4, bs]), then
        # the decode kernel's page tables: indptr [mb + 1], last page lengths [mb], the rows longest
        # first [mb] (``triton_decode.longest_first``), kv indices
        pages_per_seq = (max_context + P - 1) // P + 1
        # each view starts on a 128-byte boundary, as a separate allocation would: Triton specialises its
        # kernels on 16-byte pointer alignment, so the graphs compile the variants eager steps use
        # then the shared-prefix tables (``cascade_graphs.CascadeTables``) where those graphs exist
        self.cascade = cascade_graphs.CascadeTables(backend, mb) \
            if cascade_graphs.supported(backend, variant) else None
        a, b = blocks128(8 * mb), blocks128(mb + 1)
        c = a + b + blocks128(mb)
        d = c + blocks128(mb)
        self._cut = (a, a + b, c, d, d + (self.cascade.size if self.cascade else 0))
        self._buf = torch.zeros(self._cut[4] + mb * pages_per_seq, dtype=torch.int32, device=dev)
        self.io, self.indptr, self.last, self.order, self.indices = self._views(self._buf)
        self.prev = torch.zeros(PREV_CAPACITY, dtype=torch.long, device=dev)   # previous sampled ids
        self._ring = StagingRing(lambda: [torch.zeros(self._buf.numel(), dtype=torch.int32)])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.variant_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.variant_outputs: dict[int, torch.Tensor] = {}
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.cascade_outputs: dict[int, torch.Tensor] = {}
        self.cascade_steps = 0           # decode steps replayed on the shared-prefix graphs
        self.wrappers: dict[int, Any] = {}
        self.pool = None
        # a stream of this device: torch.cuda.graph's default capture stream is one per process, made
        # on the device of its first use, and capturing on it would move a second GPU's thread there
        self._capture_stream = torch.cuda.Stream(dev)
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(dev)[0]
        order = list(reversed(self.batch_sizes))
        # each capture waits for the variants its dry run met (kernels/triton_precompile.py)
        marks = precompile.record([lambda bs=bs: self._capture(bs, 0) for bs in order]) if precompile else order
        for i, bs in enumerate(order):
            if precompile is not None:
                precompile.wait(marks[i])
            self._capture(bs, warmup=2 if i == 0 else 1)
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = free0 - torch.cuda.mem_get_info(dev)[0]
        logger.info("captured %d decode graphs (bs %s) in %.1f s, %.0f MiB", len(self.graphs),
                    self.batch_sizes, self.capture_seconds, self.memory_bytes / 2**20)

    def _views(self, buf: Any) -> tuple[Any, Any, Any, Any, Any]:
        """(io int64, indptr, last, order, indices) views of the flat int32 input buffer (torch or numpy)."""
        a, b, c, d, e = self._cut
        io = buf[:a].view(torch.long) if isinstance(buf, torch.Tensor) else buf[:a].view(np.int64)
        return io, buf[a:b], buf[b:c], buf[c:d], buf[e:]

    def _cascade_region(self, buf: Any) -> Any:
        """The shared-prefix tables' region of the flat input buffer (torch or numpy)."""
        return buf[self._cut[3]: self._cut[4]]

    def _forward_static(self, bs: int, meta: FlashInferMetadata) -> torch.Tensor:
        """What a graph runs: resolve placeholders from ``prev``, then the model over the static rows."""
        v = self.io[: 4 * bs].view(4, bs)
        src = v[3]
        ids = torch.where(src >= 0, self.prev.index_select(0, src.clamp(min=0)), v[0])
        return self.model(ids, v[1], meta)

    def _send(self, bs: int, st: list, npv: list, n: int, nnz: int, skip: Optional[np.ndarray] = None) -> None:
        """Pad the staged page tables (n seqs, nnz pages) to bs rows, copy all staged inputs to the GPU
        in one transfer and plan the bs wrapper; padding rows get one page each (the scratch page)
        holding one token. ``skip``: a shared-prefix step's pages each row's level 1 skips [bs]."""
        pad = bs - n
        _io, ip, last, order, idx = self._views(npv[0])
        ip[n + 1: bs + 1] = ip[n] + np.arange(1, pad + 1, dtype=np.int32)
        last[n:bs] = 1
        order[:bs] = longest_first(ip[: bs + 1], last[:bs], self.backend.spec.page_size, skip)
        idx[nnz: nnz + pad] = SCRATCH_PAGE
        total = nnz + pad
        end = self._cut[4] + total
        self._buf[:end].copy_(st[0][:end], non_blocking=True)
        w = self.wrappers[bs]
        if not isinstance(w, TritonDecodeWrapper):   # nbgen's decode kernel reads the copied tables as they are
            # indices are passed as the device buffer itself: flashinfer's copy into it is then a no-op
            _io, hip, hlast, _order, _idx = self._views(st[0])
            self.backend.plan_decode(w, hip[: bs + 1], self.indices[:total], hlast[:bs])

    def _capture(self, bs: int, warmup: int) -> None:
        """The graphs of ``bs``, each after ``warmup`` eager forwards (0: the precompile's dry run)."""
        w = self.backend.make_decode_wrapper(self.indptr[: bs + 1], self.indices, self.last[:bs], self.order[:bs])
        self.wrappers[bs] = w
        st, npv = self._ring.next()
        io, ip, _last, _order, _idx = self._views(npv[0])
        ip[0] = 0
        io[: 4 * bs] = 0
        io[3 * bs: 4 * bs] = -1
        if self.cascade is not None:         # no chunks: the cascade graph's capture runs level 1 plainly
            self.cascade.fill(self._cascade_region(npv[0]), None, 0, bs)
        self._send(bs, st, npv, 0, 0)
        self._ring.done()
        meta = FlashInferMetadata(self.backend, self.io[2 * bs: 3 * bs], w)

        def capture(graphs: dict, outputs: dict, m: FlashInferMetadata) -> None:
            g, out = self._capture_one(bs, m, warmup)
            if warmup:                       # the dry run keeps nothing
                graphs[bs], outputs[bs] = g, out
        capture(self.graphs, self.outputs, meta)
        if self.cascade is not None and bs >= cascade_graphs.MIN_BS:
            cw = self.cascade.wrapper(self._cascade_region(self._buf), bs, self.indptr[: bs + 1], self.indices,
                                      self.last[:bs], self.order[:bs])
            capture(self.cascade_graphs, self.cascade_outputs, FlashInferMetadata(self.backend, meta.slot_mapping, cw))
        if self.variant is not None:
            with self.variant.capturing():
                capture(self.variant_graphs, self.variant_outputs, meta)

    def _capture_one(self, bs: int, meta: FlashInferMetadata, warmup: int) -> tuple[Any, torch.Tensor]:
        with torch.inference_mode():
            if warmup == 0:           # the precompile's dry run: the forward only
                return None, self._forward_static(bs, meta)
            for _ in range(warmup):   # kernel selection, lazy allocations, JIT loads
                self._forward_static(bs, meta)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, stream=self._capture_stream):
                out = self._forward_static(bs, meta)
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    def reset(self) -> None:
        """Free every captured graph now (plain, variant and shared-prefix), whoever still holds this
        runner; call only once the device finished with them."""
        for table in (self.graphs, self.variant_graphs, self.cascade_graphs):
            for g in table.values():
                g.reset()

    def can_run(self, batch: ScheduledBatch, n_prev: int = 0) -> bool:
        """A decode-only batch that fits the largest graph (n_prev: ids its placeholders index)."""
        return batch.is_decode_only and len(batch.seqs) <= self.max_bs and n_prev <= PREV_CAPACITY

    def stage(self, batch: ScheduledBatch, ids: list[int]) -> Staged:
        """Copy a decode-only batch's inputs to the GPU and plan its graph's attention (queued
        work only). Safe while an earlier step is still queued: everything here lands in stream
        order after it. ids < 0 are placeholders for rows of the previous step's sampled ids."""
        n = len(batch.seqs)
        bs = next(b for b in self.batch_sizes if b >= n)
        kv_ptr, idx, last, pos, slots = self.backend.tables.build(batch.seqs)
        st, npv = self._ring.next()
        hio, hip, hlast, _hord, hidx = self._views(npv[0])
        io = hio[: 4 * bs].reshape(4, bs)
        tok = np.fromiter(ids, dtype=np.int64, count=n)
        ph = is_placeholder(tok)
        io[0, :n] = np.where(ph, 0, tok)
        io[1, :n] = pos + rope_deltas(batch.seqs) if self.mrope else pos
        io[2, :n] = slots
        io[3, :n] = np.where(ph, placeholder_row(tok), -1)
        io[:3, n:] = 0                    # padding: token 0 at position 0 into slot 0 of the scratch page
        io[3, n:] = -1
        nnz = len(idx)
        hip[: n + 1] = kv_ptr
        hlast[:n] = last
        hidx[:nnz] = idx
        plan = self.cascade.plan(kv_ptr, idx, n) if bs in self.cascade_graphs else None
        if plan is not None:
            self.cascade.fill(self._cascade_region(npv[0]), plan, n, bs)
            self.cascade_steps += 1
        skip = None if plan is None else self.cascade.views(self._cascade_region(npv[0]))[0][:bs]
        self._send(bs, st, npv, n, nnz, skip)
        self._ring.done()
        return Staged(n, bs, bool(ph.any()), self.variant is not None and self.variant.wanted(batch),
                      plan is not None)

    def replay(self, staged: Staged, prev: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replay a staged step; ``prev``: the previous step's sampled ids (GPU) its placeholders
        name. Returns the last hidden states [n, H] (a view of the graph's output buffer)."""
        if staged.placeholders:
            assert prev is not None and prev.numel() <= PREV_CAPACITY, "placeholder without previous ids"
            if prev.data_ptr() != self.prev.data_ptr():     # else sampled into place (runner.sample)
                self.prev[: prev.numel()].copy_(prev)
        self._graphs_of(staged)[0][staged.bs].replay()
        return self.padded_output(staged)[: staged.n]

    def padded_output(self, staged: Staged) -> torch.Tensor:
        """The replayed step's hidden states with its padding rows: [bs, H] (rows n.. are padding)."""
        return self._graphs_of(staged)[1][staged.bs]

    def _graphs_of(self, staged: Staged) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
        """The graphs (and outputs) a staged step replays: the variant's, the shared-prefix ones or the plain."""
        if staged.variant:
            return self.variant_graphs, self.variant_outputs
        return (self.cascade_graphs, self.cascade_outputs) if staged.cascade else (self.graphs, self.outputs)

    def run(self, batch: ScheduledBatch, ids: list[int], prev: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stage and replay a decode-only batch (see ``stage`` / ``replay``)."""
        return self.replay(self.stage(batch, ids), prev)
