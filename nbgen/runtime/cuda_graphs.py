"""CUDA graphs for decode-only steps at padded batch sizes (flashinfer backend).

At start-up one graph per batch size in ``batch_sizes`` captures model.forward (embedding, all layers
with the KV writes and decode attention, final norm) over static input buffers; all graphs share one
memory pool (captured largest first, so smaller graphs reuse its blocks). A decode step of n seqs
replays the smallest graph with bs >= n: rows n..bs-1 are padding whose page table is the scratch
page 0 (one token) and whose KV slot is slot 0 of that page, so they never touch live pages.

Per replay the host does numpy work only (runtime/decode_staging.py): the step's token ids, positions,
KV slots, placeholder sources and page tables go to the GPU in one copy from a pinned staging buffer
into the buffer the graph and nbgen's decode kernel read (flashinfer's decode wrapper, above the Triton
kernel's batch sizes, is re-planned). Overlap placeholders (``step_inputs.placeholder(k)`` = "row k of the previous
step's sampled ids") are resolved inside the graph from ``prev``, where greedy sampling writes its ids directly
(``ModelRunner.sample``; other sampled ids are copied there): no host->device transfer for them.
Staging buffers alternate between two slots, each guarded by an event (a step's copies may still be
queued on the GPU while the host prepares the next step). Before the captures, each graph's forward is
dry-run once: the Triton variants they need compile in worker processes meanwhile.

Where rows share leading KV pages (a cached prompt prefix), a second graph per batch size >= 8 runs the
shared-prefix decode attention instead (runtime/cascade_graphs.py): ``stage`` plans it from the page
tables, writes its tables into the same input buffer, and the step replays that graph.

A step with rows that sample nothing (jump-forward's forced tokens) is staged with its sampling rows first
(``stage(sampling_first=True)``): each row's inputs travel with it and every row's K/V is written before any
row attends, so only where the sampling rows' hidden states land changes (rows 0..S-1): the LM head reads
them without a gather, and the heads below serve such a step too.

A step whose rows all take the argmax of their raw logits gets its ids from a greedy head
(runtime/greedy_heads.py: the LM head and the argmax captured as one more small graph per decode graph),
written into ``prev`` with no logits computed from Python; a step whose rows all take the argmax of their
grammar-masked logits gets them from the masked head at its sampling, once its bitmask is on the device.

A ``GraphVariant`` (LoRA: the adapters' kernels) adds a second graph per batch size, captured with
its context active into the same pool; a step replays it only when the variant says the batch
needs it, so steps that do not (no adapter row) run the plain graphs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch

from nbgen.attention.flashinfer_backend import FlashInferBackend, FlashInferMetadata
from nbgen.kernels import gpu_argmax
from nbgen.kernels.triton_decode import TritonDecodeWrapper
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.kernels.batch_sizes import graph_batch_sizes, padded_batch_size
from nbgen.kernels.host_staging import StagingRing
from nbgen.kernels.triton_precompile import Precompile
from nbgen.runtime import cascade_graphs
from nbgen.runtime.decode_staging import DecodeStaging, HostStep, Staged, StagingLayout
from nbgen.runtime.grammar_batch import greedy_grammar
from nbgen.runtime.greedy_heads import GreedyHeads
from nbgen.runtime.sampler_rows import raw_kinds
from nbgen.runtime.step_inputs import sampling_rows_first

logger = logging.getLogger("nbgen")

# previous step's sampled ids that placeholders can refer to inside a graph (larger batches: eager)
PREV_CAPACITY = 4096


@dataclass
class GraphVariant:
    """Second graphs captured inside ``capturing()``, replayed for the batches ``wanted`` accepts."""

    capturing: Callable[[], ContextManager[None]]
    wanted: Callable[[ScheduledBatch], bool]


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
        # every per-step input in one int32 buffer (runtime/decode_staging.py), so that a step's inputs go
        # to the GPU in one copy from a pinned twin of it; the shared-prefix tables (``cascade_graphs``)
        # in it where those graphs exist
        self.cascade = cascade_graphs.CascadeTables(backend, self.max_bs) \
            if cascade_graphs.supported(backend, variant) else None
        self.layout = StagingLayout(self.max_bs, max_context, backend.spec.page_size,
                                    self.cascade.size if self.cascade else 0)
        self.staging = DecodeStaging(self.layout, backend.tables, self.batch_sizes, self.cascade, self.mrope)
        self._buf = torch.zeros(self.layout.size, dtype=torch.int32, device=dev)
        self.io, self.indptr, self.last, self.order, self.indices = self.layout.views(self._buf)
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
        self.heads: Optional[GreedyHeads] = None   # LM head + argmax graphs (``capture_heads``)
        self.heads_memory_bytes = 0                 # device memory their capture took
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

    def _forward_static(self, bs: int, meta: FlashInferMetadata) -> torch.Tensor:
        """What a graph runs: resolve placeholders from ``prev``, then the model over the static rows."""
        v = self.io[: 4 * bs].view(4, bs)
        src = v[3]
        ids = torch.where(src >= 0, self.prev.index_select(0, src.clamp(min=0)), v[0])
        return self.model(ids, v[1], meta)

    def _send(self, st: list[torch.Tensor], step: HostStep) -> None:
        """Copy a written step's inputs to the GPU in one transfer and plan its bs wrapper."""
        self._buf[: step.end].copy_(st[0][: step.end], non_blocking=True)
        w = self.wrappers[step.bs]
        if not isinstance(w, TritonDecodeWrapper):   # nbgen's decode kernel reads the copied tables as they are
            # indices are passed as the device buffer itself: flashinfer's copy into it is then a no-op
            _io, hip, hlast, _order, _idx = self.layout.views(st[0])
            bs = step.bs
            self.backend.plan_decode(w, hip[: bs + 1], self.indices[: step.end - self.layout.cut[4]], hlast[:bs])

    def _capture(self, bs: int, warmup: int) -> None:
        """The graphs of ``bs``, each after ``warmup`` eager forwards (0: the precompile's dry run)."""
        w = self.backend.make_decode_wrapper(self.indptr[: bs + 1], self.indices, self.last[:bs], self.order[:bs])
        self.wrappers[bs] = w
        st, npv = self._ring.next()
        self._send(st, self.staging.write_padding(npv[0], bs))
        self._ring.done()
        meta = FlashInferMetadata(self.backend, self.io[2 * bs: 3 * bs], w)

        def capture(graphs: dict, outputs: dict, m: FlashInferMetadata) -> None:
            g, out = self._capture_one(bs, m, warmup)
            if warmup:                       # the dry run keeps nothing
                graphs[bs], outputs[bs] = g, out
        capture(self.graphs, self.outputs, meta)
        if self.cascade is not None and bs >= cascade_graphs.MIN_BS:
            cw = self.cascade.wrapper(self.layout.cascade_region(self._buf), bs, self.indptr[: bs + 1], self.indices,
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
        """Free every captured graph now (plain, variant and shared-prefix, the greedy heads), whoever still
        holds this runner; call only once the device finished with them."""
        for table in (self.graphs, self.variant_graphs, self.cascade_graphs):
            for g in table.values():
                g.reset()
        if self.heads is not None:
            self.heads.reset()

    def capture_heads(self, logits: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> None:
        """Capture the greedy heads (runtime/greedy_heads.py) over the plain and shared-prefix graphs:
        ``logits`` the model's LM head, ``vocab`` the columns the sampler argmaxes. Not with a graph
        variant (its steps may replay the variant's graphs) or where the argmax kernel cannot run."""
        probe = self.outputs[self.batch_sizes[0]]
        if self.variant is not None or not gpu_argmax.usable(logits(probe)[:, :vocab]):
            return
        t0, free0 = time.perf_counter(), torch.cuda.mem_get_info(self.backend.spec.device)[0]
        try:
            self.heads = GreedyHeads({False: self.outputs, True: self.cascade_outputs}, self.prev, logits, vocab,
                                     self.pool, self._capture_stream)
            self.heads_memory_bytes = free0 - torch.cuda.mem_get_info(self.backend.spec.device)[0]
            logger.info("captured %d greedy and masked head graphs in %.1f s, %.0f MiB", 2 * len(self.heads.graphs),
                        time.perf_counter() - t0, self.heads_memory_bytes / 2**20)
        except Exception as e:  # noqa: BLE001 - any capture failure: greedy steps sample from the logits
            logger.warning("nbgen: greedy head graphs unavailable (%s); greedy steps compute their logits", e)
            torch.cuda.synchronize(self.backend.spec.device)

    def greedy_ids(self, staged: Staged, seqs: list[SeqWork]) -> Optional[torch.Tensor]:
        """For a replayed step whose sampling rows are its first rows (all its rows, or leading) and all take the
        argmax of their raw logits: their ids [S], computed by replaying its greedy head into ``prev``; else None
        (no logits made)."""
        if self.heads is None or staged.variant or len(seqs) != staged.sampled or not raw_kinds(seqs) <= {"argmax"}:
            return None
        self.heads.run(*self._head_of(staged))
        return self.prev[: staged.sampled]

    def _head_of(self, staged: Staged) -> tuple[int, bool]:
        """(batch size, shared-prefix) of the head a step's ids come from: its graph's, or for a step whose S
        sampling rows lead, the plain head of padded(S) rows, those rows copied into its graph's output first
        (the LM head over the rows an eager step's covers: the same logits as that, on fewer rows)."""
        b = padded_batch_size(staged.lead) if staged.lead else staged.bs
        if b >= staged.bs or (b, False) not in self.heads.graphs:
            return staged.bs, staged.cascade
        self.outputs[b].copy_(self.padded_output(staged)[:b])
        return b, False

    def masked_head(self, staged: Staged, seqs: list[SeqWork]) -> bool:
        """The replayed step's sampling rows are its first rows (all its rows, or leading) and all take the
        argmax of their grammar-masked logits (``grammar_batch.greedy_grammar``): its ids may come from
        ``masked_ids`` at its sampling."""
        return (self.heads is not None and not staged.variant and len(seqs) == staged.sampled
                and greedy_grammar(seqs))

    def masked_ids(self, staged: Staged) -> torch.Tensor:
        """Replay the masked head of a step (``masked_head``) whose bitmask rows are in ``heads.bitmask`` for
        the current stream; its sampling rows' ids [S] (in ``prev``)."""
        self.heads.run_masked(*self._head_of(staged))
        return self.prev[: staged.sampled]

    def can_run(self, batch: ScheduledBatch, n_prev: int = 0) -> bool:
        """A decode-only batch that fits the largest graph (n_prev: ids its placeholders index)."""
        return batch.is_decode_only and len(batch.seqs) <= self.max_bs and n_prev <= PREV_CAPACITY

    def stage(self, batch: ScheduledBatch, ids: Optional[list[int]] = None, sampling_first: bool = False) -> Staged:
        """Copy a decode-only batch's inputs to the GPU and plan its graph's attention (queued
        work only). Safe while an earlier step is still queued: everything here lands in stream
        order after it. ``ids``: the seqs' token ids (default: each seq's token); ids < 0 are
        placeholders for rows of the previous step's sampled ids. ``sampling_first`` (without ``ids``,
        not with a graph variant): a batch with rows that sample nothing puts its sampling rows first
        (``Staged.lead``; the hidden states ``replay`` returns are then in that row order)."""
        st, npv = self._ring.next()
        seqs, lead = batch.seqs, 0
        if sampling_first and ids is None and self.variant is None:
            seqs, lead = sampling_rows_first(seqs)
        n = len(seqs)
        step = self.staging.write(npv[0], seqs, ids, self.staging.bs_of[n] in self.cascade_graphs, lead)
        if step.plan is not None:
            self.cascade_steps += 1
        self._send(st, step)
        self._ring.done()
        return Staged(n, step.bs, step.placeholders, self.variant is not None and self.variant.wanted(batch),
                      step.plan is not None, lead)

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

    def sampling_output(self, staged: Staged) -> torch.Tensor:
        """The hidden states of a replayed step whose sampling rows are its first rows (``Staged.sampled``),
        padded to a graph batch size: [>= S, H], rows S.. padding or other rows (a view, no gather)."""
        out = self.padded_output(staged)
        return out[: min(padded_batch_size(staged.lead), staged.bs)] if staged.lead else out

    def _graphs_of(self, staged: Staged) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
        """The graphs (and outputs) a staged step replays: the variant's, the shared-prefix ones or the plain."""
        if staged.variant:
            return self.variant_graphs, self.variant_outputs
        return (self.cascade_graphs, self.cascade_outputs) if staged.cascade else (self.graphs, self.outputs)

    def run(self, batch: ScheduledBatch, ids: list[int], prev: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stage and replay a decode-only batch (see ``stage`` / ``replay``)."""
        return self.replay(self.stage(batch, ids), prev)
