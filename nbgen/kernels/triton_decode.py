"""Decode attention as one Triton kernel for every decode batch size: split-KV with the merge done
by the last split to finish, instead of flashinfer's attention + merge launches.

Program (b, kv head, split) streams its share of sequence b's pages (online softmax in fp32, the
group's q heads together on tensor cores), stores its partial (m, l, acc) and counts itself in
through an atomic; the split that arrives last merges the partials into the output and re-arms the
counter for the next launch (one split: the output is written directly). Pages (HND) are read in
place through the cache's strides, so the kernel serves CUDA-graph replays with any KV lengths.
Against flashinfer's tensor-core decode on an H100 (Qwen3-0.6B heads, KV ~1k tokens a sequence):
batch 1 11.9 -> 7.9 us a layer, 8: 23.6 -> 18.9, 16: 38.8 -> 35.3,
64: 118.5 -> 114, 256: 389.5 -> 384.6 (the last at the device's read bandwidth). At batch 1 a layer's
decode attention is latency-bound (~1 MB of KV), so the split count follows the batch size.

Numerics as flashinfer's tensor-core decode: q.K and P.V on tensor cores with fp32 accumulation,
probabilities rounded to the KV dtype for P.V, fp32 softmax state and merge, one output rounding.

fp8 pages (``kv_cache_dtype="fp8_e4m3"``): each K/V tile is loaded as e4m3 (half the bytes) and
widened to fp16 in registers (exact: every e4m3 value is an fp16 value; q rounds to fp16), V as byte
pairs split into its even and odd columns (``paged_softmax.attend_pages``); the K scale is folded into
the softmax scale and the V scale into the output (flashinfer's k_scale / v_scale), and P.V rounds
the probabilities to fp16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from nbgen.kernels import paged_softmax, pdl
from nbgen.kernels.batch_sizes import padded_batch_size

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton never build this wrapper
    triton = None

LOG2E = 1.4426950408889634
# split target, programs per SM: 4 up to 16 rows, 8 above (measured with the longest-first order)
SMALL_BATCH_PPS, LARGE_BATCH_PPS = 4, 8
STAGES = 2          # K/V tiles in flight per program
MAX_SPLITS = 16
# e4m3 pages' pipelining: up to FP8_AHEAD_ROWS rows, page numbers one tile ahead with FP8_AHEAD_STAGES
# stages (two K/V tiles in flight); above, FP8_STAGES without (one tile, four programs an SM: 108
# registers). ``python -m nbgen.bench.kv_decode`` on an H100, Llama-3.1-8B heads, µs a layer, ahead |
# not: 1 x 8192 tokens 13.7 | 15.4, 32 x 1024 36.5 | 37.1, 256 x 1024 191.4 | 185.2 (bf16 pages 20.0,
# 57.2, 359.7: at 256 rows both read at the copy rate, 2.9-3.0 TB/s)
FP8_STAGES = 4
FP8_AHEAD_STAGES, FP8_AHEAD_ROWS = 3, 32


def supported(head_dim: int) -> bool:
    """Head sizes the kernel's tiles take: a power of 2 in [16, 256]."""
    return triton is not None and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def programs_per_sm(bs: int) -> int:
    """The split target at a batch of ``bs`` rows: longer splits at small batches, where every row is
    split anyway (bs 8: 15.0 vs 17.1 us a layer with 8), finer ones above, where the kernel's tail is
    what more programs shorten (bs 48: 89.5 -> 74.2 us)."""
    return SMALL_BATCH_PPS if bs <= 16 else LARGE_BATCH_PPS


