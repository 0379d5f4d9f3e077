"""Cascade decode attention in plain torch (the torch backend's path and the reference of the GPU one).

A decode batch's attention split by a ``CascadePlan`` (core/cascade_plan.py): each group's query rows
against its shared prefix pages (level 0), every row against its own remaining pages (level 1), the
two partial softmaxes merged by their log-sum-exps. Exact up to floating-point rounding: with
per-part maxima m_a, m_b and sums s_a, s_b, softmax over the union weights part a by
exp(lse_a - lse) where lse = log(exp(lse_a) + exp(lse_b)).

The KV pool is the torch backend's head-major layout [Hkv, num_pages * page_size, D]; math in fp32.
"""
from __future__ import annotations

import torch

from nbgen.attention import kv_quant
from nbgen.core.cascade_plan import CascadePlan


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets: o [n, H, D] fp32, lse [n, H]
    (natural log) -> the result over the union. A part with no keys has lse = -inf and weight 0."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num_(0.0)[..., None]    # -inf - -inf: both empty (never here)
    w_b = torch.exp(lse_b - lse).nan_to_num_(0.0)[..., None]
    return o_a * w_a + o_b * w_b, lse


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               pad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp. q [B, n, Hq, D]; k, v [B, Hkv, K, D] (Hq a multiple of Hkv,
    grouped-query heads share a KV head); pad [B, K] True at keys to ignore.
    Returns o [B, n, Hq, D] fp32 and lse [B, n, Hq] fp32."""
    B, n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qh = q.float().view(B, n, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(B, hkv, n * g, d)   # [B, Hkv, n*G, D]
    s = torch.matmul(qh, k.float().transpose(-1, -2)) * scale                                # [B, Hkv, n*G, K]
    if pad is not None:
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)                                                              # [B, Hkv, n*G]
    o = torch.matmul(torch.exp(s - lse[..., None]).nan_to_num_(0.0), v.float())              # [B, Hkv, n*G, D]
    o = o.view(B, hkv, n, g, d).permute(0, 2, 1, 3, 4).reshape(B, n, hq, d)
    lse = lse.view(B, hkv, n, g).permute(0, 2, 1, 3).reshape(B, n, hq)
    return o, lse


def _slots(pages: list[int], n_tokens: int, page_size: int, device: torch.device) -> torch.Tensor:
    """Flat cache slots [n_tokens] of the first n_tokens tokens of ``pages``."""
    t = torch.tensor(pages, dtype=torch.long, device=device)
    return (t[:, None] * page_size + torch.arange(page_size, device=device)).reshape(-1)[:n_tokens]


def _load(cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    return kv_quant.load(cache.index_select(1, slots), scale, torch.float32)        # [Hkv, K, D]


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: CascadePlan,
                   scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Decode attention of one-token rows q [B, Hq, D] by the plan's two levels -> [B, Hq, D] in q's dtype.
    The new tokens' K/V must already be in the pool."""
    P, dev = plan.page_size, q.device
    B = q.shape[0]
    # level 1: each row against its own pages, as one padded batch
    ip, last = plan.suffix_kv_indptr, plan.suffix_last_page_len
    lens = [(ip[i + 1] - ip[i] - 1) * P + last[i] for i in range(B)]
    kmax = max(lens)
    slots = torch.zeros((B, kmax), dtype=torch.long, device=dev)            # padding reads slot 0
    for i in range(B):
        slots[i, : lens[i]] = _slots(plan.suffix_kv_indices[ip[i]: ip[i + 1]], lens[i], P, dev)
    hkv, d = k_cache.shape[0], k_cache.shape[2]
    k = _load(k_cache, slots.view(-1), k_scale).view(hkv, B, kmax, d).transpose(0, 1)   # [B, Hkv, K, D]
    v = _load(v_cache, slots.view(-1), v_scale).view(hkv, B, kmax, d).transpose(0, 1)
    pad = torch.arange(kmax, device=dev)[None, :] >= torch.tensor(lens, device=dev)[:, None]
    o, lse = attend_lse(q[:, None], k, v, scale, pad)
    o, lse = o[:, 0], lse[:, 0]                                               # [B, Hq, D], [B, Hq]
    # level 0: each group's rows against its prefix, keys read once for the group
    for grp in plan.groups:
        rows = torch.tensor(grp.rows, dtype=torch.long, device=dev)
        s = _slots(grp.prefix_pages, len(grp.prefix_pages) * P, P, dev)
        kp, vp = _load(k_cache, s, k_scale), _load(v_cache, s, v_scale)          # [Hkv, K0, D]
        o0, lse0 = attend_lse(q.index_select(0, rows)[None], kp[None], vp[None], scale)
        om, lm = merge_states(o.index_select(0, rows), lse.index_select(0, rows), o0[0], lse0[0])
        o = o.index_copy(0, rows, om)
        lse = lse.index_copy(0, rows, lm)
    return o.to(q.dtype)
