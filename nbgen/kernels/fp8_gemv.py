"""The fp8 GEMV: 1-16 rows of x against a group-scaled e4m3 weight, built to stream the weight at copy
bandwidth (Triton, CUDA).

The arithmetic of ``nbgen.models.fp8_linear.reference_matmul``: each row of x is rounded to e4m3 per
128-column group with sx = max(amax, 1e-10) / 448; y = sum_k (xq * sx)[m, k] * (wq * sw)[n, k] in fp32,
rounded once (``kernels.fp8_gemm`` scales per-group sums instead: equal up to fp32 summation order).

Why a second kernel: at a few rows a linear is a weight read, and the tile kernel (one 128-column group
per loop step, rows padded to 16 for ``tl.dot``) keeps too few bytes in flight per SM to reach the copy
rate. Here a program owns BLOCK_N output features and walks its share of K in steps of GROUPS groups:
- each step is one [BLOCK_N, GROUPS, 128] e4m3 load (16-byte vectors, ``evict_first``), and the next
  step's tile is requested before the current one is used (a register double buffer), so a program
  has two steps' bytes in flight;
- products are FMAs on CUDA cores in fp32 (no padding to 16 rows): x's step (a few KB, re-read from
  L1/L2) is rounded to e4m3 per row and group in the kernel as the reference rounds it (IEEE division),
  then dequantized; the weight tile is converted and scaled per step; the products are summed in place
  over the steps and reduced across threads once, at the end (the work per weight byte grows with the
  rows: at 8-16 rows the tile kernel's tensor cores may win, which the table says per rows bucket);
- split-K fills the SMs where N / BLOCK_N programs are too few: ``GemvConfig.waves`` asks for at least
  that many programs per SM, and the splits of one tile either add into an fp32 buffer with atomics
  (zeroed before, cast after: two more launches) or write partials that the tile's last program to
  arrive sums (``reduce="last"``: one launch, counters re-armed by that program);
- launched as a programmatic dependent launch (``kernels.pdl``): the first weight tile loads before the
  wait for x, so the launch gap of a batch-1 step overlaps the previous kernel's tail.
``accumulate``: the result is added into an existing [M, N] tensor (a residual add, one rounding).
Which launch shape runs is the table ``CONFIGS`` (rows bucket -> GemvConfig, or None: that bucket takes
the tile kernel), filled from ``python -m nbgen.bench.fp8_kernels`` on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nbgen.kernels import pdl
from nbgen.kernels.fp8_gemm import GROUP

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

MAX_ROWS = 16          # rows of x up to which fp8 linears take this kernel
MAX_TILES = 1 << 16    # split-K counters per device (one per BLOCK_N tile of a launch)


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape of ``_fp8_gemv_kernel``."""

    block_n: int          # output features per program
    groups: int           # 128-column groups per loop step (a [block_n, groups, 128] e4m3 tile)
    waves: int            # split K until there are >= waves programs per SM (0: never split)
    reduce: str           # "last" (the last split of a tile sums the partials) or "atomic" (fp32 atomics)
    num_warps: int
    num_stages: int


# rows bucket (the smallest key >= M) -> config, None: the tile kernel (kernels/fp8_gemm.py). Starting
# points from the compiled code's work per weight byte (64 weight elements per thread and step, 8 KB
# per program and step at one row), not yet timed; replace with the sweep's winners
# (python -m nbgen.bench.fp8_kernels prints the table).
CONFIGS: dict[int, Optional[GemvConfig]] = {
    1: GemvConfig(block_n=16, groups=4, waves=4, reduce="last", num_warps=4, num_stages=1),
    2: GemvConfig(block_n=16, groups=2, waves=4, reduce="last", num_warps=4, num_stages=1),
    4: GemvConfig(block_n=16, groups=2, waves=4, reduce="last", num_warps=8, num_stages=1),
    8: None,
    16: None,
}


def pick_config(m: int) -> Optional[GemvConfig]:
    """The ``CONFIGS`` entry for ``m`` rows (m <= MAX_ROWS); None: the tile kernel serves ``m`` rows."""
    return CONFIGS[min(b for b in CONFIGS if b >= m)]


