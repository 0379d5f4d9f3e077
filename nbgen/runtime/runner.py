"""ModelRunner: steps the model — one ``step(ScheduledBatch) -> StepOutput`` per scheduler step, on
the loop thread. Everything it steps with is built once by ``runtime/model_setup.setup_model``.

For overlap scheduling the step splits up: ``forward`` queues the forward pass, ``sample`` the sampling
(the sampled ids stay on the GPU, copied to pinned host memory behind an event), ``resolve`` waits for
them; ``prepare`` queues a graph step's inputs ahead of its forward. Placeholder token ids in a batch
(``step_inputs.placeholder``) name rows of the previous launch's sampled ids, filled in on the GPU.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from nbgen.core.batch import ScheduledBatch, StepOutput
from nbgen.core.config import EngineConfig
from nbgen.kernels.batch_sizes import padded_batch_size
from nbgen.runtime.fill_worker import FillJob
from nbgen.runtime.cuda_graphs import PREV_CAPACITY
from nbgen.runtime.embed_step import embed_step, is_embedding_batch
from nbgen.runtime.lora import LoRAManager, LoRAStep
from nbgen.runtime.logprob_step import needs_sync_step, sample_errors, step_with_logprobs
from nbgen.runtime.model_setup import make_decode_graphs, make_prefill_graphs, setup_model
from nbgen.runtime.sampler import SamplerOutput
from nbgen.runtime.step_handles import Forwarded, Launched, PreparedStep
from nbgen.runtime.tp_step import StepSender
from nbgen.runtime.step_inputs import FlatStep, IdsToHost, flatten, placeholder_patch, sampling_rows, to_device
from nbgen.runtime.vision_step import has_image_prefill, vision_step_for


class ModelRunner:
    """Runs forward passes for scheduled batches and samples the next tokens."""

    def __init__(self, cfg: EngineConfig, device: torch.device,
                 on_stage: Optional[Callable[[str], None]] = None) -> None:
        parts = setup_model(cfg, device, on_stage)
        self.cfg = parts.cfg
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.loaded = parts.loaded
        self.model = parts.loaded.model
        self.hf_config = parts.loaded.hf_config
        self.vocab_size = int(self.hf_config.vocab_size)
        self.kv_spec = parts.kv_spec
        self.num_pages = parts.kv_spec.num_pages
        self.backend = parts.backend
        self.sampler = parts.sampler
        self.graphs = parts.graphs
        self.prefill_graphs = parts.prefill_graphs
        self.norms_folded = parts.norms_folded
        # LoRA serving (enable_lora): adapters, hooks in the linears; on CUDA the decode and piecewise prefill
        # graphs run the adapters' kernels (``LoRAManager.stage``), elsewhere steps with adapters run eagerly
        self.lora: Optional[LoRAManager] = parts.lora
        self.startup_s = parts.startup_s
        self.cpu_offload = parts.offload         # cpu_offload_gb: the plan of the layers kept in host memory
        self.cuda_graph_batch_sizes = list(self.graphs.batch_sizes) if self.graphs else []
        self.piecewise_cuda_graph_tokens = list(self.prefill_graphs.buckets) if self.prefill_graphs else []
        # overlap scheduling needs asynchronous device work; CPU steps are synchronous anyway
        self.overlap = self.on_gpu and not self.cfg.disable_overlap_schedule
        self._last_tokens: Optional[torch.Tensor] = None  # ids sampled by the latest launch (GPU)
        self._forwards = 0                                # forward passes queued so far
        self._ids_to_host = IdsToHost(PREV_CAPACITY) if self.on_gpu else None   # sampled ids' pinned copies
        # vision-language models: steps with image prompt chunks go through the tower (runtime/vision_step.py)
        self.vision = vision_step_for(self.model, device, parts.loaded.dtype, self.cfg.step_token_budget)
        self.peers: Optional[StepSender] = None   # tensor parallelism, rank 0: the workers (runtime/tp_step.py)
        self.attention_backend_name = type(self.backend).__name__
        self._capture_heads()

    def drop_graphs(self) -> None:
        """Free the CUDA graphs and their pools now, whoever else holds them (memory release, tp shutdown:
        they bake in weight/KV addresses and captured all-reduces); steps run eagerly until ``capture_graphs``."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)   # no replay may still be running
        for holder in (self.graphs, self.prefill_graphs):
            if holder is not None:
                holder.reset()
        self.graphs = self.prefill_graphs = None
        self._last_tokens = None     # may view the dropped graphs' input buffer

    def capture_graphs(self) -> None:
        """Capture the CUDA graphs again, as at start-up (after the weights or the KV pool moved)."""
        variant = self.lora.graph_variant() if self.lora is not None else None
        self.graphs = make_decode_graphs(self.cfg, self.model, self.backend, self.loaded.context_length, variant)
        self.prefill_graphs = make_prefill_graphs(self.cfg, self.model, self.backend, self.loaded.context_length,
                                                  variant) if self.graphs else None
        self._last_tokens = None
        self._capture_heads()

    def _capture_heads(self) -> None:
        """The greedy and masked heads over the decode graphs (not under TP: its LM head gathers)."""
        if self.graphs is not None and self.cfg.tp_size == 1 and not self.cfg.is_embedding:
            self.graphs.capture_heads(self.model.compute_logits, self.vocab_size)

    # ---- inputs -------------------------------------------------------------------------------
    def to_device(self, values: list[int]) -> torch.Tensor:
        """An int64 tensor of ``values`` on the runner's device (no host sync on CUDA)."""
        return to_device(values, self.device)

    def note_sampled(self, tokens: torch.Tensor) -> None:
        """Record a step's sampled ids [S] (on the device): the next batch's placeholders name them
        (and, under tensor parallelism, the workers' ones: broadcast to them)."""
        self._last_tokens = tokens
        if self.peers is not None:
            self.peers.sampled(tokens, self.graphs is not None and tokens.data_ptr() == self.graphs.prev.data_ptr())

    def _placeholder_patch(self, ids: list[int]) -> Optional[Callable[[torch.Tensor], None]]:
        """``step_inputs.placeholder_patch`` over the previous launch's sampled ids."""
        return placeholder_patch(ids, self._last_tokens, self.device)

    def _input_ids(self, ids: list[int]) -> torch.Tensor:
        """``ids`` on the device with their placeholders filled from the previous launch's sampled ids."""
        patch = self._placeholder_patch(ids)
        input_ids = self.to_device(ids)
        if patch is not None:
            patch(input_ids)
        return input_ids

    def hidden_states(self, batch: ScheduledBatch, flat: FlatStep) -> torch.Tensor:
        """Hidden states [T, H] of the batch's tokens (logprob, embedding and verify steps' forward)."""
        run = lambda: self._hidden(batch, flat)  # noqa: E731
        return self.peers.hidden(batch, run) if self.peers is not None else run()

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits [R, V] of rows ``rows`` of ``hidden`` (the synchronous steps' LM head)."""
        run = lambda: self.model.compute_logits(hidden.index_select(0, self.to_device(rows)))  # noqa: E731
        return self.peers.logits(rows, run) if self.peers is not None else run()

    def _hidden(self, batch: ScheduledBatch, flat: FlatStep) -> torch.Tensor:
        ids = flat.ids
        if self.vision is not None and has_image_prefill(batch):
            return self.vision.hidden_states(batch, flat, self._input_ids(ids), self.backend.prepare(batch))
        if self._graphable(batch):
            return self.graphs.replay(self._stage(batch), self._last_tokens)   # placeholders resolved in the graph
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch, len(ids)) \
                and not self._lora_eager(batch):
            if self.lora is not None and self.lora.in_graphs:
                self.lora.stage(batch)              # adapter rows: the variant's pieces read them
            return self.prefill_graphs.run(batch, ids, self._placeholder_patch(ids))
        return self._eager(batch, flat, self.lora.step_info(batch, flat.starts) if self.lora is not None else None)

    def _eager(self, batch: ScheduledBatch, flat: FlatStep, lora: Optional[LoRAStep]) -> torch.Tensor:
        """Hidden states [T, H] of a step without CUDA graphs (``lora``: its adapter rows, hooks active)."""
        input_ids = self._input_ids(flat.ids)
        positions = self.to_device(flat.positions)
        meta = self.backend.prepare(batch)
        if lora is None:
            return self.model(input_ids, positions, meta)
        self.lora.begin(lora)
        try:
            return self.model(input_ids, positions, meta)
        finally:
            self.lora.end()

    # ---- one step -----------------------------------------------------------------------------
    def _stage(self, batch: ScheduledBatch, sampling_first: bool = False) -> PreparedStep:
        """A decode graph step's inputs (and its LoRA rows) queued for replay; ``sampling_first``: its
        sampling rows staged first (``CudaGraphRunner.stage``; the forward path, which reads only those)."""
        if self.lora is not None and self.lora.in_graphs:
            self.lora.stage(batch)
        return self.graphs.stage(batch, sampling_first=sampling_first)

    def _lora_eager(self, batch: ScheduledBatch) -> bool:
        """The batch has adapter rows and the graphs hold no LoRA kernels (no slot pool)."""
        return self.lora is not None and not self.lora.in_graphs and self.lora.uses_adapters(batch)

    def _graphable(self, batch: ScheduledBatch, n_prev: Optional[int] = None) -> bool:
        if self._lora_eager(batch) or self.vision is not None and has_image_prefill(batch):
            return False
        if n_prev is None:
            n_prev = self._last_tokens.numel() if self._last_tokens is not None else 0
        return self.graphs is not None and self.graphs.can_run(batch, n_prev)

    @torch.inference_mode()
    def prepare(self, batch: ScheduledBatch, n_prev: int) -> Optional[PreparedStep]:
        """Queue a decode-only batch's inputs and attention plan ahead of its forward (graph path;
        None otherwise). ``n_prev``: sampled ids of the step before it, which may still be queued."""
        if not self._graphable(batch, n_prev):
            return None
        return self._stage(batch, sampling_first=True)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, staged: Optional[PreparedStep] = None) -> Forwarded:
        """Queue the forward pass and the logits of the sampling rows (nothing is sampled yet).
        ``staged``: this batch's ``prepare`` result (made before the previous step was sampled)."""
        run = lambda: self._queue_forward(batch, staged)  # noqa: E731
        fwd = self.peers.forward(batch, run) if self.peers is not None else run()
        self._forwards += 1
        fwd.order = self._forwards
        return fwd

    def _queue_forward(self, batch: ScheduledBatch, staged: Optional[PreparedStep]) -> Forwarded:
        if staged is not None or self._graphable(batch):
            # decode-only graph replay: one token per seq, positions and slots come from the page tables
            seqs, rows = sampling_rows(batch)
            if staged is None:
                staged = self._stage(batch, sampling_first=True)
            hidden = self.graphs.replay(staged, self._last_tokens)
            if seqs and (not rows or staged.lead):   # the sampling rows lead the graph's rows: their logits
                ids = self.graphs.greedy_ids(staged, seqs)    # (_logits), or the ids from a greedy head's graph
                if ids is None and self.graphs.masked_head(staged, seqs):
                    return Forwarded(batch, seqs, None, head=staged)   # the masked head's, at sampling
                logits = self._logits(self.graphs.sampling_output(staged), len(seqs)) if ids is None else None
                return Forwarded(batch, seqs, logits, tokens=ids)
        else:
            flat = flatten(batch)
            rows, seqs = flat.sample_rows, flat.sample_seqs
            hidden = self.hidden_states(batch, flat)
        if not seqs:
            return Forwarded(batch, seqs, None)
        n = len(seqs)
        if self.on_gpu and padded_batch_size(n) != hidden.shape[0]:
            if not rows:
                rows = list(range(n))
            full = hidden.index_select(0, self.to_device(rows + [rows[-1]] * (padded_batch_size(n) - n)))
            return Forwarded(batch, seqs, self._logits(full, n))
        if n != hidden.shape[0]:
            hidden = hidden.index_select(0, self.to_device(rows))
        return Forwarded(batch, seqs, self._logits(hidden, n))

    def _logits(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        """Logits [n, vocab] of the first n rows of ``hidden``, whose row count on CUDA is a graph batch size
        (``padded_batch_size``): cuBLAS picks its kernel on the host at each new row count (~4 ms for the LM
        head on an H100), and a shrinking decode batch meets every count; padded, one per graph size."""
        return self.model.compute_logits(hidden)[:n]

    @torch.inference_mode()
    def sample(self, fwd: Forwarded, fill: Optional[FillJob] = None) -> Launched:
        """Queue the sampling of a forwarded step; the sampled ids stay on the device (output
        logprobs, where asked, on their way to the host: ``Launched.logprobs``).

        ``fill``: a grammar bitmask job started for these rows (``Constraints.fill_async``).
        """
        batch, seqs = fwd.batch, fwd.seqs
        if not seqs:
            return Launched(batch, None, None, None)
        # greedy ids straight into the decode graphs' input buffer (no copy before the next replay),
        # unless a later forward is queued already: it reads this buffer before these ids land
        out = None
        if self.graphs is not None and fwd.order == self._forwards and len(seqs) <= self.graphs.prev.numel():
            out = self.graphs.prev[: len(seqs)]
        try:
            res = SamplerOutput(fwd.tokens, []) if fwd.tokens is not None else self._masked_head(fwd, fill)
            if res is None:
                res = self.sampler(fwd.logits, seqs, fill=fill, greedy_out=out, defer_logprobs=True)
        finally:
            if fill is not None:
                fill.settle()
                if self.graphs is not None and self.graphs.heads is not None:
                    self.graphs.heads.bitmask.mark_read()   # the next fill's copy into it waits for this step
        tokens = res.token_ids
        self.note_sampled(tokens)
        if not self.on_gpu:
            return Launched(batch, tokens, tokens, None, res.errors, res.pending_logprobs)
        launched = Launched(batch, tokens, None, None, res.errors, res.pending_logprobs)
        launched.host, launched.event = self._ids_to_host.copy(tokens, launched)
        return launched

    def _masked_head(self, fwd: Forwarded, fill: Optional[FillJob]) -> Optional[SamplerOutput]:
        """A step forwarded without its LM head (``Forwarded.head``): its ids from the masked head's graph
        once its bitmask rows are in the heads' buffer, else (None) its logits computed now for the sampler."""
        if fwd.head is None:
            return None
        assert fwd.order == self._forwards, "a step's deferred LM head runs before the next forward"
        if fill is not None and fill.greedy:
            fill.wait()
            if fill.into(self.graphs.heads.bitmask, len(fwd.seqs)):
                return SamplerOutput(self.graphs.masked_ids(fwd.head), [])
        fwd.logits = self._logits(self.graphs.sampling_output(fwd.head), len(fwd.seqs))
        return None

    @staticmethod
    def resolve(launched: Launched) -> list[int]:
        """Wait for a launched step; its sampled id per seq (-1 where seq.sample is False)."""
        if launched.event is not None:
            launched.event.synchronize()
        toks = launched.host.tolist() if launched.host is not None else []
        launched.read = True
        if len(toks) == len(launched.batch.seqs):   # every seq sampled
            return toks
        it = iter(toks)
        return [next(it) if s.sample else -1 for s in launched.batch.seqs]

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> StepOutput:
        """Forward the batch's tokens, sample where asked, gather logprobs and hidden states (or pool
        embeddings)."""
        if is_embedding_batch(batch):
            return embed_step(self, batch)
        if not any(needs_sync_step(s) for s in batch.seqs):
            launched = self.sample(self.forward(batch))
            out = self.resolve(launched)
            n = len(batch.seqs)
            return StepOutput(next_token_ids=out, output_logprobs=[None] * n, prompt_logprobs=[None] * n,
                              errors=sample_errors(batch, launched.errors))
        return step_with_logprobs(self, batch)