def num_splits(bs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per (sequence, kv head): about ``programs_per_sm(bs)`` programs per SM over the batch, a
    power of 2 in [1, MAX_SPLITS]. ``bs`` must be the CUDA-graph batch size the batch pads to
    (``padded_batch_size``), so that an eager step splits (and sums) exactly like a graph replay."""
    want = max(1, programs_per_sm(bs) * num_sms // max(1, bs * num_kv_heads))
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


def block_n(bs: int, head_dim: int) -> int:
    """KV tokens per tile: 64 for 1-2 seqs (short splits; Llama-8B at batch 1 was tuned on it), else 128."""
    n = 64 if bs <= 2 else 128
    return n if head_dim <= 128 else n // 2


def longest_first(kv_indptr: np.ndarray, last_page_len: np.ndarray, page_size: int,
                  skip: Optional[np.ndarray] = None) -> np.ndarray:
    """Rows by KV length (less ``skip`` [B] leading pages where given), longest first (ties in row
    order) as int32 [B]."""
    n = len(last_page_len)
    kv_len = (np.diff(kv_indptr[: n + 1]).astype(np.int64) - 1) * page_size + last_page_len[:n]
    if skip is not None:
        kv_len -= skip[:n].astype(np.int64) * page_size
    return np.argsort(-kv_len, kind="stable").astype(np.int32)


if triton is not None:
    @triton.jit
    def _decode_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, indptr_ptr, indices_ptr, last_ptr, order_ptr,
                       part_ptr, ml_ptr, count_ptr, sq_t, sq_h, so_t, so_h, s_page, s_head, s_tok, qk_scale, v_scale,
                       skip_ptr, chunk_ptr, slot_ptr, part0_ptr, ml0_ptr,
                       G: tl.constexpr, G2: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                       NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, STAGES: tl.constexpr,
                       FP8: tl.constexpr, CASCADE: tl.constexpr, S0: tl.constexpr, SB0: tl.constexpr, BM0: tl.constexpr,
                       EARLY: tl.constexpr, AHEAD: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr):
        kh = tl.program_id(0)
        s = tl.program_id(1)
        HKV = tl.num_programs(0)
        # page tables and the row order: host-to-device copies made before the step, not the previous
        # kernel's output. Programs are dispatched in grid order (kv head, split, rank) and ``order``
        # lists rows longest first, so the last programs to start are the shortest and the kernel's
        # tail (SMs idle while a few long rows finish) stays short
        b = tl.load(order_ptr + tl.program_id(2))
        start = tl.load(indptr_ptr + b)
        kv_len = (tl.load(indptr_ptr + b + 1) - start - 1) * P + tl.load(last_ptr + b)
        if CASCADE:         # level 1 of a shared-prefix step: the row's pages after its chunk's shared ones
            c0 = tl.load(chunk_ptr + b)     # its level-0 chunk and place there, read now for the fold
            slot0 = tl.load(slot_ptr + b)
            sk = tl.load(skip_ptr + b)
            start += sk
            kv_len -= sk * P
        chunk = tl.cdiv(tl.cdiv(kv_len, NSPLIT), BLOCK_N) * BLOCK_N        # tokens per split
        lo = s * chunk
        hi = tl.minimum(lo + chunk, kv_len)
        g = tl.arange(0, GP)                       # the group's q heads, padded to a tensor-core tile
        d = tl.arange(0, D)
        if USE_PDL:
            if not EARLY:
                pdl.gdc_wait()              # q and this step's K/V are written by the kernel before
            pdl.gdc_launch_dependents()
        q_at = q_ptr + b.to(tl.int64) * sq_t + (kh * G + g)[:, None] * sq_h + d[None, :]
        if EARLY:           # not waited for: read at L2, where the kernel before level 0 left it
            q = tl.load(q_at, mask=(g < G)[:, None], other=0.0, cache_modifier=".cg")  # [GP, D]
        else:
            q = tl.load(q_at, mask=(g < G)[:, None], other=0.0)                        # [GP, D]
        if FP8:             # e4m3 pages, fp16 products (bf16 q rounds to fp16)
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        m, l, acc = paged_softmax.attend_pages(q, kc_ptr, vc_ptr, indices_ptr, start, lo, hi, kh, s_page, s_head,
                                               s_tok, qk_scale, GP, D, P, BLOCK_N, STAGES, AHEAD, FP8, PTX,
                                               PAIRS=GP < 64)     # 64-row tiles: V widened (attend_pages)
        if NSPLIT == 1:
            if CASCADE:
                if USE_PDL and EARLY:
                    pdl.gdc_wait()          # level 0's partials (level 0 itself waited for q and K/V)
                m, l, acc = paged_softmax.fold_shared(m, l, acc, c0, slot0, kh, HKV, g, G, part0_ptr, ml0_ptr,
                                                      S0, SB0, BM0, D)
            tl.store(o_ptr + b.to(tl.int64) * so_t + (kh * G + g)[:, None] * so_h + d[None, :],
                     (acc * v_scale / l[:, None]).to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])
        else:
            g2 = tl.arange(0, G2)
            pair = b * HKV + kh
            cell = pair * NSPLIT + s
            keep = g < G2
            tl.store(part_ptr + cell.to(tl.int64) * (G2 * D) + g[:, None] * D + d[None, :], acc,
                     mask=keep[:, None])
            tl.store(ml_ptr + cell * (2 * G2) + g, m, mask=keep)
            tl.store(ml_ptr + cell * (2 * G2) + G2 + g, l, mask=keep)
            # every thread's partial stores, then one release/acquire increment (CUTLASS's semaphore
            # pattern): the split that sees NSPLIT - 1 arrived last and all partials are visible
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if arrived == NSPLIT - 1:
                sp = tl.arange(0, NSPLIT)
                mls = ml_ptr + (pair * NSPLIT + sp)[:, None] * (2 * G2) + g2[None, :]
                ms = tl.load(mls, cache_modifier=".cg")                                # [NSPLIT, G2]
                ls = tl.load(mls + G2, cache_modifier=".cg")
                mx = tl.max(ms, 0)                       # finite: split 0 holds >= 1 token
                den = tl.sum(tl.exp2(ms - mx[None, :]) * ls, 0)                        # empty splits: 0
                out = tl.zeros([G2, D], tl.float32)
                for j0 in tl.static_range(0, NSPLIT, SB):       # SB splits' partials per load
                    cj = pair * NSPLIT + j0 + tl.arange(0, SB)
                    wj = tl.exp2(tl.load(ml_ptr + cj[:, None] * (2 * G2) + g2[None, :], cache_modifier=".cg")
                                 - mx[None, :])                                        # [SB, G2]
                    pj = tl.load(part_ptr + cj.to(tl.int64)[:, None, None] * (G2 * D)
                                 + g2[None, :, None] * D + d[None, None, :], cache_modifier=".cg")
                    out += tl.sum(wj[:, :, None] * pj, 0)
                if CASCADE:
                    if USE_PDL and EARLY:
                        pdl.gdc_wait()
                    mx, den, out = paged_softmax.fold_shared(mx, den, out, c0, slot0, kh, HKV, g2, G, part0_ptr,
                                                             ml0_ptr, S0, SB0, BM0, D)
                tl.store(o_ptr + b.to(tl.int64) * so_t + (kh * G + g2)[:, None] * so_h + d[None, :],
                         (out * v_scale / den[:, None]).to(o_ptr.dtype.element_ty), mask=(g2 < G)[:, None])
                tl.store(count_ptr + pair, 0)                                          # re-arm


@dataclass
class Cascade:
    """Level 1 of a shared-prefix decode (kernels/triton_cascade.py): per row, ``skip`` [B] leading pages
    to skip, ``chunk`` [B] its level-0 chunk or -1, ``slot`` [B] its place in the chunk (int32); the
    level-0 partials ``part0`` [C, Hkv, splits, tile_rows, D] and ``ml0`` [C, Hkv, splits, 2, tile_rows]
    (fp32) to fold in."""

    skip: torch.Tensor
    chunk: torch.Tensor
    slot: torch.Tensor
    part0: torch.Tensor
    ml0: torch.Tensor
    splits: int
    tile_rows: int
    block_n: Optional[int] = None      # level 1's KV tokens per tile (None: ``block_n`` of the batch)
    warps: int = 4
    stages: Optional[int] = None       # K/V tiles in flight (None: STAGES / FP8_STAGES)
    nsplit: Optional[int] = None       # splits per (row, kv head) (None: ``num_splits`` of the batch)
    # PDL: start on the row's own pages while level 0 runs, wait for level 0 only before the fold (safe:
    # level 1 launches once every level-0 program passed its own wait for q and this step's K/V)
    early: bool = False
    ahead: bool = False                # page numbers one tile ahead (paged_softmax.attend_pages)


class TritonDecodeWrapper:
    """flashinfer-wrapper-shaped ``plan`` / ``run`` over the kernel. Given device buffers (a CUDA
    graph's, for one batch size), ``plan`` only copies the host page tables into them; otherwise the
    wrapper keeps its own, grown on demand, and serves any batch size (eager steps)."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device: torch.device, indptr: Optional[torch.Tensor] = None,
                 indices: Optional[torch.Tensor] = None, last: Optional[torch.Tensor] = None,
                 order: Optional[torch.Tensor] = None) -> None:
        self.hq, self.hkv, self.d, self.P = num_q_heads, num_kv_heads, head_dim, page_size
        self.group = num_q_heads // num_kv_heads
        self.g2 = triton.next_power_of_2(self.group)       # partial rows per (seq, kv head, split)
        self.gp = max(16, self.g2)                         # q rows of the tensor-core tile
        self.device = device
        self.pad = padded_batch_size
        self.fixed = indptr is not None        # a graph's buffers; else own ones, grown on demand
        if self.fixed and order is None:       # a graph's wrapper planned through plan(): own order buffer
            order = torch.arange(last.numel(), dtype=torch.int32, device=device)
        self.indptr, self.indices, self.last, self.order = indptr, indices, last, order
        # SM count sets the split count; a CPU device only occurs under the Triton interpreter (tests)
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
        # split scratch: pairs x splits <= programs per SM x SMs whenever splits > 1 (else unused)
        cells = max(max(SMALL_BATCH_PPS, LARGE_BATCH_PPS) * self.sms, MAX_SPLITS)
        self.part = torch.empty(cells * self.g2 * head_dim, dtype=torch.float32, device=device)
        self.ml = torch.empty(cells * 2 * self.g2, dtype=torch.float32, device=device)
        self.count = torch.zeros(cells, dtype=torch.int32, device=device)
        self.scale = head_dim ** -0.5

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor) -> None:
        """Host (pinned) indptr [B+1] / last_page_len [B]; kv_indices host or already on the device.
        (A graph's wrapper is not planned: its buffers are filled by the graph runner's one copy.)"""
        bs = len(last_page_len)
        if not self.fixed:
            if self.indices is None or self.indices.numel() < kv_indices.numel():
                self.indices = torch.empty(max(1024, 2 * kv_indices.numel()), dtype=torch.int32, device=self.device)
            if self.last is None or self.last.numel() < bs:
                self.indptr = torch.empty(2 * bs + 1, dtype=torch.int32, device=self.device)
                self.last = torch.empty(2 * bs, dtype=torch.int32, device=self.device)
                self.order = torch.empty(2 * bs, dtype=torch.int32, device=self.device)
        if kv_indices.data_ptr() != self.indices.data_ptr():
            self.indices[: kv_indices.numel()].copy_(kv_indices, non_blocking=True)
        self.indptr[: bs + 1].copy_(kv_indptr, non_blocking=True)
        self.last[: bs].copy_(last_page_len, non_blocking=True)
        order = torch.from_numpy(longest_first(kv_indptr.numpy(), last_page_len.numpy(), self.P))
        self.order[: bs].copy_(order.pin_memory() if self.device.type == "cuda" else order, non_blocking=True)

    def run(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
            out: Optional[torch.Tensor] = None, k_scale: float = 1.0, v_scale: float = 1.0,
            cascade: Optional[Cascade] = None) -> torch.Tensor:
        """q [B, Hq, D] (strided rows allowed) -> o [B, Hq, D] over the planned page tables (into ``out``,
        [B, Hq, D] with unit stride over D, when given). Pages of q's dtype or e4m3 (fp8 pages hold
        K / k_scale and V / v_scale: the scales multiply back in, as flashinfer's run() takes them)."""
        kc, vc = kv_cache
        B = q.shape[0]
        o = torch.empty((B, self.hq, self.d), dtype=q.dtype, device=q.device) if out is None else out
        s_page, s_head, s_tok = kc.stride(0), kc.stride(1), kc.stride(2)      # HND [pages, Hkv, P, D]
        bs = self.pad(B)
        nsplit = num_splits(bs, self.hkv, self.sms)
        c = cascade or Cascade(self.last, self.last, self.last, self.part, self.ml, 1, 1)    # unread when off
        if c.nsplit is not None:
            fits = c.nsplit == 1 or B * self.hkv * c.nsplit <= self.count.numel()
            if c.nsplit < 1 or c.nsplit & (c.nsplit - 1) or not fits:
                raise ValueError(f"nsplit {c.nsplit}: a power of 2 whose partials the split scratch holds")
            nsplit = c.nsplit
        sb = max(1, min(nsplit, 8192 // (self.g2 * self.d)))     # merge: <= 8k fp32 partial values per load
        fp8 = kc.element_size() == 1
        args = (q, kc, vc, o, self.indptr, self.indices, self.last, self.order, self.part, self.ml, self.count,
                q.stride(0), q.stride(1), o.stride(0), o.stride(1), s_page, s_head, s_tok,
                self.scale * float(k_scale) * LOG2E, float(v_scale))
        if cascade is None and fp8:
            stages, ahead = (FP8_AHEAD_STAGES, True) if bs <= FP8_AHEAD_ROWS else (FP8_STAGES, False)
        else:
            stages, ahead = c.stages or (FP8_STAGES if fp8 else STAGES), c.ahead
        pdl.launch(_decode_kernel, (self.hkv, nsplit, B), args + (c.skip, c.chunk, c.slot, c.part0, c.ml0),
                   q.device, G=self.group, G2=self.g2, GP=self.gp,
                   D=self.d, P=self.P, NSPLIT=nsplit, BLOCK_N=c.block_n or block_n(bs, self.d), SB=sb,
                   STAGES=stages, FP8=fp8, CASCADE=cascade is not None,
                   S0=c.splits, SB0=min(c.splits, max(1, 8192 // (self.gp * self.d))), BM0=c.tile_rows,
                   EARLY=c.early and cascade is not None, AHEAD=ahead, PTX=q.is_cuda, num_warps=c.warps)
        return o