if triton is not None:
    @triton.jit
    def _w_tile(w_rows, sw_rows, it, it_hi, K, G, n_mask, GROUPS: tl.constexpr, GROUP_K: tl.constexpr):
        # step ``it``: weight [BLOCK_N, GROUPS, GROUP_K] e4m3 and scales [BLOCK_N, GROUPS]; zeros past K / G
        # and for it >= it_hi (nothing read: the prefetch after a split's last step)
        g = it * GROUPS + tl.arange(0, GROUPS)                                          # [GROUPS]
        kk = g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]                       # [GROUPS, GROUP_K]
        k_end = tl.where(it < it_hi, K, 0)
        g_end = tl.where(it < it_hi, G, 0)
        w = tl.load(w_rows[:, :, None] + kk[None, :, :], mask=n_mask[:, None, None] & (kk < k_end)[None, :, :],
                    other=0.0, eviction_policy="evict_first")
        sw = tl.load(sw_rows + g[None, :], mask=n_mask[:, None] & (g < g_end)[None, :], other=0.0)
        return w, sw

    @triton.jit
    def _x_step(x_ptr, it, M, K, stride_xm, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr):
        # x's rows, step it's columns, rounded to e4m3 per group as the reference rounds, then dequantized
        # (xq * sx, the reference's operand): [BLOCK_M, 1, GROUPS, GROUP_K] fp32, zeros for rows >= M
        rm = tl.arange(0, BLOCK_M)[:, None, None, None]
        kk = (it * GROUPS + tl.arange(0, GROUPS))[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
        kk = kk[None, None, :, :]
        x = tl.load(x_ptr + rm * stride_xm + kk, mask=kk < tl.where(rm < M, K, 0), other=0.0).to(tl.float32)
        sx = tl.div_rn(tl.maximum(tl.max(tl.abs(x), 3), 1e-10), 448.0)[:, :, :, None]   # [BLOCK_M, 1, GROUPS, 1]
        xq = tl.clamp(tl.div_rn(x, sx), -448.0, 448.0).to(tl.float8e4nv).to(tl.float32)
        return xq * sx

    # the split's sizes change with the shape: not specialized on (one compile per launch shape)
    @triton.jit(do_not_specialize=["n_split", "iters_per_split"])
    def _fp8_gemv_kernel(x_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, G,
                         n_split, iters_per_split, stride_xm, stride_wn, stride_swn, stride_ym,
                         HAS_BIAS: tl.constexpr, ACCUM: tl.constexpr, SPLIT: tl.constexpr,
                         ATOMIC: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        rm = tl.arange(0, BLOCK_M)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn                          # [BLOCK_N, 1]
        sw_rows = sw_ptr + rn[:, None] * stride_swn
        it_lo = pid_k * iters_per_split
        it_hi = tl.minimum(it_lo + iters_per_split, tl.cdiv(G, GROUPS))
        w, sw = _w_tile(w_rows, sw_rows, it_lo, it_hi, K, G, n_mask, GROUPS, GROUP_K)   # before the wait
        if USE_PDL:
            pdl.gdc_wait()                                   # x (and y when accumulating) come from before
        # products summed in place over the steps, [BLOCK_M, BLOCK_N, GROUPS, GROUP_K] fp32 (dequantized
        # weight times dequantized x, as the reference multiplies), one reduction at the end: the loop has
        # no cross-thread sums. Triton lays the loop out as x's tile: the e4m3 weight tile (not its fp32
        # copy) crosses shared memory once per step, each thread then holds every weight row for its columns
        acc4 = tl.zeros((BLOCK_M, BLOCK_N, GROUPS, GROUP_K), tl.float32)
        for it in range(it_lo, it_hi):
            # the next step's tile is requested now and used in the next iteration
            w_next, sw_next = _w_tile(w_rows, sw_rows, it + 1, it_hi, K, G, n_mask, GROUPS, GROUP_K)
            xd = _x_step(x_ptr, it, M, K, stride_xm, BLOCK_M, GROUPS, GROUP_K)   # [BLOCK_M, 1, GROUPS, GROUP_K]
            wd = w[None, :, :, :].to(tl.float32) * sw[None, :, :, None]          # [1, BLOCK_N, GROUPS, GROUP_K]
            acc4 = tl.fma(wd, xd, acc4)
            w, sw = w_next, sw_next
        acc = tl.sum(tl.sum(acc4, 3), 2)                                                # [BLOCK_M, BLOCK_N]
        if USE_PDL:
            pdl.gdc_launch_dependents()
        out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        mask = (rm < M)[:, None] & n_mask[None, :]
        if SPLIT and ATOMIC:                           # y is a zeroed fp32 buffer; bias added after
            tl.atomic_add(out, acc, mask=mask)
        else:
            last = True
            if SPLIT:                                        # partials [n_split, BLOCK_M, N]; the last one sums
                parts = part_ptr + rm[:, None] * N + rn[None, :]
                tl.store(parts + pid_k * BLOCK_M * N, acc, mask=mask)
                tl.debug_barrier()                           # all stores before the release below
                last = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == n_split - 1
                if last:
                    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                    for s in range(n_split):
                        acc += tl.load(parts + s * BLOCK_M * N, mask=mask, other=0.0, cache_modifier=".cg")
                    tl.store(count_ptr + pid_n, 0)           # re-arm for the next launch
            if last:
                if HAS_BIAS:
                    acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                if ACCUM:
                    acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
                tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


_counters: dict[torch.device, torch.Tensor] = {}   # device -> int32 [MAX_TILES], zero between launches
_sm_count: dict[torch.device, int] = {}


def usable(x: torch.Tensor) -> bool:
    """This kernel takes ``x``: Triton, CUDA, 2-D with 1..MAX_ROWS contiguous rows, and ``CONFIGS`` has
    a launch shape for its row count."""
    return (triton is not None and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.stride(1) == 1 and pick_config(x.shape[0]) is not None)


def split_for(n_tiles: int, iters: int, waves: int, sms: int) -> int:
    """How many programs share one tile's K steps: the fewest giving >= ``waves`` programs per SM (at most
    one step each; 1 when ``waves`` is 0 or the tiles alone are enough)."""
    if waves <= 0 or n_tiles >= waves * sms:
        return 1
    return max(1, min(iters, -(-waves * sms // n_tiles)))


def fp8_gemv(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
             out_dtype: torch.dtype, config: Optional[GemvConfig] = None,
             accumulate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (model dtype, M <= MAX_ROWS) @ wq [N, K].T with group scales sw [N, ceil(K / 128)] fp32
    -> [M, N] in ``out_dtype`` (+ bias); see the module docstring. ``accumulate``: a contiguous [M, N]
    tensor the result is added into and returned. Graph-capturable (no host sync)."""
    M, K = x.shape
    N = wq.shape[0]
    assert 0 < M <= MAX_ROWS and wq.shape[1] == K and wq.stride(1) == 1
    cfg = config or pick_config(M)
    assert cfg is not None, f"no GEMV launch shape for {M} rows (CONFIGS)"
    dev = x.device
    G = triton.cdiv(K, GROUP)
    iters = triton.cdiv(G, cfg.groups)
    n_tiles = triton.cdiv(N, cfg.block_n)
    if dev not in _sm_count:     # (132, an H100's, for the CPU interpreter the tests use)
        _sm_count[dev] = torch.cuda.get_device_properties(dev).multi_processor_count if x.is_cuda else 132
    split = split_for(n_tiles, iters, cfg.waves, _sm_count[dev])
    per_split = triton.cdiv(iters, split)
    split = triton.cdiv(iters, per_split)                # no split left without steps
    atomic = split > 1 and cfg.reduce == "atomic" and accumulate is None   # (adding into y: "last")
    bm = triton.next_power_of_2(M)
    if accumulate is not None:
        assert accumulate.shape == (M, N) and accumulate.stride(1) == 1
        y = accumulate
    elif atomic:
        y = torch.zeros((M, N), dtype=torch.float32, device=dev)
    else:
        y = torch.empty((M, N), dtype=out_dtype, device=dev)
    part = torch.empty((split, bm, N), dtype=torch.float32, device=dev) if split > 1 and not atomic else y
    if dev not in _counters:
        _counters[dev] = torch.zeros(MAX_TILES, dtype=torch.int32, device=dev)
    assert n_tiles <= MAX_TILES
    args = (x, wq, sw, bias if bias is not None else sw, y, part, _counters[dev], M, N, K, G, split, per_split,
            x.stride(0), wq.stride(0), sw.stride(0), y.stride(0))
    pdl.launch(_fp8_gemv_kernel, (n_tiles, split), args, dev, HAS_BIAS=bias is not None and not atomic,
               ACCUM=accumulate is not None, SPLIT=split > 1, ATOMIC=atomic, BLOCK_M=bm, BLOCK_N=cfg.block_n,
               GROUPS=cfg.groups, GROUP_K=GROUP, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if atomic:
        y = y + bias.float() if bias is not None else y
        return y.to(out_dtype)
    return y
