"""Tensor parallelism's step protocol: rank 0 (the loop thread) runs the model as at tp_size=1 and
each forward, decode-graph replay and logits call is mirrored on the worker ranks.

Rank 0 wraps its runner's backend, model and decode graphs (``mirror_runner``); each wrapped call
first sends a small command to every worker (``TPCommand``: the step's page tables and token ids,
no requests), then runs locally. Workers (``runtime/tp_worker.py``) execute the same call on their
shard (``execute``), so the collectives inside the model (one all-reduce per attention and per MLP
block, the LM head's all-gather) meet in the same order on every rank. Sampling happens on rank 0
only: the sampler's state (penalties, grammars, custom processors, seeds) lives with the requests,
the logits are the same on every rank after the all-gather, and the sampled ids reach the workers
as the next step's input ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from nbgen.core.batch import ScheduledBatch, SeqWork


@dataclass
class LiteRequest:
    """What page tables read of a request: its id and prompt length (``prompt_ids`` is a range)."""

    rid: str
    prompt_ids: range


@dataclass
class TPCommand:
    """One mirrored call. kind: "forward" (batch, ids, positions), "graph" (batch, ids: a decode
    graph replay), "logits" (rows, hidden size, dtype: hidden states follow by broadcast), "stop"."""

    kind: str
    batch: Optional[ScheduledBatch] = None
    ids: Optional[list[int]] = None
    positions: Optional[list[int]] = None
    rows: int = 0
    hidden: int = 0
    dtype: Optional[torch.dtype] = None


def lite_batch(batch: ScheduledBatch) -> ScheduledBatch:
    """The batch without its requests (what the attention backends and graph tables read)."""
    seqs = [SeqWork(LiteRequest(s.req.rid, range(len(s.req.prompt_ids))), s.token_ids,  # type: ignore[arg-type]
                    s.start_pos, s.pages, s.sample) for s in batch.seqs]
    return ScheduledBatch(seqs, batch.page_size)


class _Delegate:
    """Forwards every attribute it does not define to the wrapped object. ``local`` runs rank 0's
    half of a mirrored call: if it fails, the workers may wait in a collective rank 0 never reaches,
    so the group is given up (``broken``) rather than letting the next step's collectives pair
    with the stale ones."""

    def __init__(self, inner: Any, send: Callable[[TPCommand], None], broken: Callable[[], None]) -> None:
        self.inner = inner
        self.send = send
        self.broken = broken

    def local(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except BaseException:
            self.broken()
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class MirroredBackend(_Delegate):
    """Rank 0's attention backend: ``prepare`` remembers the step's batch for the model's command."""

    last: Optional[ScheduledBatch] = None

    def prepare(self, batch: ScheduledBatch) -> Any:
        self.last = lite_batch(batch)
        return self.inner.prepare(batch)


class MirroredModel(_Delegate):
    """Rank 0's model: the forward pass and the logits are mirrored on the workers."""

    def __init__(self, inner: Any, send: Callable[[TPCommand], None], broken: Callable[[], None],
                 backend: MirroredBackend) -> None:
        super().__init__(inner, send, broken)
        self.backend = backend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        assert self.backend.last is not None, "a forward pass without a prepared batch"
        self.send(TPCommand("forward", self.backend.last, input_ids.tolist(), positions.tolist()))
        self.backend.last = None
        return self.local(self.inner, input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (the same on every rank after the all-reduces) goes to the workers so that
        each computes its vocabulary shard; the all-gather joins them."""
        hidden = hidden.contiguous()
        self.send(TPCommand("logits", rows=hidden.shape[0], hidden=hidden.shape[1], dtype=hidden.dtype))
        return self.local(self._logits, hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        dist.broadcast(hidden, src=0)
        return self.inner.compute_logits(hidden)


class MirroredGraphs(_Delegate):
    """Rank 0's decode graphs: staging a step makes the workers stage and replay theirs (their
    all-reduces wait inside the graph for rank 0's replay)."""

    def stage(self, batch: ScheduledBatch, ids: list[int]) -> Any:
        self.send(TPCommand("graph", lite_batch(batch), list(ids)))
        return self.local(self.inner.stage, batch, ids)

    def replay(self, staged: Any, prev: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.local(self.inner.replay, staged, prev)

    def run(self, batch: ScheduledBatch, ids: list[int], prev: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.replay(self.stage(batch, ids), prev)


def mirror_runner(runner: Any, send: Callable[[TPCommand], None], broken: Callable[[], None]) -> None:
    """Wrap rank 0's runner (after setup) so that its model calls are mirrored on the workers;
    ``broken()`` gives the group up after a failed call."""
    backend = MirroredBackend(runner.backend, send, broken)
    runner.backend = backend
    runner.model = MirroredModel(runner.model, send, broken, backend)
    if runner.graphs is not None:
        runner.graphs = MirroredGraphs(runner.graphs, send, broken)


@torch.inference_mode()
def execute(cmd: TPCommand, model: torch.nn.Module, backend: Any, graphs: Any, device: torch.device) -> None:
    """A worker's share of one mirrored call (its outputs are dropped: rank 0 has the same)."""
    if cmd.kind == "forward":
        meta = backend.prepare(cmd.batch)
        ids = torch.tensor(cmd.ids, dtype=torch.long, device=device)
        pos = torch.tensor(cmd.positions, dtype=torch.long, device=device)
        model(ids, pos, meta)
    elif cmd.kind == "graph":
        graphs.run(cmd.batch, cmd.ids)
    elif cmd.kind == "logits":
        hidden = torch.empty(cmd.rows, cmd.hidden, dtype=cmd.dtype, device=device)
        dist.broadcast(hidden, src=0)
        model.compute_logits(hidden)
    else:
        raise ValueError(f"unknown tensor-parallel command {cmd.kind!r}")
