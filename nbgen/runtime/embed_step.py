"""The runner's step for embedding requests: prefill chunks in, pooling states and vectors out.

An embedding request is prefill only: its chunks run through the same forward as any prefill
(piecewise CUDA graphs where the runner uses them), nothing is sampled, and the chunk that reaches
the end of its prompt also returns the finished vector. Per pooling mode:

- ``last``: the final-normed state of the prompt's last token, read on the last chunk only (so a
  prefix served from the cache costs nothing);
- ``cls``: the first token's state, kept as the request's pooling state from the chunk at 0;
- ``mean``: a running fp32 sum over the chunks (the state), divided by the prompt length at the end.
``cls`` and ``mean`` requests never take cached prefix pages (``waiting.matchable_ids``): every
position's state is computed, and a preempted request restarts its sum at position 0.

``embed_step`` waits for the vectors; ``launch_embed`` leaves them on their way to the host (pinned,
non-blocking), so the overlap stepper schedules and launches the next step before reading them.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from nbgen.core.batch import ScheduledBatch, StepOutput
from nbgen.runtime.pooling import PendingVectors, pick_rows, segment_sums
from nbgen.runtime.step_inputs import FlatStep, flatten


class PoolRunner(Protocol):
    """What the embedding step needs of the ModelRunner."""

    def hidden_states(self, batch: ScheduledBatch, flat: FlatStep) -> torch.Tensor: ...

    def to_device(self, values: list[int]) -> torch.Tensor: ...


def is_embedding_batch(batch: ScheduledBatch) -> bool:
    """True when the batch holds embedding requests (an embedding engine runs nothing else)."""
    return bool(batch.seqs) and batch.seqs[0].req.embed is not None


def embed_step(runner: PoolRunner, batch: ScheduledBatch) -> StepOutput:
    """Forward the batch's prompt chunks and pool them, vectors on the host (see the module docstring)."""
    out, pending = launch_embed(runner, batch)
    out.embeddings = pending.lists()
    return out


def launch_embed(runner: PoolRunner, batch: ScheduledBatch) -> tuple[StepOutput, StepVectors]:
    """Queue the batch's forward and pooling; the finished vectors come with ``StepVectors.lists()``
    (the overlap stepper reads them after launching the next step)."""
    flat = flatten(batch)
    hidden = runner.hidden_states(batch, flat)                              # [T, H] final-normed
    n = len(batch.seqs)
    states: list[Optional[Any]] = [None] * n
    errors: dict[int, str] = {}
    pick_seq, pick_row = [], []          # seqs whose one row is taken: last (final chunk), cls (chunk at 0)
    mean_seq, owner = [], []             # mean: seqs of the step, and each of their rows' segment
    for i, s in enumerate(batch.seqs):
        e = s.req.embed
        if e is None:
            errors[i] = "a generation request in an embedding batch"
            continue
        if e.pooling == "last":
            if s.kv_len >= len(s.req.prompt_ids):
                pick_seq.append(i)
                pick_row.append(flat.starts[i] + s.q_len - 1)
        elif e.pooling == "cls":
            if s.start_pos == 0:
                pick_seq.append(i)
                pick_row.append(flat.starts[i])
            else:
                states[i] = s.req.pool_state
        else:
            owner.extend([len(mean_seq)] * s.q_len)
            mean_seq.append(i)
    rows = None
    if pick_seq:
        rows = pick_rows(hidden, runner.to_device(pick_row))                # [N, H] fp32
        for k, i in enumerate(pick_seq):
            states[i] = rows[k]
    if mean_seq:
        rows_t = runner.to_device([flat.starts[i] + j for i in mean_seq for j in range(batch.seqs[i].q_len)])
        sums = segment_sums(hidden.index_select(0, rows_t), runner.to_device(owner), len(mean_seq))
        for k, i in enumerate(mean_seq):
            s = batch.seqs[i]
            prev = s.req.pool_state if s.start_pos > 0 else None            # a recompute restarts at 0
            states[i] = sums[k] if prev is None else prev + sums[k]
    return (StepOutput(next_token_ids=[-1] * n, output_logprobs=[None] * n, prompt_logprobs=[None] * n,
                       errors=errors, pool_states=states),
            _finished(batch, states, rows if not mean_seq and len(pick_seq) == n else None))


class StepVectors:
    """The vectors a step finishes, per seq index (None for seqs whose prompt is not complete yet)."""

    def __init__(self, n: int, done: list[int], pending: Optional[PendingVectors]) -> None:
        self.n, self.done, self.pending = n, done, pending

    def lists(self) -> list[Optional[list[float]]]:
        out: list[Optional[list[float]]] = [None] * self.n
        if self.pending is not None:
            for i, v in zip(self.done, self.pending.lists()):
                out[i] = v
        return out


def _finished(batch: ScheduledBatch, states: list[Optional[Any]],
              picked: Optional[torch.Tensor] = None) -> StepVectors:
    """The vectors of the seqs whose chunk completes their prompt, on their way to the host.
    ``picked``: the step's picked rows [n, H] when every seq of the batch had its row picked (then
    they are the states in seq order, and the finished ones are all of them when all pool ``last``)."""
    done = [i for i, s in enumerate(batch.seqs)
            if s.req.embed is not None and states[i] is not None and s.kv_len >= len(s.req.prompt_ids)]
    if not done:
        return StepVectors(len(batch.seqs), [], None)
    embeds = [batch.seqs[i].req.embed for i in done]
    if picked is not None and len(done) == len(batch.seqs) and all(e.pooling == "last" for e in embeds):
        stacked = picked                       # one tensor already: no per-row views to stack
    else:
        vecs = []
        for i in done:
            s = batch.seqs[i]
            v = states[i]
            vecs.append(v / len(s.req.prompt_ids) if s.req.embed.pooling == "mean" else v)
        stacked = torch.stack(vecs)
    pending = PendingVectors(stacked, [e.dimensions for e in embeds], [e.normalize for e in embeds])
    return StepVectors(len(batch.seqs), done, pending)
