"""Reference attention backend in plain torch (CPU and fallback): SDPA over pages gathered per step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from nbgen.attention import kv_quant
from nbgen.attention.base import AttentionBackend, AttentionMetadata, KVCacheSpec
from nbgen.attention.tree_mask import chunk_mask
from nbgen.kernels import cpu_ops
from nbgen.core.batch import ScheduledBatch


KEY_BUCKET = 64  # decode key lengths are padded to a multiple of this


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
    decode_pad: Optional[torch.Tensor] = None        # [1, Bd, 1, Kmax] True where a key is padding
    decode_table: Optional[torch.Tensor] = None      # [Bd, max_pages] int64 page ids (C kernel path)
    decode_lens: Optional[torch.Tensor] = None       # [Bd] int64 cached tokens incl. the new one
    prefill: list[_PrefillSeq] = field(default_factory=list)
    kv_buf: Optional[torch.Tensor] = None            # [2, Hkv, Bd * Kmax, D] decode gather buffer


class TorchAttentionBackend(AttentionBackend):
    """Decodes of a step share one attention call; prefill chunks run one SDPA each.

    On a CPU the decodes go to nbgen's C kernel (``cpu_ops.paged_decode_attention``: reads each
    sequence's pages in place); without it (no compiler, other devices, ``use_cpu_kernels=False``)
    they share one padded gather + matmul-softmax-matmul, which keeps the per-layer Python work
    constant in the batch size. Prefill chunks are long enough that a call each is cheap.
    """

    def __init__(self, spec: KVCacheSpec, use_cpu_kernels: Optional[bool] = None) -> None:
        super().__init__(spec)
        self.gqa = spec.num_q_heads // spec.num_kv_heads
        # the C kernel reads pages of the model dtype (an fp8 pool takes the gather path, dequantized)
        usable = spec.device.type == "cpu" and spec.cache_dtype == spec.dtype and cpu_ops.supports_decode(
            spec.dtype, spec.num_q_heads, spec.num_kv_heads)
        self.cpu_kernels = usable and use_cpu_kernels is not False and cpu_ops.available()

    def cache_shape(self) -> tuple[int, ...]:
        """Head-major [Hkv, num_pages * page_size, D]: a gather of slots is directly [Hkv, K, D]."""
        sp = self.spec
        return (sp.num_kv_heads, sp.num_pages * sp.page_size, sp.head_dim)

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
                if s.tree_parents is not None:      # a tree verify chunk: ancestors only
                    kv_slots = self._slots(s.pages, s.kv_len)
                    mask = chunk_mask(s).to(dev)
                elif s.start_pos > 0:
                    kv_slots = self._slots(s.pages, s.kv_len)
                    q_pos = torch.arange(s.start_pos, s.kv_len, device=dev)
                    mask = torch.arange(s.kv_len, device=dev)[None, :] <= q_pos[:, None]
                meta.prefill.append(_PrefillSeq(row, s.q_len, s.start_pos, kv_slots, mask))
            row += s.q_len
        if dec_rows and self.cpu_kernels:
            width = max(len(p) for p in dec_pages)
            meta.decode_rows = torch.tensor(dec_rows, dtype=torch.long)
            meta.decode_table = torch.tensor([p + [0] * (width - len(p)) for p in dec_pages], dtype=torch.long)
            meta.decode_lens = torch.tensor(dec_lens, dtype=torch.long)
        elif dec_rows:
            # Key length rounded up to a bucket: the batched matmuls then see few distinct shapes, so
            # oneDNN reuses its compiled kernels instead of JIT-compiling one per new length (padded
            # keys read the scratch page 0 and are masked out).
            kmax = -(-max(dec_lens) // KEY_BUCKET) * KEY_BUCKET
            max_pages = -(-kmax // P)
            table = torch.tensor([p + [0] * (max_pages - len(p)) for p in dec_pages], dtype=torch.long)
            # [Bd, max_pages, P] -> [Bd, max_pages * P] slots, cut to the bucketed length
            all_slots = (table[:, :, None] * P + torch.arange(P)).reshape(len(dec_rows), -1)[:, :kmax]
            lens = torch.tensor(dec_lens)
            meta.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=dev)
            meta.decode_slots = all_slots.contiguous().to(dev)
            meta.decode_pad = (torch.arange(kmax)[None, :] >= lens[:, None]).to(dev)[None, :, None, :]
        return meta

    def _slots(self, pages: list[int], n: int) -> torch.Tensor:
        P = self.spec.page_size
        n_pages = (n + P - 1) // P
        table = torch.tensor(pages[:n_pages], dtype=torch.long)
        return (table[:, None] * P + torch.arange(P)).reshape(-1)[:n].to(self.spec.device)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V at cache slots ``src`` [n] copied to slots ``dst`` [n]."""
        for c in self.k_cache + self.v_cache:                              # [Hkv, slots, D]
            c = c.view(torch.uint8) if c.element_size() == 1 else c       # fp8 pages copied as bytes
            c.index_copy_(1, dst, c.index_select(1, src))

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchAttentionMetadata, kv_written: bool = False,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        o = self._attend(layer_id, q, k, v, meta, kv_written)
        return o if out is None else out.copy_(o)

    def _attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchAttentionMetadata, kv_written: bool) -> torch.Tensor:
        assert not kv_written, "the torch backend writes K/V itself (kv_target is None)"
        sp = self.spec
        T, hkv, d = q.shape[0], sp.num_kv_heads, sp.head_dim
        q = q.view(T, sp.num_q_heads, d)
        k = k.view(T, hkv, d)
        v = v.view(T, hkv, d)
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]              # [Hkv, slots, D]
        if meta.decode_table is not None and not meta.prefill:
            # a decode-only step: the C kernel writes the new K / V rows into their slots and attends, one call
            od = cpu_ops.paged_decode_attention(q, kc, vc, meta.decode_table, meta.decode_lens, sp.page_size,
                                                self.scale, new_kv=(k.view(T, hkv * d), v.view(T, hkv * d),
                                                                    meta.slot_mapping))
            return od.view(T, sp.num_q_heads * d)
        ks, vs = sp.scales(layer_id)                                           # an fp8 pool's scales
        kv_quant.write(kc, meta.slot_mapping, k.transpose(0, 1), ks)
        kv_quant.write(vc, meta.slot_mapping, v.transpose(0, 1), vs)
        out = torch.empty_like(q)
        if meta.decode_table is not None:
            bd = meta.decode_rows.shape[0]
            qd = q if bd == T else q.index_select(0, meta.decode_rows)          # [Bd, Hq, D]
            od = cpu_ops.paged_decode_attention(qd, kc, vc, meta.decode_table, meta.decode_lens,
                                                sp.page_size, self.scale)
            if bd == T:
                return od.view(T, sp.num_q_heads * d)
            out.index_copy_(0, meta.decode_rows, od)
        elif meta.decode_rows is not None:
            # Plain matmul-softmax-matmul: for one query row per sequence this is ~7x faster on a CPU
            # than SDPA's flash kernel (32 seqs x 90 keys, bf16); softmax runs in fp32. Batches are
            # (kv head, seq) pairs so the gathered keys are used in place, without a transposing copy.
            bd, g = meta.decode_rows.shape[0], self.gqa
            kmax = meta.decode_slots.shape[1]
            all_decode = bd == T  # decode-only step: rows are 0..T-1, no gather/scatter of q needed
            qd = (q if all_decode else q.index_select(0, meta.decode_rows)).view(bd, hkv, g, d).transpose(0, 1)
            qd = qd.reshape(hkv * bd, g, d)                                   # [Hkv*Bd, G, D]
            flat = meta.decode_slots.view(-1)
            # index_select over a flat slot list is far cheaper on a CPU than advanced indexing
            if meta.kv_buf is None:  # one gather buffer per step, reused by every layer (fewer mallocs)
                meta.kv_buf = torch.empty((2, hkv, flat.numel(), d), dtype=kc.dtype, device=kc.device)
            kd = torch.index_select(kc, 1, flat, out=meta.kv_buf[0]).view(hkv * bd, kmax, d)  # [Hkv*Bd, Kmax, D]
            vd = torch.index_select(vc, 1, flat, out=meta.kv_buf[1]).view(hkv * bd, kmax, d)
            kd, vd = kv_quant.load(kd, ks, qd.dtype), kv_quant.load(vd, vs, qd.dtype)
            scores = torch.bmm(qd, kd.transpose(1, 2)).float().mul_(self.scale)
            scores = scores.view(hkv, bd, g, kmax).masked_fill_(meta.decode_pad, float("-inf"))
            probs = torch.softmax(scores, -1, dtype=torch.float32).to(vd.dtype).view(hkv * bd, g, kmax)
            od = torch.bmm(probs, vd).view(hkv, bd, g, d).transpose(0, 1)     # [Bd, Hkv, G, D]
            od = od.reshape(bd, sp.num_q_heads, d).to(out.dtype)
            if all_decode:
                return od.reshape(T, sp.num_q_heads * d)
            out.index_copy_(0, meta.decode_rows, od)
        for p in meta.prefill:
            qs = q[p.tok_start:p.tok_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
            if p.kv_slots is None and kc.dtype == q.dtype:  # fresh prompt chunk: its own k/v are the context
                kp = k[p.tok_start:p.tok_start + p.q_len].transpose(0, 1)
                vp = v[p.tok_start:p.tok_start + p.q_len].transpose(0, 1)
            else:   # from the pool (an fp8 pool: the chunk's own k/v as stored, as the paged kernels read them)
                slots = p.kv_slots if p.kv_slots is not None else meta.slot_mapping[p.tok_start:p.tok_start + p.q_len]
                kp = kv_quant.load(kc.index_select(1, slots), ks, q.dtype)       # [Hkv, K, D]
                vp = kv_quant.load(vc.index_select(1, slots), vs, q.dtype)
            os_ = F.scaled_dot_product_attention(qs, kp.unsqueeze(0).to(qs.dtype), vp.unsqueeze(0).to(qs.dtype),
                                                 attn_mask=p.mask, is_causal=p.mask is None, scale=self.scale,
                                                 enable_gqa=self.gqa > 1)
            out[p.tok_start:p.tok_start + p.q_len] = os_.squeeze(0).transpose(0, 1)
        return out.view(T, sp.num_q_heads * d)
