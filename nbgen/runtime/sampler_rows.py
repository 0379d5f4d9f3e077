"""Which rows of a sampling step need what: the per-row kinds the sampler decides its fast paths by
(a raw argmax, a raw draw / temperature; a batch's set of them), the rows whose processing may leave no
token, and the host-built parameter tensors it sends without a stream sync."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from nbgen.core.batch import SeqWork


def host_tensor(data: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host-built tensor on `device` without a stream sync.

    torch.tensor(..., device=cuda) is a blocking copy that waits for the GPU (it would stall
    behind the queued forward pass). A non_blocking copy from pageable memory is staged by the
    driver at once and does not wait for the device, and the source may be freed right after.
    """
    t = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    return t.to(device, non_blocking=True)


def raw_kind(s: SeqWork) -> str:
    """"argmax" where the row's token is the argmax of its raw logits, "draw" where it is a Gumbel-max
    draw from its raw logits / temperature (nothing to process, cut, constrain or report), else "".
    The static part is computed once per request (``req.raw_kind``); min_new_tokens per step."""
    req = s.req
    kind = req.raw_kind
    if kind is None:
        p = req.params
        plain = not req.logprobs.return_logprob and req.grammar is None and req.logit_processor is None
        kind = req.raw_kind = "argmax" if plain and p.plain_greedy else "draw" if plain and p.plain_temperature else ""
    return kind if kind and not stop_ids_banned(s) else ""


def raw_kinds(seqs: Sequence[SeqWork]) -> set[str]:
    """The rows' ``raw_kind`` values as a set, for the fast paths' subset tests; {""} at once when the
    first row has none (a constrained batch). Requests without min_new_tokens that stepped before keep
    their kind (``req.raw_kind``), read in one comprehension instead of a call per row."""
    if seqs and seqs[0].req.raw_kind == "":             # static: "" whatever min_new_tokens
        return {""}
    kinds = {r.raw_kind if not r.params.min_new_tokens else None for r in [s.req for s in seqs]}
    return set(map(raw_kind, seqs)) if None in kinds else kinds


def stop_ids_banned(s: SeqWork) -> bool:
    """min_new_tokens not reached yet: the request's EOS / stop ids are masked this step."""
    n = s.req.params.min_new_tokens
    return bool(n) and s.out_index < n and bool(s.req.stop_ids)


# above this, every allowed token is equally likely in float32 anyway (logits are ~1e2 at most)
MAX_TEMPERATURE = 1e30
NOTHING_ALLOWED = ("no token is allowed at this step: logit_bias, min_new_tokens, the grammar or a custom "
                   "logit processor mask the whole vocabulary")


def may_mask_all(s: SeqWork) -> bool:
    """Rows whose processing can leave no token: -inf biases, banned stop ids, caller code."""
    p = s.req.params
    return (s.req.logit_processor is not None or stop_ids_banned(s)
            or bool(p.logit_bias) and float("-inf") in p.logit_bias.values())


def fully_masked(x: Tensor, seqs: list[SeqWork]) -> dict[int, str]:
    """Rows of x [B, V] where every token is -inf: they get an error (their request is aborted)
    instead of an arbitrary token. Checked (one host sync) only for rows that can get there."""
    rows = [i for i, s in enumerate(seqs) if may_mask_all(s)]
    if not rows:
        return {}
    rows_t = host_tensor(rows, torch.long, x.device)
    dead = torch.isneginf(x[rows_t].amax(dim=-1)).tolist()
    return {i: NOTHING_ALLOWED for i, d in zip(rows, dead) if d}
