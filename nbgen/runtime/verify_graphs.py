"""CUDA graphs for chain verify steps (SGLang's TARGET_VERIFY graphs; flashinfer backend).

A verify step of a small model is bound by the host: launching every layer's kernels one by one costs
several decode steps. When every seq of a step is a decode verifying its drafts (no prefill chunk; a
seq without drafts is a verify of zero drafts), the step is padded to bs rows of q tokens
(runtime/verify_layout.py: padding writes its K/V to the scratch page and is never seen by a real
token) and replays the graph captured for bs: embedding, all layers with the K/V writes, attention
through flashinfer's prefill kernel in CUDA-graph mode (causal rows, fixed ``qo_indptr = i * q``), the
final norm. Before a replay the host copies the step's token ids, positions, write slots and page
table into the graph's static buffers (one pinned staging set) and re-plans the bs wrapper.

Graphs exist for the decode graphs' batch sizes up to ``cuda_graph_max_bs`` whose bs * q tokens stay
within ``MAX_TOKENS`` and whose flashinfer plan fits its workspace; larger steps, steps with prefill
chunks and tree verifies run eagerly. EAGLE3's
three feature layers are captured inside the graph (the tensors the forward leaves in
``model.model.captured``) and handed back after each replay. The graphs bake in the addresses of the
weights and the KV pool: ``stale`` tells when the runner recaptured its own graphs (memory release),
and the stepper then builds them again.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

from nbgen.attention.flashinfer_backend import FlashInferBackend, FlashInferMetadata
from nbgen.core.batch import ScheduledBatch
from nbgen.kernels.batch_sizes import graph_batch_sizes, padded_batch_size
from nbgen.kernels.host_staging import StagingRing
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.step_inputs import to_device
from nbgen.runtime.verify_layout import VerifyLayout, verify_layout

logger = logging.getLogger("nbgen")

MAX_TOKENS = 4096   # the largest graph's bs * q: above it a step's GPU time outgrows its launch time


class VerifyGraphRunner:
    """Verify graphs for rows of ``q`` tokens; ``run`` returns the padded step's hidden states."""

    def __init__(self, runner: ModelRunner, q: int) -> None:
        backend = runner.backend
        assert isinstance(backend, FlashInferBackend) and runner.graphs is not None
        self.runner = runner
        self.owner = runner.graphs             # the decode graphs these were captured beside
        self.model, self.backend, self.q = runner.model, backend, q
        self.inner = runner.model.model
        P = backend.spec.page_size
        cap = max(1, min(runner.cfg.cuda_graph_max_bs, MAX_TOKENS // q))
        self.batch_sizes = [b for b in graph_batch_sizes(cap) if b * q <= MAX_TOKENS]
        mb = self.max_bs = self.batch_sizes[-1]
        dev = backend.spec.device
        pages_per_row = (runner.loaded.context_length + q + P - 1) // P + 1
        # static inputs: io rows (token ids, positions, write slots) of the largest graph; a bs graph reads
        # the first 3 * bs * q as [3, bs * q]; page tables: qo / kv indptr, last page lengths, kv indices
        self.io = torch.zeros(3 * mb * q, dtype=torch.long, device=dev)
        self.qo = torch.zeros(mb + 1, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(mb + 1, dtype=torch.int32, device=dev)
        self.last = torch.zeros(mb, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(mb * pages_per_row, dtype=torch.int32, device=dev)
        # pinned staging: io, then indptr pair + last, then indices
        self._ring = StagingRing(lambda: [torch.zeros(3 * mb * q, dtype=torch.long),
                                          torch.zeros(3 * mb + 2, dtype=torch.int32),
                                          torch.zeros(mb * pages_per_row, dtype=torch.int32)])
        self.wrappers: dict[int, Any] = {}
        self.metas: dict[int, FlashInferMetadata] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.captured: dict[int, list[torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
        stream = torch.cuda.Stream(dev)
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(dev)[0]
        skipped = [bs for bs in reversed(self.batch_sizes) if not self._capture(bs, stream)]
        if skipped:
            logger.info("verify graphs: no graph for bs %s (flashinfer's plan of that size does not fit its "
                        "workspace); those steps verify eagerly", skipped)
        self.batch_sizes = sorted(self.graphs)
        if not self.batch_sizes:
            raise RuntimeError("no verify graph size fits flashinfer's workspace")
        self.max_bs = self.batch_sizes[-1]
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = free0 - torch.cuda.mem_get_info(dev)[0]
        logger.info("captured %d verify graphs (bs %s, %d tokens a row) in %.1f s, %.0f MiB", len(self.graphs),
                    self.batch_sizes, q, self.capture_seconds, self.memory_bytes / 2**20)

    def stage(self, lay: VerifyLayout) -> None:
        """Copy a layout's inputs into the static buffers and plan its bs wrapper (queued work only)."""
        bs, T = lay.bs, lay.bs * lay.q
        st, npv = self._ring.next()
        io, tab, idx = npv
        io[:T], io[T: 2 * T], io[2 * T: 3 * T] = lay.ids, lay.positions, lay.slots
        nnz = len(lay.kv_indices)
        tab[: bs + 1], tab[bs + 1: 2 * bs + 2], tab[2 * bs + 2: 3 * bs + 2] = lay.qo_indptr, lay.kv_indptr, \
            lay.last_page_len
        idx[:nnz] = lay.kv_indices
        self.io[: 3 * T].copy_(st[0][: 3 * T], non_blocking=True)
        self.indices[:nnz].copy_(st[2][:nnz], non_blocking=True)
        # kv indices passed as the device buffer itself: flashinfer's copy into it is then a no-op
        self.backend.prefill.plan_verify(self.wrappers[bs], st[1][: bs + 1], st[1][bs + 1: 2 * bs + 2],
                                         self.indices[:nnz], st[1][2 * bs + 2: 3 * bs + 2])
        self._ring.done()

    def forward(self, bs: int) -> torch.Tensor:
        """The bs graph's forward over the static buffers as staged (captured; run eagerly by
        ``run_eager``) -> hidden states [bs * q, H]."""
        v = self.io[: 3 * bs * self.q].view(3, bs * self.q)
        return self.model(v[0], v[1], self.metas[bs])

    def _capture(self, bs: int, stream: torch.cuda.Stream) -> bool:
        """Capture the bs graph; False when flashinfer cannot plan that size: in graph mode its plan keeps
        split-KV scratch for every possible tile (bs * q query rows in tiles of up to 128), which for large
        bs outgrows the workspace it shares with the other wrappers."""
        self.wrappers[bs] = self.backend.prefill.make_verify_wrapper(self.qo[: bs + 1], self.kv_indptr[: bs + 1],
                                                                     self.indices, self.last[:bs])
        try:
            self.stage(verify_layout([], self.q, bs, self.backend.spec.page_size))   # all padding: scratch page
        except RuntimeError as e:
            logger.debug("verify graph bs %d: %s", bs, e)
            del self.wrappers[bs]
            return False
        self.metas[bs] = FlashInferMetadata(self.backend, self.io[2 * bs * self.q: 3 * bs * self.q],
                                            self.wrappers[bs])
        with torch.inference_mode():
            for _ in range(2):   # kernel selection, lazy allocations, JIT loads
                self.forward(bs)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, stream=stream):
                out = self.forward(bs)
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[bs], self.outputs[bs] = g, out
        # EAGLE3's feature layers: tensors the captured forward left (graph outputs, rewritten by each replay)
        self.captured[bs] = list(self.inner.captured) if getattr(self.inner, "capture_layers", ()) else []
        return True

    @property
    def stale(self) -> bool:
        """The runner's graphs were dropped or recaptured (weights or KV pool moved) since these were made."""
        return self.runner.graphs is not self.owner

    def release(self) -> None:
        """Free the graphs and their memory pool."""
        self.graphs.clear()
        self.outputs.clear()
        self.captured.clear()
        self.wrappers.clear()
        self.pool = None

    def can_run(self, batch: ScheduledBatch, verify_rows: list[bool]) -> bool:
        """Every seq of ``batch`` is a verify row (``verify_rows``) of at most q tokens, a graph holds them,
        and the graphs are current."""
        lora = self.runner.lora                  # adapter rows run eagerly, with the adapters' hooks
        return 0 < len(batch.seqs) <= self.max_bs and all(verify_rows) and not self.stale and \
            all(s.q_len <= self.q and s.tree_parents is None for s in batch.seqs) and \
            (lora is None or not lora.uses_adapters(batch))

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits [R, V] of ``hidden``'s rows ``rows``, computed over a row count padded to a graph batch
        size (cuBLAS picks its kernel on the host at every new row count: see ModelRunner)."""
        R = len(rows)
        idx = rows + [rows[-1]] * (padded_batch_size(R) - R)
        return self.model.compute_logits(hidden.index_select(0, to_device(idx, hidden.device)))[:R]

    def run(self, batch: ScheduledBatch, patch: Optional[Callable[[torch.Tensor], None]] = None
            ) -> tuple[torch.Tensor, list[int]]:
        """Replay the step -> (hidden states [bs * q, H], a view of the graph's output valid until the next
        replay; each seq's first row, i * q). EAGLE3: ``model.model.captured`` holds the graph's features.
        ``patch``: applied to the staged input ids [bs * q] on the device before the replay (drafts still
        on the device: runtime/spec_draft_graphs.py)."""
        n = len(batch.seqs)
        bs = self.graph_size(n)
        self.stage(verify_layout(batch.seqs, self.q, bs, self.backend.spec.page_size))
        if patch is not None:
            patch(self.io[: bs * self.q])
        self.graphs[bs].replay()
        self.replays += 1
        if self.captured[bs]:
            self.inner.captured = list(self.captured[bs])
        return self.outputs[bs], [i * self.q for i in range(n)]


    def graph_size(self, n: int) -> int:
        """The batch size of the graph a step of n seqs replays."""
        return next(b for b in self.batch_sizes if b >= n)

    def run_eager(self, batch: ScheduledBatch) -> torch.Tensor:
        """``run`` without the graph: the same staging, plan and forward run eagerly (bench/spec_graph_check.py
        compares the two) -> hidden states [bs * q, H]."""
        bs = self.graph_size(len(batch.seqs))
        self.stage(verify_layout(batch.seqs, self.q, bs, self.backend.spec.page_size))
        return self.forward(bs)


def make_verify_graphs(runner: ModelRunner, q: int) -> Optional[VerifyGraphRunner]:
    """Verify graphs for ``runner`` when it has decode graphs (CUDA, flashinfer, graphs on), a text model
    (M-RoPE models decode at shifted positions) and one GPU (tensor-parallel workers follow the runner's
    eager steps); None otherwise or when capture fails."""
    if runner.graphs is None or not isinstance(runner.backend, FlashInferBackend) or \
            hasattr(runner.model, "encode_images") or runner.cfg.tp_size > 1:
        return None
    try:
        return VerifyGraphRunner(runner, q)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        logger.warning("verify CUDA graphs unavailable (%s); verify steps run eagerly", e)
        torch.cuda.empty_cache()
        return None
