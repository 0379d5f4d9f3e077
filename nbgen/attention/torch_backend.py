"""Reference attention backend in plain torch (CPU and fallback): SDPA over pages gathered per step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from nbgen.attention.base import AttentionBackend, AttentionMetadata, KVCacheSpec
from nbgen.runtime.batch import ScheduledBatch


@dataclass
class _PrefillSeq:
    tok_start: int                 # first row of this seq in the flat token stream
    q_len: int
    start_pos: int                 # tokens already cached before this chunk
    kv_slots: Optional[torch.Tensor]  # [start_pos + q_len] flat cache slots; None when start_pos == 0
    mask: Optional[torch.Tensor]   # [q_len, kv_len] bool (causal with offset); None -> is_causal


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    backend: "TorchAttentionBackend"
    slot_mapping: torch.Tensor                       # [T] flat cache slot of each new token
    decode_rows: Optional[torch.Tensor] = None       # [Bd] rows of single-token (decode) seqs
    decode_slots: Optional[torch.Tensor] = None      # [Bd, Kmax] cache slots, padded with 0
    decode_pad: Optional[torch.Tensor] = None        # [Bd, 1, 1, Kmax] True where a key is padding
    prefill: list[_PrefillSeq] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    """Decodes of a step share one padded SDPA call; prefill chunks run one SDPA each.

    Padding the decode group keeps the per-layer Python work constant in the batch size (one gather,
    one SDPA), which is what matters on a CPU; prefill chunks are long enough that a call each is cheap.
    """

    def __init__(self, spec: KVCacheSpec) -> None:
        super().__init__(spec)
        self.gqa = spec.num_q_heads // spec.num_kv_heads

    def prepare(self, batch: ScheduledBatch) -> TorchAttentionMetadata:
        dev = self.spec.device
        P = self.spec.page_size
        slots = torch.tensor(self.slot_mapping(batch), dtype=torch.long, device=dev)
        meta = TorchAttentionMetadata(backend=self, slot_mapping=slots)
        dec_rows: list[int] = []
        dec_pages: list[list[int]] = []
        dec_lens: list[int] = []
        row = 0
        for s in batch.seqs:
            if s.q_len == 1:
                dec_rows.append(row)
                n_pages = (s.kv_len + P - 1) // P
                dec_pages.append(s.pages[:n_pages])
                dec_lens.append(s.kv_len)
            else:
                kv_slots = mask = None
                if s.start_pos > 0:
                    kv_slots = self._slots(s.pages, s.kv_len)
                    q_pos = torch.arange(s.start_pos, s.kv_len, device=dev)
                    mask = torch.arange(s.kv_len, device=dev)[None, :] <= q_pos[:, None]
                meta.prefill.append(_PrefillSeq(row, s.q_len, s.start_pos, kv_slots, mask))
            row += s.q_len
        if dec_rows:
            max_pages = max(len(p) for p in dec_pages)
            table = torch.tensor([p + [0] * (max_pages - len(p)) for p in dec_pages], dtype=torch.long)
            # [Bd, max_pages, P] -> [Bd, max_pages * P] slots, cut to the longest sequence
            kmax = max(dec_lens)
            all_slots = (table[:, :, None] * P + torch.arange(P)).reshape(len(dec_rows), -1)[:, :kmax]
            lens = torch.tensor(dec_lens)
            meta.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=dev)
            meta.decode_slots = all_slots.contiguous().to(dev)
            meta.decode_pad = (torch.arange(kmax)[None, :] >= lens[:, None]).to(dev)[:, None, None, :]
        return meta

    def _slots(self, pages: list[int], n: int) -> torch.Tensor:
        P = self.spec.page_size
        n_pages = (n + P - 1) // P
        table = torch.tensor(pages[:n_pages], dtype=torch.long)
        return (table[:, None] * P + torch.arange(P)).reshape(-1)[:n].to(self.spec.device)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchAttentionMetadata) -> torch.Tensor:
        sp = self.spec
        T = q.shape[0]
        q = q.view(T, sp.num_q_heads, sp.head_dim)
        k = k.view(T, sp.num_kv_heads, sp.head_dim)
        v = v.view(T, sp.num_kv_heads, sp.head_dim)
        k_flat = self.k_cache[layer_id].view(-1, sp.num_kv_heads, sp.head_dim)
        v_flat = self.v_cache[layer_id].view(-1, sp.num_kv_heads, sp.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        out = torch.empty_like(q)
        gqa = self.gqa > 1
        if meta.decode_rows is not None:
            # Plain matmul-softmax-matmul: for one query row per sequence this is ~7x faster on a CPU
            # than SDPA's flash kernel (measured at 32 seqs x 90 keys, bf16); softmax runs in fp32.
            bd = meta.decode_rows.shape[0]
            qd = q.index_select(0, meta.decode_rows).view(bd, sp.num_kv_heads, self.gqa, sp.head_dim)
            # index_select over the flat slot list is far cheaper on a CPU than advanced indexing
            kmax = meta.decode_slots.shape[1]
            flat = meta.decode_slots.view(-1)
            kd = k_flat.index_select(0, flat).view(bd, kmax, sp.num_kv_heads, sp.head_dim)
            vd = v_flat.index_select(0, flat).view(bd, kmax, sp.num_kv_heads, sp.head_dim)
            kd = kd.permute(0, 2, 3, 1)                                    # [Bd, Hkv, D, Kmax]
            vd = vd.transpose(1, 2)                                        # [Bd, Hkv, Kmax, D]
            scores = torch.matmul(qd, kd.to(qd.dtype)).float() * self.scale  # [Bd, Hkv, G, Kmax]
            scores.masked_fill_(meta.decode_pad, float("-inf"))
            od = torch.matmul(scores.softmax(-1).to(vd.dtype), vd)        # [Bd, Hkv, G, D]
            out.index_copy_(0, meta.decode_rows, od.reshape(bd, sp.num_q_heads, sp.head_dim).to(out.dtype))
        for p in meta.prefill:
            qs = q[p.tok_start:p.tok_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
            if p.kv_slots is None:  # fresh prompt chunk: its own k/v are the whole context
                ks = k[p.tok_start:p.tok_start + p.q_len]
                vs = v[p.tok_start:p.tok_start + p.q_len]
            else:
                ks, vs = k_flat.index_select(0, p.kv_slots), v_flat.index_select(0, p.kv_slots)
            ks = ks.transpose(0, 1).unsqueeze(0)                                    # [1, Hkv, K, D]
            vs = vs.transpose(0, 1).unsqueeze(0)
            os_ = F.scaled_dot_product_attention(qs, ks.to(qs.dtype), vs.to(qs.dtype), attn_mask=p.mask,
                                                 is_causal=p.mask is None, scale=self.scale, enable_gqa=gqa)
            out[p.tok_start:p.tok_start + p.q_len] = os_.squeeze(0).transpose(0, 1)
        return out.view(T, sp.num_q_heads * sp.head_dim)
