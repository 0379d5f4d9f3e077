"""Logprob extraction: chosen-token, top-k and requested-id logprobs from rows of logits.

``log_softmax`` over the rows given, as SGLang reports them: the Sampler passes a sampled token's
processed logits divided by the temperature (see runtime/sampler.py), the runner a prompt
position's raw logits (prompt logprobs never see sampling parameters). Output logprobs may stay
pending (``queue_token_logprobs``, ``RowLogprobs``): their copies to the host are queued behind the
step, and the overlap stepper reads them when it resolves the step's tokens.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from nbgen.core.batch import TokenLogprobs

# Rows per log_softmax block for prompt logprobs: bounds the [rows, V] float32 temporary
# (1024 x 152k vocab ~ 0.6 GB) for long prompt chunks.
PROMPT_BLOCK_ROWS = 1024


def token_logprobs(logits: Tensor, target_ids: Tensor, top_ns: Sequence[int],
                   id_lists: Sequence[Optional[Sequence[int]]]) -> list[TokenLogprobs]:
    """Logprobs for N rows at once.

    logits: [N, V] logits; target_ids: [N] long (the chosen / next token of each row);
    top_ns[i]: how many top alternatives row i wants (0: none);
    id_lists[i]: token ids whose logprobs row i wants (None: none).
    Returns one TokenLogprobs per row; ``top`` is best first. One host sync per call.
    """
    return queue_token_logprobs(logits, target_ids, top_ns, id_lists).result()


def queue_token_logprobs(logits: Tensor, target_ids: Tensor, top_ns: Sequence[int],
                         id_lists: Sequence[Optional[Sequence[int]]]) -> "PendingLogprobs":
    """``token_logprobs`` without waiting: the device work and the copies to the host are queued;
    ``result()`` waits for them (the overlap stepper reads them one step later)."""
    n, vocab = logits.shape
    assert target_ids.shape == (n,) and len(top_ns) == n and len(id_lists) == n
    if n == 0:
        return PendingLogprobs([], [], None, None, None, top_ns, id_lists)
    lp = torch.log_softmax(logits.float(), dim=-1)                       # [N, V]
    chosen = lp.gather(1, target_ids.view(n, 1).long()).squeeze(1)       # [N]

    kmax = min(max(top_ns), vocab)
    top_v = top_i = None
    if kmax > 0:
        top_v, top_i = torch.topk(lp, kmax, dim=-1, sorted=True)         # [N, kmax] best first

    ids_v = None
    lmax = max((len(ids) for ids in id_lists if ids), default=0)
    if lmax > 0:
        # pad every row's id list to lmax with id 0, gather once, slice per row on the host
        pad = [list(ids or []) + [0] * (lmax - len(ids or [])) for ids in id_lists]
        ids_t = torch.tensor(pad, dtype=torch.long).to(lp.device, non_blocking=True)  # [N, L]
        ids_v = lp.gather(1, ids_t)                                       # [N, L]
    return PendingLogprobs(chosen, target_ids, top_v, top_i, ids_v, top_ns, id_lists)


class PendingLogprobs:
    """N rows' logprobs on their way to the host: on CUDA each tensor is copied into pinned memory
    behind the step's work (non-blocking, one event after the copies); ``result()`` waits for the
    event and builds the TokenLogprobs (one transfer per tensor, never one per row)."""

    def __init__(self, chosen: Any, targets: Any, top_v: Optional[Tensor], top_i: Optional[Tensor],
                 ids_v: Optional[Tensor], top_ns: Sequence[int],
                 id_lists: Sequence[Optional[Sequence[int]]]) -> None:
        self.top_ns, self.id_lists = list(top_ns), list(id_lists)
        parts = [chosen, targets, top_v, top_i, ids_v]    # [N], [N], [N, k], [N, k], [N, L]
        self._event = None
        if isinstance(chosen, Tensor) and chosen.is_cuda:
            host = []
            for t in parts:
                if t is not None:
                    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    h.copy_(t, non_blocking=True)
                    t = h
                host.append(t)
            parts = host
            self._event = torch.cuda.Event()
            self._event.record()
        self._parts = parts

    def result(self) -> list[TokenLogprobs]:
        """The rows' TokenLogprobs (waits for the copies on CUDA)."""
        if self._event is not None:
            self._event.synchronize()
        chosen, tgt, top_v, top_i, ids_v = (t.tolist() if isinstance(t, Tensor) else t for t in self._parts)
        vocab_k = len(top_v[0]) if top_v else 0
        out: list[TokenLogprobs] = []
        for r in range(len(chosen)):
            k = min(self.top_ns[r], vocab_k)
            top = list(zip(top_v[r][:k], top_i[r][:k])) if k > 0 else []
            ids = self.id_lists[r]
            idl = list(zip(ids_v[r][:len(ids)], ids)) if ids and ids_v is not None else []
            out.append(TokenLogprobs(logprob=chosen[r], token_id=int(tgt[r]), top=top, ids=idl))
        return out


class RowLogprobs:
    """A sampled batch's output logprobs per sampling row: ``rows`` (those that asked) got
    ``pending``'s entries in order, the others None; ``lists()`` waits for them."""

    def __init__(self, n: int, rows: list[int], pending: Optional[PendingLogprobs]) -> None:
        self.n, self.rows, self.pending = n, rows, pending

    def lists(self) -> list[Optional[TokenLogprobs]]:
        out: list[Optional[TokenLogprobs]] = [None] * self.n
        if self.pending is not None:
            for i, r in zip(self.rows, self.pending.result()):
                out[i] = r
        return out


def prompt_logprobs(logits: Tensor, target_ids: Tensor | list[int], top_n: int,
                    token_ids: Optional[list[int]]) -> list[TokenLogprobs]:
    """Logprobs of prompt tokens for one request.

    logits: [N, V] raw logits where row j predicts target_ids[j] (the prompt token at the next
    position); top_n: top alternatives per position; token_ids: extra ids to report (or None).
    Works in blocks of PROMPT_BLOCK_ROWS rows to bound memory.
    """
    if not isinstance(target_ids, Tensor):
        target_ids = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    n = logits.shape[0]
    out: list[TokenLogprobs] = []
    for s in range(0, n, PROMPT_BLOCK_ROWS):
        e = min(n, s + PROMPT_BLOCK_ROWS)
        out.extend(token_logprobs(logits[s:e], target_ids[s:e], [top_n] * (e - s),
                                  [token_ids] * (e - s)))
    return out
