"""Greedy heads: the LM head and the argmax of an all-greedy decode step replayed as one CUDA graph.

A decode step whose rows all take the argmax of their raw logits (``sampler_rows.raw_kind``: no
processing, mask, logprobs or draw) needs nothing from its logits but those ids. For each decode graph
(per batch size, plain and shared-prefix) a second small graph reads that graph's output rows, runs
the model's ``compute_logits`` and nbgen's argmax kernel over the vocabulary, and writes the ids into
the decode graphs' ``prev`` buffer, where the greedy sampler writes them anyway and the next step's
placeholders read them. One replay instead of the LM head's and the argmax's launches from Python:
the same kernels on the same rows (the logits over the graph's padded rows, as eager steps compute
them), so the same ids. The graphs share the decode graphs' memory pool; the argmax has a workspace
of its own (the shared one may be reallocated by a larger eager step).

Masked heads: a decode step whose rows all take the argmax of their grammar-masked logits (every row
constrained and greedy, ``grammar_batch.greedy_grammar``; a step with jump-forward's forced rows too, whose
sampling rows the staging put first: ``Staged.lead``, the ids of rows past them unread) replays the same head with the
argmax reading a token bitmask beside the logits (``gpu_argmax.masked_argmax``), one more graph per decode
graph. The bitmask is a static device buffer [max bs, ceil(vocab / 32)] int32 (``fill_worker.DeviceBitmask``):
the step's sampling queues the copy of its filled rows into it (``FillJob.into``, on a side stream the
current one waits for), then replays the masked head behind it (runner.sample). A row allowing nothing gets id 0 (its
grammar then refuses it: the request aborts), as the eager masked argmax gives.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from nbgen.kernels import gpu_argmax
from nbgen.runtime.fill_worker import DeviceBitmask


class GreedyHeads:
    """Captured head graphs per (decode graph batch size, shared-prefix or plain, masked or not); ``run`` /
    ``run_masked`` replay one."""

    def __init__(self, outputs: dict[bool, dict[int, torch.Tensor]], prev: torch.Tensor,
                 logits: Callable[[torch.Tensor], torch.Tensor], vocab: int, pool: Any, stream: torch.cuda.Stream) -> None:
        """``outputs``: the decode graphs' output rows [bs, H] per batch size, keyed by shared-prefix or not;
        ``prev``: the buffer the ids go to; ``logits``: the model's LM head; ``vocab``: the columns argmaxed."""
        self.ws = gpu_argmax.ArgmaxWorkspace()
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.masked: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        sizes = sorted({bs for per in outputs.values() for bs in per}, reverse=True)
        # allocated before the captures, outside their pool: the masked graphs read it at a fixed address
        self.bitmask = DeviceBitmask(sizes[0], vocab, prev.device)
        for bs in sizes:                                  # the largest first: the workspace sized once
            for cascade, per in outputs.items():
                if bs not in per:
                    continue
                hidden, out, bits = per[bs], prev[:bs], self.bitmask.words[:bs]

                def head(hidden: torch.Tensor = hidden, out: torch.Tensor = out) -> None:
                    gpu_argmax.argmax(logits(hidden)[:, :vocab], self.ws, out)

                def masked(hidden: torch.Tensor = hidden, out: torch.Tensor = out, bits: torch.Tensor = bits) -> None:
                    gpu_argmax.masked_argmax(logits(hidden)[:, :vocab], bits, self.ws, out)
                self.graphs[bs, cascade] = _capture(head, pool, stream)
                self.masked[bs, cascade] = _capture(masked, pool, stream)

    def run(self, bs: int, cascade: bool) -> None:
        """Replay the head of the decode graph a step just replayed (its ids land in ``prev[:bs]``)."""
        self.graphs[bs, cascade].replay()

    def run_masked(self, bs: int, cascade: bool) -> None:
        """Replay the masked head of the decode graph a step replayed, once the step's bitmask rows are in
        ``bitmask`` for the current stream (ids into ``prev[:bs]``; padding rows read stale rows)."""
        self.masked[bs, cascade].replay()

    def reset(self) -> None:
        """Free the graphs now (with the decode graphs they read)."""
        for g in [*self.graphs.values(), *self.masked.values()]:
            g.reset()


def _capture(fn: Callable[[], None], pool: Any, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """fn captured as a graph into ``pool`` on ``stream``, after one eager run (cuBLAS / Triton choices)."""
    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            fn()
    return g
