"""Causal chunk ("extend") attention over paged KV as one Triton launch: the small prompt chunks of a
mixed step, with model-dtype queries over model-dtype or e4m3 pages.

Sequence b contributes its chunk rows ``qo_indptr[b]..qo_indptr[b+1]`` (q_len tokens) and KV length
L = (pages - 1) * P + last, which includes the chunk's own tokens (their K/V are already in the pages):
chunk row t attends keys [0, L - q_len + t]. The host plan cuts every chunk into blocks of BM // G
tokens; program (kv head, split, block) runs the block's tokens x the kv head's G q heads as one
tensor-core tile (tile row i: token t0 + i // G, q head kh * G + i % G). Keys [0, L - q_len + t0]
(every row of the block sees them) stream through ``paged_softmax.attend_pages`` in ``splits`` parts;
the last split also takes the block's diagonal keys under the causal mask (``_diagonal``). Splits store
partial (m, l, acc) and the last to arrive merges them, as the decode kernel does
(kernels/triton_decode.py), so a short chunk after a long prefix still fills the GPU in one launch.

Numerics as the decode kernel: e4m3 tiles widened to fp16 in registers (q rounds to fp16; no e4m3
rounding of q), K scale folded into the softmax scale, V scale into the output, probabilities rounded
to the pages' product dtype for P.V, fp32 softmax state and merge, one output rounding.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from nbgen.kernels import paged_softmax, pdl
from nbgen.kernels.extend_plan import MAX_SPLITS, ExtendPlan, ExtendShape, TableStaging, num_splits, plan_blocks
from nbgen.kernels.triton_decode import LOG2E

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton never build this wrapper
    triton = None


def supported(head_dim: int) -> bool:
    """Head sizes the kernel's tiles take: a power of 2 in [16, 256]."""
    return triton is not None and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


