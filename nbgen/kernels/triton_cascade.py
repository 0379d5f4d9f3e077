"""Shared-prefix (cascade) decode attention for CUDA-graph decode steps: rows whose page tables start
with the same pages (a common prompt prefix from the prefix cache) read those pages once per step.

Two launches per layer, both inside the decode graph of the step's batch size:
  * level 0 (``_shared_kernel``): program (kv head, split, chunk) loads its split of the chunk's
    shared pages tile by tile, once, and runs them against all the chunk's query rows x the kv head's
    q heads as one tensor-core tile (``TILE_ROWS`` q rows, no causal mask: every row sees the whole
    prefix), writing a partial softmax state (m, l, acc) per q row;
  * level 1: nbgen's split-KV decode kernel (kernels/triton_decode.py) over each row's pages after its
    chunk's shared ones, which folds the row's ``SPLITS`` level-0 partials into its own state before
    the one normalisation and rounding (``paged_softmax.fold_shared``).
Why this shape: the plain kernel reads a 2,000-token prefix once per row (256 rows: 256 times a step);
here it is read once per chunk, and the merge costs no launch and no second rounding. Everything is
fixed-size for the graphs: ``max_chunks`` chunks of up to ``rows_per_chunk`` rows (TILE_ROWS // group),
a fixed split count; the tables (attention/cascade_plan.py) are int32 views of the graph runner's input
buffer, written with the step's other inputs; chunks past the step's count exit at once.
fp8 pages: widened to fp16 in registers (q rounded to fp16), level 1 as the decode kernel reads them (V
as byte pairs), level 0 with V widened as K (``paged_softmax.attend_pages``); scales folded as the
decode kernel folds them (K scale into the softmax scale, V scale into level 1's output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nbgen.kernels import paged_softmax, pdl
from nbgen.kernels.triton_decode import FP8_STAGES, LOG2E, STAGES, Cascade, TritonDecodeWrapper

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton never build this wrapper
    triton = None

TILE_ROWS = 64      # q rows of a level-0 tile: a chunk's rows x the kv head's q heads
SPLITS = 8          # the most level-0 programs per (chunk, kv head) the scratch holds
MIN_SPLIT = 128     # tokens: shorter shared runs take fewer, longer splits (the rest hold no tokens)


def rows_per_chunk(group: int) -> int:
    """Query rows a level-0 tile holds for q/kv head ratio ``group``."""
    return max(1, TILE_ROWS // group)


@dataclass(frozen=True)
class Level0:
    """Level 0's launch shape: programs per (chunk, kv head), KV tokens per tile, warps, pipeline stages
    (None: the decode kernel's for the page dtype)."""

    splits: int
    block_n: int
    warps: int = 4
    stages: Optional[int] = None
    ahead: bool = False             # page numbers one tile ahead (paged_softmax.attend_pages)


def level0_for(bs: int, head_dim: int) -> Level0:
    """The launch shape at any graph batch size: 2 splits of 64-token tiles (32 above head size 128),
    3 stages, page numbers ahead: about one program per (chunk, kv head) pair and SM, so that level 1,
    started beside it (``Level1.early``), keeps most of each SM and streams while level 0 waits on its
    loads. H100, Qwen3-0.6B heads at W-prefix's shape, both levels from a CUDA graph
    (``python -m nbgen.bench.cascade_kernel``, us at 256 / 128 / 32 rows): this shape 187 / 115 / 55
    (level 0 alone 29 us, 2.2 TB/s); 2 stages 191 / 119 / 55; 4 splits of 32-token tiles 232 / 142 / 58;
    8 splits 336 / 195 / 64; 16 splits 515 / 291 / 77: more level-0 programs crowd level 1 out."""
    return Level0(2, 64 if head_dim <= 128 else 32, 4, 3, ahead=True)


@dataclass(frozen=True)
class Level1:
    """Level 1's launch shape over the rows' own pages (None: the decode kernel's choice for the batch):
    KV tokens per tile, warps, tiles in flight, splits per (row, kv head), page numbers ahead."""

    block_n: Optional[int] = None
    warps: int = 4
    stages: Optional[int] = None
    splits: Optional[int] = None
    ahead: bool = False             # page numbers one tile ahead (paged_softmax.attend_pages)
    early: bool = False             # under PDL: run beside level 0, wait for it only before the fold


def level1_for(bs: int, head_dim: int, group: int = 1) -> Level1:
    """Level 1's launch shape at graph batch size ``bs`` for q/kv head ratio ``group``: page numbers
    ahead, and ``early``: it streams its own pages while level 0 runs (under PDL) and waits for level 0
    only before the fold. Up to 2 q heads a kv head and head size 128: one warp a program on 32-token
    tiles with 4 stages (a program's tile needs no exchange between warps; 53 KB of shared memory);
    otherwise 4 warps on 64-token tiles with 3 stages where a row is one split (from 96 rows), 32-token
    tiles with 4 stages below (tiles halved above head size 128; one warp spills registers there). H100,
    Qwen3-0.6B heads at W-prefix's shape, level 1 alone from a CUDA graph (us at 256 / 128 / 32 rows):
    1 warp x 32 tokens x 4 stages 151 / 79 / 23 (3.0 TB/s at 256 rows), 4 warps x 64 x 3 156 / 84 / 25,
    4 x 32 x 4 157 / 85 / 24; early start saves 10 / 10 / 12 us of both levels."""
    if head_dim <= 128 and group <= 2:
        return Level1(32, 1, 4, ahead=True, early=True)
    if bs >= 96:
        return Level1(64 if head_dim <= 128 else 32, 4, 3, ahead=True, early=True)
    return Level1(32 if head_dim <= 128 else 16, 4, 4, ahead=True, early=True)


if triton is not None:
    @triton.jit
    def _shared_kernel(q_ptr, kc_ptr, vc_ptr, indices_ptr, cstart_ptr, cpages_ptr, clen_ptr, crows_ptr,
                       part_ptr, ml_ptr, sq_t, sq_h, s_page, s_head, s_tok, qk_scale,
                       G: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                       S0: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                       FP8: tl.constexpr, AHEAD: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr):
        kh = tl.program_id(0)
        s = tl.program_id(1)
        c = tl.program_id(2)
        HKV = tl.num_programs(0)
        n = tl.load(clen_ptr + c)                 # rows of this chunk this step (0: no chunk)
        if USE_PDL:
            pdl.gdc_wait()                        # q and this step's K/V are written by the kernel before
            pdl.gdc_launch_dependents()
        if n > 0:
            start = tl.load(cstart_ptr + c)
            kv_len = tl.load(cpages_ptr + c) * P  # shared pages are full
            chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_len, S0), BLOCK_N) * BLOCK_N, MIN_SPLIT)
            lo = s * chunk
            hi = tl.minimum(lo + chunk, kv_len)
            i = tl.arange(0, BM)                  # tile row i: the chunk's row i // G, q head kh * G + i % G
            valid = i // G < n
            row = tl.load(crows_ptr + c * R + i // G, mask=valid, other=0)
            d = tl.arange(0, D)
            q = tl.load(q_ptr + row.to(tl.int64)[:, None] * sq_t + (kh * G + i % G)[:, None] * sq_h + d[None, :],
                        mask=valid[:, None], other=0.0)                                # [BM, D]
            if FP8:
                q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            m, l, acc = paged_softmax.attend_pages(q, kc_ptr, vc_ptr, indices_ptr, start, lo, hi, kh, s_page, s_head,
                                                   s_tok, qk_scale, BM, D, P, BLOCK_N, STAGES, AHEAD, FP8, PTX,
                                                   PAIRS=False)
            # an empty split (lo >= hi) stores m = -inf, l = 0, acc = 0: level 1 weighs it 0
            cell = (c * HKV + kh) * S0 + s
            tl.store(part_ptr + cell.to(tl.int64) * (BM * D) + i[:, None] * D + d[None, :], acc)
            tl.store(ml_ptr + cell * (2 * BM) + i, m)
            tl.store(ml_ptr + cell * (2 * BM) + BM + i, l)


class SharedScratch:
    """The level-0 partials every batch size's cascade wrapper writes (graphs replay one at a time)."""

    def __init__(self, num_kv_heads: int, head_dim: int, max_chunks: int, device: torch.device,
                 splits: int = SPLITS) -> None:
        # partials of [max_chunks, Hkv, splits] cells: acc [TILE_ROWS, D], then (m, l) [2, TILE_ROWS]
        cells = max_chunks * num_kv_heads * splits
        self.max_chunks, self.splits = max_chunks, splits
        self.part = torch.empty(cells * TILE_ROWS * head_dim, dtype=torch.float32, device=device)
        self.ml = torch.empty(cells * 2 * TILE_ROWS, dtype=torch.float32, device=device)


class CascadeDecodeWrapper(TritonDecodeWrapper):
    """A decode graph's Triton wrapper (its page-table buffers) plus the shared-prefix tables: ``run``
    launches level 0, then the decode kernel as level 1 with the merge."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, device: torch.device,
                 indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, order: torch.Tensor,
                 rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                 scratch: SharedScratch, level0: Optional[Level0] = None, level1: Optional[Level1] = None) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, page_size, device, indptr, indices, last, order)
        self.rows = rows              # per row [bs] int32: skip pages, chunk (-1: none), slot in the chunk
        self.chunks = chunks          # per chunk [max_chunks] int32: start in indices, pages, rows; rows [C, R]
        self.scratch = scratch
        self.r = rows_per_chunk(self.group)
        self.level0 = level0 or level0_for(self.pad(last.numel()), head_dim)
        self.level1 = level1 or level1_for(self.pad(last.numel()), head_dim, self.group)
        sp = self.level0.splits
        assert sp <= scratch.splits and sp & (sp - 1) == 0, "level-0 splits: a power of 2 the scratch holds"

    def run(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
            out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
            cascade: Cascade | None = None) -> torch.Tensor:
        """q [B, Hq, D] -> o [B, Hq, D]: level 0 over the chunks' shared pages, level 1 over the rest."""
        self.run_level0(q, kv_cache, k_scale)
        return self.run_level1(q, kv_cache, out, k_scale, v_scale)

    def run_level0(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], k_scale: float = 1.0) -> None:
        """Level 0: each chunk's shared pages against its rows, partials into the scratch."""
        kc, vc = kv_cache
        fp8 = kc.element_size() == 1
        cstart, cpages, clen, crows = self.chunks
        sc, lv = self.scratch, self.level0
        stages = lv.stages or (FP8_STAGES if fp8 else STAGES)
        args = (q, kc, vc, self.indices, cstart, cpages, clen, crows, sc.part, sc.ml, q.stride(0), q.stride(1),
                kc.stride(0), kc.stride(1), kc.stride(2), self.scale * float(k_scale) * LOG2E)
        pdl.launch(_shared_kernel, (self.hkv, lv.splits, sc.max_chunks), args, q.device, G=self.group, R=self.r,
                   BM=TILE_ROWS, D=self.d, P=self.P, S0=lv.splits, MIN_SPLIT=MIN_SPLIT, BLOCK_N=lv.block_n,
                   STAGES=stages, FP8=fp8, AHEAD=lv.ahead, PTX=q.is_cuda, num_warps=lv.warps)

    def run_level1(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Level 1: the decode kernel over each row's own pages, folding in its chunk's partials."""
        skip, chunk, slot = self.rows
        sc, lv = self.scratch, self.level1
        return super().run(q, kv_cache, out, k_scale, v_scale,
                           Cascade(skip, chunk, slot, sc.part, sc.ml, self.level0.splits, TILE_ROWS,
                                   lv.block_n, lv.warps, lv.stages, lv.splits, lv.early, lv.ahead))
