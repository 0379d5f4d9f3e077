"""Logprob extraction: chosen-token, top-k and requested-id logprobs from rows of logits.

``log_softmax`` over the rows given, as SGLang reports them: the Sampler passes a sampled token's
processed logits divided by the temperature (see runtime/sampler.py), the runner a prompt
position's raw logits (prompt logprobs never see sampling parameters).
"""
from __future__ import annotations

from typing import Optional, Sequence

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
    n, vocab = logits.shape
    assert target_ids.shape == (n,) and len(top_ns) == n and len(id_lists) == n
    if n == 0:
        return []
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

    # --- one transfer per tensor ---
    chosen_l = chosen.tolist()
    tgt_l = target_ids.tolist()
    top_vl = top_v.tolist() if top_v is not None else None
    top_il = top_i.tolist() if top_i is not None else None
    ids_vl = ids_v.tolist() if ids_v is not None else None

    out: list[TokenLogprobs] = []
    for r in range(n):
        k = min(top_ns[r], vocab)
        top = list(zip(top_vl[r][:k], top_il[r][:k])) if k > 0 and top_vl is not None else []
        ids = id_lists[r]
        idl = list(zip(ids_vl[r][:len(ids)], ids)) if ids and ids_vl is not None else []
        out.append(TokenLogprobs(logprob=chosen_l[r], token_id=int(tgt_l[r]), top=top, ids=idl))
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