if triton is not None:
    @triton.jit
    def _diagonal(q, m, l, acc, kc_ptr, vc_ptr, indices_ptr, start, lo, hi, lim, kh, s_page, s_head, s_tok,
                  qk_scale, M: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr):
        """The softmax state (m, l, acc) of q [M, D] carried over keys [lo, hi) with row i seeing keys
        up to ``lim`` [M] (the causal mask). A row that sees none of them keeps its state (also m = -inf)."""
        d = tl.arange(0, D)
        for t0 in tl.range(lo, hi, BLOCK_N, num_stages=1):     # mostly one tile: nothing to pipeline
            t = t0 + tl.arange(0, BLOCK_N)
            tm = t < hi
            page = tl.load(indices_ptr + start + t // P, mask=tm, other=0).to(tl.int64)
            off = page * s_page + kh * s_head + (t % P) * s_tok                       # [BLOCK_N]
            k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=tm[:, None], other=0.0).to(q.dtype)
            v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=tm[:, None], other=0.0).to(q.dtype)
            sc = tl.dot(q, tl.trans(k)) * qk_scale                                     # [M, BLOCK_N]
            sc = tl.where(tm[None, :] & (t[None, :] <= lim[:, None]), sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)        # no key yet: no NaN from -inf - -inf
            alpha = tl.exp2(m - m_use)
            p = tl.exp2(sc - m_use[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)                      # [M, D]
            m = m_new
        return m, l, acc

    # the step's sequence and block counts vary every step: no variant per value (1, multiples of 16)
    @triton.jit(do_not_specialize=["B", "NB"])
    def _extend_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, tab_ptr, indices_ptr, part_ptr, ml_ptr, count_ptr,
                       B, NB, sq_t, sq_h, so_t, so_h, s_page, s_head, s_tok, qk_scale, v_scale,
                       G: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                       NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr, DN: tl.constexpr, STAGES: tl.constexpr,
                       FP8: tl.constexpr, AHEAD: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr):
        kh = tl.program_id(0)
        s = tl.program_id(1)
        blk = tl.program_id(2)
        HKV = tl.num_programs(0)
        # tables (one host-to-device copy before the step): qo_indptr [B+1], kv_indptr [B+1], last [B],
        # the blocks' sequence [NB] and first chunk token [NB]
        b = tl.load(tab_ptr + 3 * B + 2 + blk)
        t0 = tl.load(tab_ptr + 3 * B + 2 + NB + blk)
        q0 = tl.load(tab_ptr + b)
        q_len = tl.load(tab_ptr + b + 1) - q0
        start = tl.load(tab_ptr + B + 1 + b)
        kv_len = (tl.load(tab_ptr + B + 2 + b) - start - 1) * P + tl.load(tab_ptr + 2 * B + 2 + b)
        base = kv_len - q_len                     # cached keys before the chunk
        seen = base + t0 + 1                      # keys [0, seen): visible to every row of the block
        chunk = tl.cdiv(tl.cdiv(seen, NSPLIT), BLOCK_N) * BLOCK_N                      # keys per split
        lo = s * chunk
        hi = tl.minimum(lo + chunk, seen)
        i = tl.arange(0, BM)
        tok = t0 + i // G
        valid = (i // G < BM // G) & (tok < q_len)
        d = tl.arange(0, D)
        if USE_PDL:
            pdl.gdc_wait()                  # q and this step's K/V are written by the kernel before
            pdl.gdc_launch_dependents()
        q = tl.load(q_ptr + (q0 + tok).to(tl.int64)[:, None] * sq_t + (kh * G + i % G)[:, None] * sq_h + d[None, :],
                    mask=valid[:, None], other=0.0)                                    # [BM, D]
        if FP8:             # e4m3 pages, fp16 products (bf16 q rounds to fp16)
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        m, l, acc = paged_softmax.attend_pages(q, kc_ptr, vc_ptr, indices_ptr, start, lo, hi, kh, s_page, s_head,
                                               s_tok, qk_scale, BM, D, P, BLOCK_N, STAGES, AHEAD, FP8, PTX,
                                               PAIRS=BM < 64)     # 64-row tiles: V widened (attend_pages)
        # the diagonal keys [seen, end): the last split's; row i sees keys up to base + tok
        end = tl.where(s == NSPLIT - 1, tl.minimum(kv_len, base + t0 + BM // G), seen)
        m, l, acc = _diagonal(q, m, l, acc, kc_ptr, vc_ptr, indices_ptr, start, seen, end, base + tok, kh,
                              s_page, s_head, s_tok, qk_scale, BM, D, P, DN)
        o_at = o_ptr + (q0 + tok).to(tl.int64)[:, None] * so_t + (kh * G + i % G)[:, None] * so_h + d[None, :]
        if NSPLIT == 1:
            tl.store(o_at, (acc * v_scale / l[:, None]).to(o_ptr.dtype.element_ty), mask=valid[:, None])
        else:
            pair = blk * HKV + kh
            cell = pair * NSPLIT + s
            tl.store(part_ptr + cell.to(tl.int64) * (BM * D) + i[:, None] * D + d[None, :], acc)
            tl.store(ml_ptr + cell * (2 * BM) + i, m)
            tl.store(ml_ptr + cell * (2 * BM) + BM + i, l)
            # every thread's partial stores, then one release/acquire increment (the decode kernel's
            # pattern): the split that sees NSPLIT - 1 arrived last and all partials are visible
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if arrived == NSPLIT - 1:
                sp = tl.arange(0, NSPLIT)
                mls = ml_ptr + (pair * NSPLIT + sp)[:, None] * (2 * BM) + i[None, :]
                ms = tl.load(mls, cache_modifier=".cg")                                # [NSPLIT, BM]
                mx = tl.max(ms, 0)                # finite: split 0 holds >= 1 key
                den = tl.sum(tl.exp2(ms - mx[None, :]) * tl.load(mls + BM, cache_modifier=".cg"), 0)
                out = tl.zeros([BM, D], tl.float32)
                for j in tl.static_range(NSPLIT):
                    cj = pair * NSPLIT + j
                    wj = tl.exp2(tl.load(ml_ptr + cj * (2 * BM) + i, cache_modifier=".cg") - mx)   # empty: 0
                    pj = tl.load(part_ptr + cj.to(tl.int64) * (BM * D) + i[:, None] * D + d[None, :],
                                 cache_modifier=".cg")                                 # [BM, D]
                    out += wj[:, None] * pj
                tl.store(o_at, (out * v_scale / den[:, None]).to(o_ptr.dtype.element_ty), mask=valid[:, None])
                tl.store(count_ptr + pair, 0)                                          # re-arm


class TritonExtendWrapper:
    """flashinfer-prefill-wrapper-shaped ``plan`` / ``run`` over the kernel (eager steps: the grid
    follows the plan's blocks). ``shape``: the launch shape (``ExtendShape``; its ``splits`` None picks
    ``num_splits`` at each plan)."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device: torch.device, shape: Optional[ExtendShape] = None) -> None:
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        if not supported(head_dim):
            raise ValueError(f"head_dim must be a power of 2 in [16, 256], got {head_dim}")
        self.hq, self.hkv, self.d, self.P = num_q_heads, num_kv_heads, head_dim, page_size
        self.group = num_q_heads // num_kv_heads
        self.shape = shape or ExtendShape()
        self.device = device
        # SM count sets the split count; a CPU device only occurs under the Triton interpreter (tests)
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
        self.scale = head_dim ** -0.5
        # tile rows: the shape's, at least the group's q heads (one chunk token a block)
        self.bm = max(self.shape.block_m, triton.next_power_of_2(self.group))
        self.tokens = self.bm // self.group             # chunk tokens a block
        self.staging = TableStaging(device)
        self.tab = self.indices = None
        self.part = torch.empty(0, dtype=torch.float32, device=device)
        self.ml = torch.empty(0, dtype=torch.float32, device=device)
        self.count = torch.zeros(0, dtype=torch.int32, device=device)
        self.planned: Optional[ExtendPlan] = None
        self.rows = self.batch = 0

    def plan(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any, last_page_len: Any) -> None:
        """Host qo_indptr [B+1] (chunk rows of each sequence), kv_indptr [B+1] / last_page_len [B] (its
        pages; the KV length includes the chunk's own tokens): lists, numpy arrays or CPU tensors;
        kv_indices [nnz] host, or a tensor already on the device (read in place)."""
        qo, kvp, last = (np.asarray(t, dtype=np.int64) for t in (qo_indptr, kv_indptr, last_page_len))
        B = len(last)
        if len(qo) != B + 1 or len(kvp) != B + 1:
            raise ValueError(f"qo_indptr and kv_indptr must hold {B + 1} entries (last_page_len has {B}), "
                             f"got {len(qo)} and {len(kvp)}")
        q_len, pages = qo[1:] - qo[:-1], kvp[1:] - kvp[:-1]
        kv_len = (pages - 1) * self.P + last
        bad = (q_len < 0) | (pages < 1) | (last < 1) | (last > self.P) | (kv_len < q_len)
        if B and (qo[0] != 0 or bad.any()):
            if qo[0] != 0 or (q_len < 0).any():
                raise ValueError(f"qo_indptr must start at 0 and not decrease, got {qo.tolist()}")
            raise ValueError("kv_indptr / last_page_len: every sequence needs >= 1 page, last_page_len in "
                             f"[1, {self.P}] and a KV length >= its chunk rows")
        seq, first, longest = plan_blocks(q_len, kv_len, self.tokens)
        splits = self.shape.splits or num_splits(len(seq) * self.hkv, longest, self.sms)
        if splits < 1 or splits > MAX_SPLITS or splits & (splits - 1):
            raise ValueError(f"splits must be a power of 2 in [1, {MAX_SPLITS}], got {splits}")
        self.planned = ExtendPlan(seq, first, splits)
        self.rows, self.batch = int(qo[-1]) if B else 0, B
        # one transfer: qo_indptr | kv_indptr | last | blocks' seq | blocks' first token [| host kv_indices]
        on_device = isinstance(kv_indices, torch.Tensor) and kv_indices.device == self.device
        nb, cut = len(seq), 3 * B + 2
        at = -(-(cut + 2 * nb) // 4) * 4     # host indices 16-byte aligned: the kernel's pointer specialization
        nnz = 0 if on_device else len(kv_indices)
        host = self.staging.host(at + nnz)
        host[: B + 1], host[B + 1: 2 * B + 2], host[2 * B + 2: cut] = qo, kvp, last
        host[cut: cut + nb], host[cut + nb: cut + 2 * nb] = seq, first
        if nnz:
            host[at:] = kv_indices
        self.tab = self.staging.send(len(host))
        self.indices = kv_indices if on_device else self.tab[at:]
        cells = nb * self.hkv * splits
        if splits > 1 and self.ml.numel() < cells * 2 * self.bm:
            self.part = torch.empty(2 * cells * self.bm * self.d, dtype=torch.float32, device=self.device)
            self.ml = torch.empty(4 * cells * self.bm, dtype=torch.float32, device=self.device)
        if splits > 1 and self.count.numel() < nb * self.hkv:
            self.count = torch.zeros(2 * nb * self.hkv, dtype=torch.int32, device=self.device)

    def run(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
            out: Optional[torch.Tensor] = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """q [N, Hq, D] (strided rows allowed; N = qo_indptr[-1]) -> o [N, Hq, D] over the planned tables
        (into ``out`` with unit stride over D when given). Pages HND [pages, Hkv, P, D] of q's dtype or e4m3
        (holding K / k_scale and V / v_scale: the scales multiply back in, as flashinfer's run() takes them)."""
        if self.planned is None:
            raise ValueError("run() needs plan() first")
        if q.dim() != 3 or tuple(q.shape) != (self.rows, self.hq, self.d) or q.stride(2) != 1:
            raise ValueError(f"q must be [{self.rows}, {self.hq}, {self.d}] with unit stride over D, "
                             f"got {tuple(q.shape)}")
        o = torch.empty((self.rows, self.hq, self.d), dtype=q.dtype, device=q.device) if out is None else out
        if tuple(o.shape) != tuple(q.shape) or o.stride(2) != 1:
            raise ValueError(f"out must be [{self.rows}, {self.hq}, {self.d}] with unit stride over D")
        nb, splits = len(self.planned.seq), self.planned.splits
        if nb:
            self.launch(q, kv_cache, o, self.tab, self.indices, self.batch, nb, nb, splits, k_scale, v_scale)
        return o

    def launch(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], o: torch.Tensor, tab: torch.Tensor,
               indices: torch.Tensor, batch: int, blocks: int, programs: int, splits: int,
               k_scale: float, v_scale: float) -> None:
        """The kernel over device tables ``tab`` (qo_indptr [batch+1] | kv_indptr [batch+1] | last [batch] |
        blocks' sequence [blocks] | first token [blocks]) and page ``indices``: grid (kv heads, ``splits``,
        ``programs`` <= blocks), q / o [N, Hq, D] rows as qo_indptr numbers them. ``run`` launches it over its
        plan; the piecewise graphs capture it over static tables (runtime/mixed_chunks.py)."""
        kc, vc = kv_cache
        sh, tokens = self.shape, self.tokens
        args = (q, kc, vc, o, tab, indices, self.part, self.ml, self.count, batch, blocks,
                q.stride(0), q.stride(1), o.stride(0), o.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
                self.scale * float(k_scale) * LOG2E, float(v_scale))
        pdl.launch(_extend_kernel, (self.hkv, splits, programs), args, q.device, G=self.group, BM=self.bm, D=self.d,
                   P=self.P, NSPLIT=splits, BLOCK_N=sh.block_n, DN=max(16, triton.next_power_of_2(tokens)),
                   STAGES=sh.stages, FP8=kc.element_size() == 1, AHEAD=sh.ahead, PTX=q.is_cuda, num_warps=sh.warps)
