"""The handles of a step between the runner's calls under overlap scheduling: ``Forwarded`` (its forward
queued, not sampled), ``Launched`` (its ids sampled on the device, on their way to the host) and
``PreparedStep`` (a decode graph step's inputs queued ahead of its forward)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.runtime.decode_staging import Staged
from nbgen.runtime.logprobs import RowLogprobs


@dataclass
class Forwarded:
    """A step whose forward pass is queued: logits [S, V] of its S sampling rows, not sampled yet.

    A decode graph step may come without logits: ``tokens`` holds its ids already (a greedy head ran
    right behind its forward), or ``head`` names its graph (every row constrained and greedy): the LM
    head and the masked argmax then run at its sampling, once its bitmask is filled, over the graph's
    output rows. Such a step is sampled before the next forward is queued (the next replay would
    overwrite those rows; the overlap stepper does so).
    """

    batch: ScheduledBatch
    seqs: list[SeqWork]                   # the sampling seqs, in logits row order
    logits: Optional[torch.Tensor]
    order: int = 0                        # forwards queued before it, this one included
    tokens: Optional[torch.Tensor] = None  # [S] ids already sampled on the device (greedy heads: no logits)
    head: Optional[Staged] = None         # a greedy grammar graph step: its LM head runs at its sampling


@dataclass
class Launched:
    """A step whose GPU work is queued: sampled ids [S] on the GPU (and on their way to the host).

    ``host`` is a buffer of the runner's pinned ring (``step_inputs.IdsToHost``), handed out again only
    once ``read`` is set."""

    batch: ScheduledBatch
    tokens: Optional[torch.Tensor]        # [S] long on the device, S = number of sampling seqs
    host: Optional[torch.Tensor]          # [S] long pinned copy (valid once `event` completed)
    event: Optional[torch.cuda.Event]     # after the copy; None on CPU
    errors: dict[int, str] = field(default_factory=dict)  # sampling row -> error (custom processors)
    logprobs: Optional[RowLogprobs] = None  # per sampling row, on their way to the host (output logprobs)
    read: bool = False                    # ``host`` was read (``resolve``): its pinned buffer may be reused


PreparedStep = Staged   # a decode-only batch's inputs and attention plan, queued ahead of its forward (graphs)
