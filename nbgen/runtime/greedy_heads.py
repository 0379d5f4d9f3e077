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
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from nbgen.kernels import gpu_argmax


class GreedyHeads:
    """Captured head graphs per (decode graph batch size, shared-prefix or plain); ``run`` replays one."""

    def __init__(self, outputs: dict[bool, dict[int, torch.Tensor]], prev: torch.Tensor,
                 logits: Callable[[torch.Tensor], torch.Tensor], vocab: int, pool: Any, stream: torch.cuda.Stream) -> None:
        """``outputs``: the decode graphs' output rows [bs, H] per batch size, keyed by shared-prefix or not;
        ``prev``: the buffer the ids go to; ``logits``: the model's LM head; ``vocab``: the columns argmaxed."""
        self.ws = gpu_argmax.ArgmaxWorkspace()
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        sizes = sorted({bs for per in outputs.values() for bs in per}, reverse=True)
        for bs in sizes:                                  # the largest first: the workspace sized once
            for cascade, per in outputs.items():
                if bs not in per:
                    continue
                hidden, out = per[bs], prev[:bs]

                def head(hidden: torch.Tensor = hidden, out: torch.Tensor = out) -> None:
                    gpu_argmax.argmax(logits(hidden)[:, :vocab], self.ws, out)
                with torch.inference_mode():
                    head()                                # cuBLAS / Triton choices, the workspace
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        head()
                self.graphs[bs, cascade] = g

    def run(self, bs: int, cascade: bool) -> None:
        """Replay the head of the decode graph a step just replayed (its ids land in ``prev[:bs]``)."""
        self.graphs[bs, cascade].replay()

    def reset(self) -> None:
        """Free the graphs now (with the decode graphs they read)."""
        for g in self.graphs.values():
            g.reset()
