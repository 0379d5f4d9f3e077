"""Piecewise CUDA graphs for steps with prefill chunks (flashinfer backend).

An eager prefill step of a small model is bound by the host: launching 28 layers' kernels one by one
takes Qwen3-0.6B ~25 ms at 8k tokens, while the GPU runs them in 16-27 ms. Attention cannot sit in a
graph (its plan changes with every step's sequences), so such a step runs as graph pieces around one
eager attention call per layer:

    piece 0       embedding; layer 0 up to attention (norm, qkv, q/k norm + RoPE + K/V write)
    attention 0   eager: flashinfer's prefill kernel over the planned sequences
    piece i       layer i-1 after attention (o_proj, add+RMSNorm, MLP); layer i up to attention
    piece L       layer L-1 after attention; the final norm

captured at a few token counts (``token_buckets``). A step of T tokens replays the smallest bucket
>= T; rows T.. are padding (token 0 at position 0, its K/V into slot 0 of the scratch page), and
attention runs over the T real rows only. Every tensor that crosses from one piece to the next is a
static buffer made before capture: the inputs, the residual stream (the fused add+RMSNorm updates it
in place), q|k|v (the qkv projection writes into it), the attention output and the final hidden
states. The pieces' private memory pool therefore holds only temporaries, shared by all buckets.

The leading one-token rows of a mixed step (the running decodes) are attended inside the pieces: each
piece i < L ends with nbgen's Triton decode kernel over layer i's decode rows (runtime/mixed_decode.py),
and the eager call runs the prefill of the chunks only. Over e4m3 pages the chunks' Triton attention is
captured there too, after the decode rows' (runtime/mixed_chunks.py): a step whose tables fit then has no
eager attention call. For such steps each bucket also holds its pieces captured as ONE graph (``whole``):
one launch a step instead of one a layer, and no gap on the GPU between pieces.

A ``GraphVariant`` (LoRA: the adapters' kernels reading the slot pool's static row layout) adds a
second set of pieces per bucket, captured with its context active into the same pool; a step replays
them when the variant says the batch needs it (the caller staged its rows), else the plain pieces.
"""
from __future__ import annotations

import logging
import time
from array import array
from typing import Callable, Optional

import numpy as np
import torch

from nbgen.attention.flashinfer_backend import FlashInferBackend, FlashInferMetadata
from nbgen.core.batch import ScheduledBatch
from nbgen.kernels.triton_precompile import Precompile
from nbgen.runtime.cuda_graphs import GraphVariant
from nbgen.kernels.host_staging import StagingRing
from nbgen.runtime.mixed_chunks import MixedChunkRows
from nbgen.runtime.mixed_decode import MixedDecodeRows
from nbgen.runtime.step_inputs import positions_into

logger = logging.getLogger("nbgen")

# the largest default bucket: above it a step's GPU time outgrows its host time even for small models
DEFAULT_MAX_TOKENS = 8192


def token_buckets(max_tokens: int) -> list[int]:
    """32, 64, 128, 256, 384, 512, 768, then steps of 256 up to 1 536, of 512 up to 4 096, of 1 024
    beyond, and ``max_tokens`` itself. Padding costs GPU time in proportion (at most 1/3 at the
    small end, where a step is cheap; at most 1/8 above 4k); each bucket is L + 1 graphs."""
    cands = [32, 64, 128, 256, 384, 512, 768] + list(range(1024, 1537, 256)) + \
        list(range(2048, 4097, 512)) + list(range(5120, max_tokens + 1, 1024))
    sizes = [b for b in cands if b < max_tokens]
    return sizes + [max_tokens]


def bucket_for(buckets: list[int], n: int) -> int:
    """The token count a step of ``n`` tokens pads to: the smallest bucket that holds it (``n`` itself
    above the largest bucket, where the step runs eagerly)."""
    return next((b for b in buckets if b >= n), n)


