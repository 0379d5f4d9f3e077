"""Segmented LoRA matmuls (Punica's SGMV, S-LoRA): one Triton kernel pair over a step's rows grouped
by adapter slot, adding each row's low-rank product into a fused linear's output in place.

Adapter weights sit in a slot pool (``runtime/lora_slots.py``): per fused linear, A of every slot
stacked as [S, NSHARD * R, K] (shard k's rank rows at k*R, zero-padded to the pool's rank R) and B as
[S, N, R] (each output column's rank row, of its own shard). A step names its rows by slot: ``perm``
holds the row indices grouped by slot, slot s owning ``perm[seg_start[s] : seg_start[s] + seg_len[s]]``
(base-model rows are in no segment). The grid's first axis numbers the step's row blocks of BM rows,
slot after slot (each program finds its slot from ``seg_len``); its size is a bound from the step's
row count, so the index tensors can be static buffers filled before a CUDA-graph replay, and
programs past the last block return at once. The shrink's second axis splits K (memory-bound: a
few rows against every slot's A), the expand's splits N.

- shrink: t[r, :] = x[r, :] @ A[s].T                                 (t [T, NSHARD * R], fp32 sums)
- expand: y[r, n] += scaling[s] * t[r, shard(n)*R : shard(n)*R + R] @ B[s, n, :]
  with shard(n) = (n >= b1) + (n >= b2) for fused q|k|v (b1, b2 the shard bounds) or gate|up.

The base GEMM is untouched: ``y`` is its output. ``lora_reference`` is the same math in torch.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                      # pragma: no cover - triton ships with torch on Linux
    triton = None

BM = 16          # rows per program (tl.dot's minimum)
BK = 64          # shrink: K per inner iteration
KSPLIT = 256     # shrink: K per program at least (split-K: the K blocks are a grid axis)
BN = 64          # expand: output columns per program


def available() -> bool:
    """Triton is importable (the kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1)."""
    return triton is not None


if triton is not None:
    @triton.jit
    def _block(len_ptr, S, BM: tl.constexpr, SP: tl.constexpr):
        """Program id -> (slot, first row in its segment, rows of the segment); slot == S when the
        program has no rows. Row blocks are numbered slot after slot (cdiv(len_s, BM) each), so the
        grid only needs as many programs as the step has row blocks, not S x the longest segment."""
        b = tl.program_id(0)
        offs = tl.arange(0, SP)
        lens = tl.load(len_ptr + offs, mask=offs < S, other=0)
        nblk = (lens + BM - 1) // BM
        ends = tl.cumsum(nblk, 0)                                   # [SP] blocks up to slot s, inclusive
        s = tl.sum((ends <= b).to(tl.int32), 0)                     # the slot whose blocks hold b
        first = tl.sum(tl.where(offs == s, ends - nblk, 0), 0)
        n = tl.sum(tl.where(offs == s, lens, 0), 0)
        return s, (b - first) * BM, n

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, t_ptr, perm_ptr, start_ptr, len_ptr, S, K, NR,
                       stride_x, stride_as, stride_ar, stride_t,
                       BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, KSPLIT: tl.constexpr,
                       SP: tl.constexpr, PREC: tl.constexpr):
        s, m0, n = _block(len_ptr, S, BM, SP)
        if s < S:
            k_lo = tl.program_id(1) * KSPLIT
            start = tl.load(start_ptr + s)
            offs_m = m0 + tl.arange(0, BM)
            mmask = offs_m < n
            rows = tl.load(perm_ptr + start + offs_m, mask=mmask, other=0).to(tl.int64)
            offs_r = tl.arange(0, BR)
            rmask = offs_r < NR
            a_base = a_ptr + s.to(tl.int64) * stride_as
            acc = tl.zeros((BM, BR), dtype=tl.float32)
            for kk in range(0, KSPLIT, BK):
                offs_k = k_lo + kk + tl.arange(0, BK)
                kmask = offs_k < K
                xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                             mask=mmask[:, None] & kmask[None, :], other=0.0)          # [BM, BK]
                at = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                             mask=rmask[None, :] & kmask[:, None], other=0.0)          # [BK, BR]
                acc += tl.dot(xt, at, input_precision=PREC)
            # this K block's partial sums into the zeroed fp32 t
            tl.atomic_add(t_ptr + rows[:, None] * stride_t + offs_r[None, :], acc,
                          mask=mmask[:, None] & rmask[None, :], sem="relaxed")   # sums: no ordering needed

    @triton.jit
    def _expand_kernel(t_ptr, b_ptr, y_ptr, perm_ptr, start_ptr, len_ptr, scale_ptr, S, N, R, B1, B2,
                       stride_t, stride_bs, stride_bn, stride_y,
                       NSHARD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                       SP: tl.constexpr, PREC: tl.constexpr):
        s, m0, n = _block(len_ptr, S, BM, SP)
        if s < S:
            nb = tl.program_id(1)
            start = tl.load(start_ptr + s)
            offs_m = m0 + tl.arange(0, BM)
            mmask = offs_m < n
            rows = tl.load(perm_ptr + start + offs_m, mask=mmask, other=0).to(tl.int64)
            offs_n = nb * BN + tl.arange(0, BN)
            nmask = offs_n < N
            offs_r = tl.arange(0, BR)
            rmask = offs_r < R
            bt = tl.load(b_ptr + s.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                         mask=rmask[:, None] & nmask[None, :], other=0.0)              # [BR, BN]
            shard = (offs_n >= B1).to(tl.int32) + (offs_n >= B2).to(tl.int32)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in tl.static_range(NSHARD):
                # t rounded to the model dtype, as a t of that dtype would be
                tk = tl.load(t_ptr + rows[:, None] * stride_t + (k * R + offs_r)[None, :],
                             mask=mmask[:, None] & rmask[None, :], other=0.0).to(b_ptr.dtype.element_ty)
                d = tl.dot(tk, bt, input_precision=PREC)
                acc = tl.where((shard == k)[None, :], d, acc)
            scale = tl.load(scale_ptr + s)
            ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
            ymask = mmask[:, None] & nmask[None, :]
            y = tl.load(ptrs, mask=ymask, other=0.0).to(tl.float32)
            tl.store(ptrs, (y + acc * scale).to(y_ptr.dtype.element_ty), mask=ymask)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def row_blocks(rows: int, slots: int, max_rows: int) -> int:
    """Programs per grid column: an upper bound on the step's row blocks (sum over slots of
    cdiv(len_s, BM)) from its row count ``rows`` and the longest segment ``max_rows``."""
    return min(triton.cdiv(rows, BM) + slots - 1, slots * triton.cdiv(max_rows, BM))


def k_split(K: int, nblk: int) -> int:
    """K per shrink program: ``KSPLIT``, doubled while the grid would pass ~1024 programs (a prefill
    step's many row blocks fill the GPU with fewer K blocks, and add fewer partial sums)."""
    ks = KSPLIT
    while nblk * triton.cdiv(K, ks) > 1024 and ks < K:
        ks *= 2
    return ks


def lora_sgmv(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
              perm: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor, bounds: tuple[int, int],
              nshard: int, max_rows: Optional[int] = None) -> None:
    """y[T, N] += per-slot LoRA of x[T, K] (in place). a [S, nshard*R, K], b [S, N, R], scaling [S] fp32;
    perm / seg_start / seg_len int32 (module docstring); ``bounds``: (b1, b2) shard bounds of N;
    ``max_rows``: rows a slot may hold this step (default T). Graph-capturable: no host reads.

    The shrink splits K over the grid (partial sums added atomically into an fp32 t, so its last
    bits may differ from run to run); the expand rounds t to the model dtype."""
    T, K = x.shape
    S, NR, _ = a.shape
    R = b.shape[2]
    N = y.shape[1]
    rows = T if max_rows is None else max_rows
    if T == 0 or rows == 0:
        return
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    t = torch.zeros(T, NR, dtype=torch.float32, device=x.device)      # [T, nshard*R] the shrink's sums
    nblk = row_blocks(T, S, rows)
    sp = max(16, triton.next_power_of_2(S))        # the slots' lengths as one vector
    ks = k_split(K, nblk)
    _shrink_kernel[(nblk, triton.cdiv(K, ks))](x, a, t, perm, seg_start, seg_len, S, K, NR,
                                               x.stride(0), a.stride(0), a.stride(1), t.stride(0),
                                               BM=BM, BR=_pow2(NR), BK=BK, KSPLIT=ks, SP=sp, PREC=prec)
    _expand_kernel[(nblk, triton.cdiv(N, BN))](t, b, y, perm, seg_start, seg_len, scaling, S, N, R,
                                               bounds[0], bounds[1], t.stride(0), b.stride(0), b.stride(1),
                                               y.stride(0), NSHARD=nshard, BM=BM, BN=BN, BR=_pow2(R), SP=sp,
                                               PREC=prec)


def lora_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                   perm: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor, bounds: tuple[int, int],
                   nshard: int) -> None:
    """``lora_sgmv`` in torch (fp32 accumulation, the same roundings of t and y), for tests."""
    R, N = b.shape[2], y.shape[1]
    shard = (torch.arange(N, device=y.device) >= bounds[0]).long() + (torch.arange(N, device=y.device) >= bounds[1]).long()
    for s in range(a.shape[0]):
        lo, n = int(seg_start[s]), int(seg_len[s])
        if n == 0:
            continue
        rows = perm[lo:lo + n].long()
        t = (x[rows].float() @ a[s].float().t()).to(x.dtype).float()           # [n, nshard*R]
        full = torch.zeros(n, N, dtype=torch.float32, device=y.device)
        for k in range(nshard):
            cols = shard == k
            full[:, cols] = t[:, k * R:(k + 1) * R] @ b[s][cols].float().t()
        y[rows] = (y[rows].float() + full * scaling[s].float()).to(y.dtype)
