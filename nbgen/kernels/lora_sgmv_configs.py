"""Launch configs of the LoRA slot kernels (``kernels/lora_sgmv.py``): the shrink's and the expand's
tilings, warps and pipeline stages, and the tables that pick them by a step's row count and a
linear's width.

The tables are keyed by (rows bucket, width bucket): ``rows_bucket`` puts a step of at most
``SMALL_ROWS`` rows in "small" (decode of a few requests), up to ``LARGE_ROWS`` in "large" (decode
batches) and above in "prefill" (the piecewise prefill graphs' token buckets, eager prefill steps);
the expand's width bucket is "wide" from ``WIDE_N`` output columns (gate|up), the shrink's "deep"
from ``DEEP_K`` input columns (down_proj). ``python -m nbgen.bench.lora --kernels --sweep --rows ...``
times the candidates on a GPU per bucket the row counts fall in and prints the winners in the
tables' syntax.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShrinkConfig:
    """The shrink's tiling: BM rows per program, BK of K per inner step, ``ksplit`` K per program at
    least (doubled while the grid passes ~1024 programs); launch warps and pipeline stages."""

    bm: int = 16
    bk: int = 64
    ksplit: int = 256
    warps: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        _check_tiles(self, ("bm", "bk"))
        if self.ksplit % self.bk:        # a K block must end where the next program's begins
            raise ValueError(f"ksplit ({self.ksplit}) must be a multiple of bk ({self.bk})")


@dataclass(frozen=True)
class ExpandConfig:
    """The expand's tiling: BM rows x BN columns per block, ``niter`` column blocks per program (a
    loop: the slot lookup and row indices once per program); ``all_shards``: every block computes
    every shard's product and selects per column (the first kernel's way, kept as the sweep's baseline)."""

    bm: int = 16
    bn: int = 64
    niter: int = 1
    warps: int = 4
    stages: int = 3
    all_shards: bool = False

    def __post_init__(self) -> None:
        _check_tiles(self, ("bm", "bn"))
        if self.niter < 1:
            raise ValueError(f"niter must be at least 1, got {self.niter}")


def _check_tiles(cfg: object, names: tuple[str, ...]) -> None:
    """Tile sizes are powers of two of at least 16 (tl.arange, tl.dot)."""
    for name in names:
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")


SMALL_ROWS = 64      # a step of at most this many rows uses the "small" configs (decode of few requests)
LARGE_ROWS = 1024    # above SMALL_ROWS up to this: "large" (decode batches); above: "prefill" (prefill buckets)
WIDE_N = 16384       # expand: a linear this wide or wider is "wide" (gate|up)
DEEP_K = 8192        # shrink: an input this long or longer is "deep" (down_proj)

# (rows bucket, width bucket) -> config; edit from the sweep's output (``--rows`` picks the buckets:
# e.g. 8,32 -> "small", 256 -> "large", 4096 -> "prefill"). The "prefill" rows are the large ones'
# configs until swept.
SHRINK_TABLE: dict[tuple[str, str], ShrinkConfig] = {
    ("small", "narrow"): ShrinkConfig(bm=16, bk=128, ksplit=256, warps=4, stages=3),    # H200 sweep, 8 and 32 rows
    ("small", "deep"): ShrinkConfig(bm=16, bk=128, ksplit=256, warps=4, stages=2),
    ("large", "narrow"): ShrinkConfig(bm=16, bk=64, ksplit=256, warps=4, stages=3),     # H200 sweep, 256 rows
    ("large", "deep"): ShrinkConfig(bm=32, bk=64, ksplit=256, warps=4, stages=2),
    ("prefill", "narrow"): ShrinkConfig(bm=16, bk=64, ksplit=256, warps=4, stages=3),
    ("prefill", "deep"): ShrinkConfig(bm=32, bk=64, ksplit=256, warps=4, stages=2),
}
EXPAND_TABLE: dict[tuple[str, str], ExpandConfig] = {
    ("small", "narrow"): ExpandConfig(bm=16, bn=128, niter=1, warps=4, stages=3),        # H200 sweep, 8 and 32 rows
    ("small", "wide"): ExpandConfig(bm=16, bn=256, niter=2, warps=4, stages=2),
    ("large", "narrow"): ExpandConfig(bm=16, bn=128, niter=1, warps=4, stages=2),        # H200 sweep, 256 rows
    ("large", "wide"): ExpandConfig(bm=32, bn=128, niter=1, warps=4, stages=2),
    ("prefill", "narrow"): ExpandConfig(bm=16, bn=128, niter=1, warps=4, stages=2),
    ("prefill", "wide"): ExpandConfig(bm=32, bn=128, niter=1, warps=4, stages=2),
}


def rows_bucket(rows: int) -> str:
    """The tables' rows bucket of a step of ``rows`` rows: "small", "large" or "prefill"."""
    return "small" if rows <= SMALL_ROWS else "large" if rows <= LARGE_ROWS else "prefill"


def shrink_config(rows: int, K: int) -> ShrinkConfig:
    """The table's shrink config for a step of ``rows`` rows over an input of K."""
    return SHRINK_TABLE[(rows_bucket(rows), "deep" if K >= DEEP_K else "narrow")]


def expand_config(rows: int, N: int) -> ExpandConfig:
    """The table's expand config for a step of ``rows`` rows into an output of N columns."""
    return EXPAND_TABLE[(rows_bucket(rows), "wide" if N >= WIDE_N else "narrow")]
