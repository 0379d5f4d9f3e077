"""ModelRunner: owns the model, the KV cache (through an attention backend) and the sampler.

One ``step(ScheduledBatch) -> StepOutput`` per scheduler step; everything here runs on the loop thread.
For overlap scheduling the step splits up: ``forward`` queues the forward pass, ``sample`` the
sampling (``launch`` = both; the sampled ids stay on the GPU, copied to pinned host memory behind
an event), ``resolve`` waits for them; ``prepare`` queues a graph step's inputs ahead of its forward.
A decode token id < 0 in a batch is a placeholder for "the token sampled at row -id-1 of the
previous launch" and is filled in on the GPU.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from nbgen.attention.base import AttentionBackend, KVCacheSpec
from nbgen.core.config import EngineConfig
from nbgen.core.batch import ScheduledBatch, SeqWork, StepOutput
from nbgen.kernels.batch_sizes import default_max_bs, padded_batch_size
from nbgen.runtime.logprob_step import per_seq, step_with_logprobs, wants_logprobs

logger = logging.getLogger("nbgen")

# CPU default KV budget when max_total_tokens is not given: enough for a notebook's batches while
# keeping the embedded model's resident memory well under 1.5 GB (its KV is ~23 KB/token in bf16).
CPU_DEFAULT_TOTAL_TOKENS = 16384
# GPU memory kept out of the KV pool besides (1 - mem_fraction_static): flashinfer workspace, graph pool
GPU_RESERVE_BYTES = 1 << 30


def _model_dims(hf) -> tuple[int, int, int, int]:
    """(num_layers, num_q_heads, num_kv_heads, head_dim) of an HF config."""
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return hf.num_hidden_layers, heads, kv, head_dim


@dataclass
class Forwarded:
    """A step whose forward pass is queued: logits [S, V] of its S sampling rows, not sampled yet."""

    batch: ScheduledBatch
    seqs: list[SeqWork]                   # the sampling seqs, in logits row order
    logits: Optional[torch.Tensor]
    hidden: Optional[torch.Tensor]        # [S, H] final-normed states (views graph memory under replay)
    order: int = 0                        # forwards queued before it, this one included


@dataclass
class Launched:
    """A step whose GPU work is queued: sampled ids [S] on the GPU (and on their way to the host)."""

    batch: ScheduledBatch
    tokens: Optional[torch.Tensor]        # [S] long on the device, S = number of sampling seqs
    host: Optional[torch.Tensor]          # [S] long pinned copy (valid once `event` completed)
    event: Optional[Any]                  # torch.cuda.Event after the copy; None on CPU
    errors: dict[int, str] = field(default_factory=dict)  # sampling row -> error (custom processors)
    hidden: Optional[torch.Tensor] = None  # [S, H] final-normed states of the sampling rows, if asked


class ModelRunner:
    """Runs forward passes for scheduled batches and samples the next tokens."""

    def __init__(self, cfg: EngineConfig, device: torch.device) -> None:
        from nbgen.models.loader import load_model
        from nbgen.runtime.sampler import Sampler

        self.cfg = cfg
        self.device = device
        self.on_gpu = device.type == "cuda"
        t0 = time.perf_counter()
        self.loaded = load_model(cfg, device)
        t1 = time.perf_counter()
        self.model = self.loaded.model
        self.hf_config = self.loaded.hf_config
        self.vocab_size = int(self.hf_config.vocab_size)
        self.num_pages = self._num_pages()
        layers, hq, hkv, hd = _model_dims(self.hf_config)
        self.kv_spec = KVCacheSpec(layers, self.num_pages, cfg.page_size, hq, hkv, hd,
                                   self.loaded.dtype, device)
        self.backend = self._make_backend()
        from nbgen.models import norm_fold   # two norm launches a layer fewer (before graph capture)

        self.norms_folded = norm_fold.should_fold(self.model, device) and norm_fold.fold_norms(self.model)
        self.sampler = Sampler(self.vocab_size, device)
        t2 = time.perf_counter()
        self._last_tokens: Optional[torch.Tensor] = None  # ids sampled by the latest launch (GPU)
        self._forwards = 0                                # forward passes queued so far
        self.graphs = None
        self.cuda_graph_batch_sizes: list[int] = []
        if self.on_gpu and self.backend_name == "flashinfer" and not cfg.disable_cuda_graph:
            from nbgen.runtime.cuda_graphs import CudaGraphRunner

            max_bs = cfg.cuda_graph_max_bs or default_max_bs(device)
            self.graphs = CudaGraphRunner(self.model, self.backend, max_bs, self.loaded.context_length)
            self.cuda_graph_batch_sizes = list(self.graphs.batch_sizes)
        t3 = time.perf_counter()
        self.prefill_graphs = self._make_prefill_graphs()
        self.piecewise_cuda_graph_tokens = list(self.prefill_graphs.buckets) if self.prefill_graphs else []
        t4 = time.perf_counter()
        self._warm_logits()
        # start-up phases in seconds (get_server_info()["startup_s"]): where a slow start goes
        self.startup_s = {"load_model": round(t1 - t0, 2), "kv_cache": round(t2 - t1, 2),
                          "cuda_graphs": round(t3 - t2, 2), "prefill_graphs": round(t4 - t3, 2),
                          "warm_logits": round(time.perf_counter() - t4, 2)}
        # overlap scheduling needs asynchronous device work; CPU steps are synchronous anyway
        self.overlap = self.on_gpu and not cfg.disable_overlap_schedule

    def _make_prefill_graphs(self) -> Optional[Any]:
        """Piecewise graphs for steps with prefill chunks (with the decode graphs; None when off, or
        when the model or memory does not allow them: then those steps run eagerly)."""
        cfg = self.cfg
        if self.graphs is None or cfg.disable_piecewise_cuda_graph:
            return None
        from nbgen.runtime import prefill_graphs as pg

        if not pg.supported(self.model):
            return None
        budget = cfg.chunked_prefill_size or pg.DEFAULT_MAX_TOKENS
        max_tokens = cfg.piecewise_cuda_graph_max_tokens or min(budget, pg.DEFAULT_MAX_TOKENS)
        try:
            return pg.PrefillGraphRunner(self.model, self.backend, max_tokens)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            logger.warning("piecewise prefill graphs unavailable (%s); prefill steps run eagerly", e)
            torch.cuda.empty_cache()
            return None

    @torch.inference_mode()
    def _warm_logits(self) -> None:
        """Run the LM head and the greedy argmax once at every graph batch size (CUDA).

        Logits are computed outside the decode graphs, over rows padded to a graph batch size. The first
        call at a row count picks cuBLAS's kernel on the host (~4 ms for the LM head on an H100) or, at
        1-16 rows, loads or compiles a Triton variant of the streaming matmul (0.63 s measured at one
        row); a shrinking decode batch meets every size once, so the first big generate paid that in
        the middle of its run (W-nano: 8.0 s first vs 7.35 s later runs on the same engine)."""
        if self.graphs is None:
            return
        from nbgen.runtime.sampler import _argmax   # the sampler's greedy path, not a copy of it

        H = self.hf_config.hidden_size
        for bs in self.cuda_graph_batch_sizes:
            hidden = torch.zeros(bs, H, dtype=self.loaded.dtype, device=self.device)
            _argmax(self.model.compute_logits(hidden))
        torch.cuda.synchronize(self.device)

    # ---- sizing -------------------------------------------------------------------------------
    def _bytes_per_page(self) -> int:
        layers, _, hkv, hd = _model_dims(self.hf_config)
        item = torch.empty((), dtype=self.loaded.dtype).element_size()
        return 2 * layers * self.cfg.page_size * hkv * hd * item

    def _num_pages(self) -> int:
        P = self.cfg.page_size
        if self.cfg.max_total_tokens is not None:
            return max(2, -(-self.cfg.max_total_tokens // P) + 1)  # +1: page 0 is the scratch page
        if self.on_gpu:
            # weights are resident now; KV gets mem_fraction_static of the card minus what is in use,
            # minus a reserve for the attention workspace and the decode graphs (captured after the
            # KV pool exists, since they bake its addresses in); the rest is for activations.
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.cfg.mem_fraction_static - used - GPU_RESERVE_BYTES
            if budget <= 0:
                raise RuntimeError(f"no GPU memory left for the KV cache (mem_fraction_static="
                                   f"{self.cfg.mem_fraction_static}, {used / 2**30:.1f} GiB in use)")
            # never more KV than the engine can use: every running request at the full context
            # (keeps a tiny model from taking the card, so several engines share one GPU)
            useful = (self.cfg.max_running_requests or 256) * int(self.loaded.context_length)
            return max(2, min(int(budget // self._bytes_per_page()), -(-useful // P) + 1))
        return -(-CPU_DEFAULT_TOTAL_TOKENS // P) + 1

    def _make_backend(self) -> AttentionBackend:
        # flashinfer's kernels are half-precision only: fp32 on a GPU (parity runs) uses the torch backend
        half = self.loaded.dtype in (torch.bfloat16, torch.float16)
        name = self.cfg.attention_backend or ("flashinfer" if self.on_gpu and half else "torch")
        if name == "flashinfer" and not half:
            raise ValueError(f"attention_backend='flashinfer' needs dtype bfloat16 or float16, got {self.loaded.dtype}")
        if name == "flashinfer":
            try:
                from nbgen.attention.flashinfer_backend import FlashInferBackend
                backend = FlashInferBackend(self.kv_spec)
            except ImportError as e:
                if self.cfg.attention_backend == "flashinfer":
                    raise
                logger.warning("flashinfer unavailable (%s); using the torch attention backend", e)
            else:
                from nbgen.kernels.gpu_ops import enable_fused

                enable_fused(True)
                self.backend_name = "flashinfer"
                return backend
        from nbgen.attention.torch_backend import TorchAttentionBackend

        if self.on_gpu:
            from nbgen.kernels.gpu_ops import enable_fused

            enable_fused(False)
        self.backend_name = "torch"
        return TorchAttentionBackend(self.kv_spec)

    @property
    def attention_backend_name(self) -> str:
        return type(self.backend).__name__

    # ---- inputs -------------------------------------------------------------------------------
    def _to_dev(self, values: list[int]) -> torch.Tensor:
        t = torch.from_numpy(np.asarray(values, dtype=np.int64))     # ~3x faster than torch.tensor(list)
        return t.pin_memory().to(self.device, non_blocking=True) if self.on_gpu else t

    def _placeholder_patch(self, ids: list[int]) -> Any:
        """A function filling placeholder ids (< 0) from the previous launch's GPU tokens, or None."""
        rows = [i for i, t in enumerate(ids) if t < 0]
        if not rows:
            return None
        assert self._last_tokens is not None, "placeholder token without a previous launch"
        src = [-ids[i] - 1 for i in rows]
        rows_t, src_t = self._to_dev(rows), self._to_dev(src)
        for i in rows:
            ids[i] = 0
        prev = self._last_tokens

        def patch(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, rows_t, prev.index_select(0, src_t))
        return patch

    @staticmethod
    def _flatten(batch: ScheduledBatch) -> tuple[list[int], list[int], list[int], list[SeqWork], list[int]]:
        """Flat token ids and positions of the step, the row of each sampling seq's last token,
        the sampling seqs, and the first row of every seq."""
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        seqs: list[SeqWork] = []
        starts: list[int] = []
        for s in batch.seqs:
            starts.append(len(ids))
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.kv_len))
            if s.sample:
                rows.append(len(ids) - 1)
                seqs.append(s)
        return ids, pos, rows, seqs, starts

    def _forward(self, batch: ScheduledBatch, ids: list[int], pos: list[int]) -> torch.Tensor:
        """Hidden states [T, H] of the batch's tokens (graph replay for decode-only steps)."""
        if self._graphable(batch):
            return self.graphs.run(batch, ids, self._last_tokens)   # placeholders resolved in the graph
        patch = self._placeholder_patch(ids)
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch, len(ids)):
            return self.prefill_graphs.run(batch, ids, pos, patch)
        input_ids = self._to_dev(ids)
        if patch is not None:
            patch(input_ids)
        positions = self._to_dev(pos)
        meta = self.backend.prepare(batch)
        return self.model(input_ids, positions, meta)

    # ---- one step -----------------------------------------------------------------------------
    def _graphable(self, batch: ScheduledBatch, n_prev: Optional[int] = None) -> bool:
        if n_prev is None:
            n_prev = self._last_tokens.numel() if self._last_tokens is not None else 0
        return self.graphs is not None and self.graphs.can_run(batch, n_prev)

    @torch.inference_mode()
    def prepare(self, batch: ScheduledBatch, n_prev: int) -> Optional[Any]:
        """Queue a decode-only batch's inputs and attention plan ahead of its forward (graph path;
        None otherwise). ``n_prev``: sampled ids of the step before it, which may still be queued."""
        if not self._graphable(batch, n_prev):
            return None
        return self.graphs.stage(batch, [s.token_ids[0] for s in batch.seqs])

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, staged: Optional[Any] = None) -> Forwarded:
        """Queue the forward pass and the logits of the sampling rows (nothing is sampled yet).
        ``staged``: this batch's ``prepare`` result (made before the previous step was sampled)."""
        fwd = self._queue_forward(batch, staged)
        self._forwards += 1
        fwd.order = self._forwards
        return fwd

    def _queue_forward(self, batch: ScheduledBatch, staged: Optional[Any]) -> Forwarded:
        if staged is not None or self._graphable(batch):
            # decode-only graph replay: one token per seq, positions and slots come from the page tables
            seqs = [s for s in batch.seqs if s.sample]
            if staged is None:
                staged = self.graphs.stage(batch, [s.token_ids[0] for s in batch.seqs])
            hidden = self.graphs.replay(staged, self._last_tokens)
            rows = [i for i, s in enumerate(batch.seqs) if s.sample] if len(seqs) != len(batch.seqs) else []
            if not rows and seqs:             # logits over the graph's padded rows, see _logits
                return Forwarded(batch, seqs, self._logits(self.graphs.padded_output(staged), len(seqs)), hidden)
        else:
            ids, pos, rows, seqs, _ = self._flatten(batch)
            hidden = self._forward(batch, ids, pos)
        if not seqs:
            return Forwarded(batch, seqs, None, None)
        n = len(seqs)
        if self.on_gpu and padded_batch_size(n) != hidden.shape[0]:
            if not rows:
                rows = list(range(n))
            full = hidden.index_select(0, self._to_dev(rows + [rows[-1]] * (padded_batch_size(n) - n)))
            return Forwarded(batch, seqs, self._logits(full, n), full[:n])
        if n != hidden.shape[0]:
            hidden = hidden.index_select(0, self._to_dev(rows))
        return Forwarded(batch, seqs, self._logits(hidden, n), hidden)

    def _logits(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        """Logits [n, vocab] of the first n rows of ``hidden``, whose row count on CUDA is a graph batch
        size (``padded_batch_size``): cuBLAS chooses its kernel on the host the first time it sees a row
        count, ~4 ms on an H100 for the LM head, and a decode batch shrinks through every count as its
        requests finish (W-nano paid it ~256 times); padded, at most one per graph batch size."""
        return self.model.compute_logits(hidden)[:n]

    @torch.inference_mode()
    def sample(self, fwd: Forwarded, fill: Optional[Any] = None) -> Launched:
        """Queue the sampling of a forwarded step; the sampled ids stay on the device.

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
            res = self.sampler(fwd.logits, seqs, fill=fill, greedy_out=out)
        finally:
            if fill is not None:
                fill.settle()
        tokens = self._last_tokens = res.token_ids
        # clone: under CUDA graphs `hidden` views the graph output buffer, which the next replay overwrites
        keep = fwd.hidden.clone() if any(s.req.return_hidden_states for s in seqs) else None
        if not self.on_gpu:
            return Launched(batch, tokens, tokens, None, res.errors, keep)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return Launched(batch, tokens, host, ev, res.errors, keep)

    def launch(self, batch: ScheduledBatch) -> Launched:
        """Queue forward + sampling (no logprobs); the sampled ids stay on the device."""
        return self.sample(self.forward(batch))

    @staticmethod
    def resolve(launched: Launched) -> list[int]:
        """Wait for a launched step; its sampled id per seq (-1 where seq.sample is False)."""
        if launched.event is not None:
            launched.event.synchronize()
        toks = launched.host.tolist() if launched.host is not None else []
        it = iter(toks)
        return [next(it) if s.sample else -1 for s in launched.batch.seqs]

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> StepOutput:
        """Forward the batch's tokens, sample where asked, gather logprobs."""
        if not any(wants_logprobs(s) for s in batch.seqs):
            launched = self.launch(batch)
            out = self.resolve(launched)
            n = len(batch.seqs)
            errors, hs = per_seq(batch, launched.errors, launched.hidden)
            return StepOutput(next_token_ids=out, output_logprobs=[None] * n,
                              prompt_logprobs=[None] * n, errors=errors, hidden_states=hs)
        return step_with_logprobs(self, batch)