def supported(model: torch.nn.Module) -> bool:
    """A model built from the Llama blocks (``model.layers`` with pre_attention / post_attention)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return bool(layers) and all(hasattr(m, "pre_attention") and hasattr(m, "post_attention") for m in layers) \
        and hasattr(inner, "embed_tokens") and hasattr(inner, "final_norm")


class PrefillGraphRunner:
    """Captures the pieces at every bucket; ``run`` returns the step's hidden states [T, H]."""

    def __init__(self, model: torch.nn.Module, backend: FlashInferBackend, max_tokens: int, max_context: int,
                 variant: Optional[GraphVariant] = None, precompile: Optional[Precompile] = None) -> None:
        if not supported(model):
            raise ValueError(f"{type(model).__name__} does not expose pre_attention / post_attention")
        inner = model.model
        self.inner = inner          # EAGLE3 reads ``captured`` from it (``run`` fills it)
        self.backend = backend
        self.embed, self.layers, self.final_norm = inner.embed_tokens, list(inner.layers), inner.final_norm
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        attn = self.layers[0].self_attn
        self.split = [attn.q_size, attn.kv_size, attn.kv_size]
        w = self.embed.weight
        dev, dt, T = w.device, w.dtype, self.max_tokens
        # static buffers (flat io so that a bucket's [3, T] view is one contiguous H2D copy):
        # io rows: token ids, positions, KV slots
        self.io = torch.zeros(3 * T, dtype=torch.long, device=dev)
        self.residual = torch.zeros(T, w.shape[1], dtype=dt, device=dev)
        self.qkv = torch.zeros(T, sum(self.split), dtype=dt, device=dev)
        self.attn = torch.zeros(T, attn.q_size, dtype=dt, device=dev)
        self.hidden = torch.zeros(T, w.shape[1], dtype=dt, device=dev)
        self._ring = StagingRing(lambda: [torch.zeros(3 * T, dtype=torch.long)])
        self.kv_written = True
        # the leading decode rows' attention inside the pieces (runtime/mixed_decode.py)
        self.decodes = MixedDecodeRows(backend, self.max_tokens, max_context) if backend.triton_decode else None
        # ... and the chunks' (e4m3 pages: runtime/mixed_chunks.py)
        self.chunks = MixedChunkRows(backend, self.max_tokens, max_context) \
            if self.decodes is not None and backend.prefill.extend is not None else None
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.variant = variant
        self.variant_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.variant_replays = 0       # steps that replayed the variant's pieces (tests, stats)
        # bucket -> all its pieces as one graph, for steps the pieces attend whole (chunks staged)
        self.whole: dict[int, torch.cuda.CUDAGraph] = {}
        self.whole_replays = 0         # steps that replayed it (tests, stats)
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(dev)[0]
        stream = torch.cuda.Stream(dev)
        order = list(reversed(self.buckets))
        whole = self._whole_buckets()
        with torch.inference_mode():
            # the pieces dry-run first: their Triton variants compile in worker processes meanwhile, each
            # bucket's capture waits for those its dry run met (kernels/triton_precompile.py)
            marks = precompile.record([lambda T=T: self._dry_run(T) for T in order]) if precompile else order
            for i, bs in enumerate(order):
                if precompile is not None:
                    precompile.wait(marks[i])
                self.graphs[bs] = self._capture(bs, stream)
                if bs in whole and self.kv_written:     # else no step is attended whole
                    self.whole[bs] = self._capture(bs, stream, whole=True)[0]
                if variant is not None:
                    with variant.capturing():
                        self.variant_graphs[bs] = self._capture(bs, stream)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()            # the warm-up runs' eager temporaries
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = free0 - torch.cuda.mem_get_info(dev)[0]
        logger.info("captured piecewise prefill graphs at %d token counts (%s)%s in %.1f s, %.0f MiB",
                    len(self.buckets), self.buckets, " with a variant" if variant is not None else "",
                    self.capture_seconds, self.memory_bytes / 2**20)

    # ---- capture ----------------------------------------------------------------------------------
    def _whole_buckets(self) -> set[int]:
        """Buckets a step the pieces attend whole can land in: its decode rows (at most the decode kernel's
        rows) and chunk tokens (at most the chunk attention's) may pass the bucket below."""
        if self.chunks is None or self.decodes is None:
            return set()
        most = self.decodes.max_rows + self.chunks.max_chunk_tokens
        return {T for T, below in zip(self.buckets, [0, *self.buckets]) if below < most}

    def _piece(self, i: int, T: int, meta: FlashInferMetadata) -> Callable[[], Optional[tuple]]:
        """Piece i at bucket T: reads and writes static buffers only."""
        io = self.io[: 3 * T].view(3, T)
        res, qkv, attn = self.residual[:T], self.qkv[:T], self.attn[:T]
        L = len(self.layers)

        def run() -> Optional[tuple]:
            if i == 0:
                res.copy_(self.embed(io[0]))
                x, r = res, None
            else:
                x, r = self.layers[i - 1].post_attention(attn, res)
            if i < L:
                (q, _k, _v, written), r = self.layers[i].pre_attention(io[1], x, r, meta, qkv_out=qkv)
                if self.decodes is not None and self.kv_written:   # decode rows' attention, over the staged tables
                    # (their K/V written above by the fused RoPE kernel; else the eager call writes it first)
                    B = self.decodes.rows(T)
                    self.decodes.attend(self.layers[i].self_attn.attn.layer_id, q[:B], attn[:B])
                    if self.chunks is not None:     # then the chunk rows', over theirs
                        self.chunks.attend(self.layers[i].self_attn.attn.layer_id, T, q, attn)
                return q, written, r
            self.hidden[:T].copy_(self.final_norm(x, r))
            return None
        return run

    def _check(self, out: Optional[tuple]) -> None:
        """The warm-up run of a piece kept its crossing tensors in the static buffers."""
        if out is None:
            return
        q, written, r = out
        if q.data_ptr() != self.qkv.data_ptr() or r.data_ptr() != self.residual.data_ptr():
            raise RuntimeError("piecewise prefill graphs need q/k/v and the residual in place "
                               "(fused RoPE and fused add+RMSNorm)")
        self.kv_written = bool(written)

    def _dry_run(self, T: int) -> None:
        """Bucket T's pieces run once, the variant's too (the precompile's dry run)."""
        meta = FlashInferMetadata(self.backend, self.io[2 * T: 3 * T], None)
        for i in range(len(self.layers) + 1):
            self._piece(i, T, meta)()
        if self.variant is not None:
            with self.variant.capturing():
                for i in range(len(self.layers) + 1):
                    self._piece(i, T, meta)()

    def _capture(self, T: int, stream: torch.cuda.Stream, whole: bool = False) -> list[torch.cuda.CUDAGraph]:
        """Bucket T's pieces, a graph each; ``whole``: one graph of all of them (a step with no eager call)."""
        io = self.io[: 3 * T].view(3, T)
        meta = FlashInferMetadata(self.backend, io[2], None)   # slots: 0 (scratch) while capturing
        pieces = [self._piece(i, T, meta) for i in range(len(self.layers) + 1)]
        if not whole:
            for p in pieces:        # warm-up: cuBLAS kernel choice, Triton loads, lazy allocations
                self._check(p())
        stream.wait_stream(torch.cuda.current_stream())
        graphs = []
        with torch.cuda.stream(stream):
            for part in ([pieces] if whole else [[p] for p in pieces]):
                # capture_begin rather than torch.cuda.graph(): that one runs gc.collect() and
                # empty_cache() per graph, seconds over the ~500 graphs of a model's buckets
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=self.pool)
                try:
                    for p in part:
                        p()
                finally:
                    g.capture_end()
                graphs.append(g)
        torch.cuda.current_stream().wait_stream(stream)
        return graphs

    # ---- replay -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Free every captured piece now (plain and variant), whoever still holds this runner; call only
        once the device finished with them."""
        for table in (self.graphs, self.variant_graphs):
            for pieces in table.values():
                for g in pieces:
                    g.reset()
        for g in self.whole.values():
            g.reset()

    def can_run(self, batch: ScheduledBatch, num_tokens: int) -> bool:
        """A step with a prefill chunk whose tokens fit the largest bucket."""
        return not batch.is_decode_only and 0 < num_tokens <= self.max_tokens

    def run(self, batch: ScheduledBatch, ids: list[int],
            patch: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        """Hidden states [n, H] of the step's n tokens (a view of the static output buffer, valid
        until the next step's replay); ``ids``: the step's flat token ids. ``patch`` fills
        placeholder ids on the GPU. The variant's pieces replay when it wants the batch (its inputs
        staged by the caller before)."""
        n = len(ids)
        T = bucket_for(self.buckets, n)
        st, npv = self._ring.next()
        host = npv[0][: 3 * T].reshape(3, T)
        host[0, :n] = np.frombuffer(array("q", ids), dtype=np.int64)   # ~1.5x numpy's list conversion
        positions_into(batch, host[1])                   # numpy straight into the staging buffer
        self.backend.slot_mapping_into(batch, host[2])
        host[:, n:] = 0
        io = self.io[: 3 * T].view(3, T)
        self.io[: 3 * T].copy_(st[0][: 3 * T], non_blocking=True)
        self._ring.done()
        if patch is not None:
            patch(io[0, :n])
        dec = self.decodes if self.kv_written else None
        stage = None if dec is None else (lambda ip, idx, last: dec.stage(T, ip, idx, last))
        chunks = self.chunks if self.kv_written else None
        cstage = None if chunks is None else (lambda d, qo, kp, idx, last: chunks.stage(T, d, qo, kp, idx, last))
        meta = self.backend.prepare(batch, slot_mapping=io[2, :n], decode_stage=stage, chunk_stage=cstage)
        if dec is not None and not meta.decodes_staged:
            dec.idle()                 # the captured decode kernel reads scratch rows of this bucket only
        if chunks is not None and not meta.chunks_staged:
            chunks.idle()              # the captured chunk kernel stores nothing over the eager call's rows
        cap = self.inner.capture_layers
        if self.variant is not None and self.variant.wanted(batch):
            graphs = self.variant_graphs[T]
            self.variant_replays += 1
        elif meta.chunks_staged and not cap and T in self.whole:
            self.whole[T].replay()         # the pieces attend the whole step: no eager call between them
            self.whole_replays += 1
            return self.hidden[:n]
        else:
            graphs = self.graphs[T]
        q, k, v = self.qkv[:n].split(self.split, dim=-1)
        attn = self.attn[:n]
        got: list[torch.Tensor] = []
        graphs[0].replay()
        for i, (layer, g) in enumerate(zip(self.layers, graphs[1:])):
            if i in cap:     # piece i left the stream at layer i's input in the residual buffer
                got.extend([self.residual[:n].clone()] * cap.count(i))
            if not meta.chunks_staged:         # else the pieces attended the whole step
                layer.self_attn.attn(q, k, v, meta, kv_written=self.kv_written, out=attn)
            g.replay()
        if cap:
            self.inner.captured = got          # as an eager forward leaves it (EAGLE3's features)
        return self.hidden[:n]
