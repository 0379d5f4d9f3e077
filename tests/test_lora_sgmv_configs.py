"""The LoRA slot kernels (``kernels/lora_sgmv.py``) at several tilings against ``lora_reference``,
under TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen when Triton loads).

Covered: 1 / 2 / 3 shards; shard bounds a column block straddles and bounds it never straddles
(the expand computes only the shards a block touches); empty slots and base rows; segments that
are not a multiple of BM; column groups of several blocks (the last one ragged); a shrink split over
K (atomic sums) and a shrink in one K block (stores); the baseline that computes every shard; fp32
and fp16 (the interpreter's tl.dot misreads bf16 operands, so bf16 runs in
``test_lora_kernels.py``'s GPU test, at every tiling of the sweep's baseline and the tables).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _segments(slot: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """perm / seg_start / seg_len of rows assigned to slots (-1: a base row)."""
    order = torch.argsort(slot, stable=True)
    perm = order[slot[order] >= 0].int()
    counts = torch.bincount(slot[slot >= 0], minlength=S).int()
    return (perm if perm.numel() else torch.zeros(1, dtype=torch.int32)), (torch.cumsum(counts, 0) - counts).int(), counts


def _cases() -> None:
    from nbgen.kernels.lora_sgmv import ExpandConfig, ShrinkConfig, lora_reference, lora_sgmv

    expand_cfgs = [ExpandConfig(),                                    # BN 64, one block per program
                   ExpandConfig(bm=32, bn=32, niter=3),               # groups of 3 blocks, ragged at the end
                   ExpandConfig(bm=64, bn=16, niter=2),
                   ExpandConfig(bn=32, all_shards=True)]              # the baseline: every shard, select
    shrink_cfgs = [ShrinkConfig(ksplit=64, bk=32), ShrinkConfig(bm=32, ksplit=1024)]   # split K | one K block
    g = torch.Generator().manual_seed(0)
    # (T, K, shard sizes, R, S): bounds 48 / 88 straddle 32-column blocks, 64 / 96 never do at BN <= 32;
    # segments of 1..40 rows (not multiples of BM); slot 2 of the first case has no row
    cases = ((40, 96, [48, 40], 8, 4), (23, 64, [64, 32, 32], 16, 3), (30, 80, [48, 40, 24], 4, 3),
             (9, 72, [80], 8, 2), (1, 64, [32, 16, 16], 8, 2))
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
        for i, (T, K, sizes, R, S) in enumerate(cases):
            nshard, N = len(sizes), sum(sizes)
            bounds = (sizes[0] if nshard > 1 else N, sizes[0] + sizes[1] if nshard > 2 else N)
            x = torch.randn(T, K, generator=g).to(dtype)
            a = (torch.randn(S, nshard * R, K, generator=g) * 0.1).to(dtype)
            b = (torch.randn(S, N, R, generator=g) * 0.3).to(dtype)
            sc = torch.rand(S, generator=g) * 2 + 0.5
            slot = torch.randint(-1, S, (T,), generator=g)
            if i == 0:
                slot[slot == 2] = 3                                      # an empty slot between full ones
            perm, start, counts = _segments(slot, S)
            y = torch.randn(T, N, generator=g).to(dtype)
            want = y.clone()
            lora_reference(x, want, a, b, sc, perm, start, counts, bounds, nshard)
            assert (want.float() - y.float()).abs().max() > 0.1 or not (slot >= 0).any()   # the adapters add something
            for j, ec in enumerate(expand_cfgs):
                got = y.clone()
                lora_sgmv(x, got, a, b, sc, perm, start, counts, bounds, nshard,
                          shrink_cfg=shrink_cfgs[j % 2], expand_cfg=ec)
                err = (got.float() - want.float()).abs().max().item()
                assert err <= tol * max(1.0, want.float().abs().max().item()), (dtype, i, ec, err)
                assert torch.equal(got[slot < 0], y[slot < 0])              # base rows untouched
    print("SGMV_CONFIGS_OK")


def test_sgmv_configs_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", "import tests.test_lora_sgmv_configs as t; t._cases()"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert "SGMV_CONFIGS_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_tables_cover_every_bucket() -> None:
    """Every (rows, width) bucket has a config; BN / BM are tl.dot-sized powers of two."""
    pytest.importorskip("triton")
    from nbgen.kernels import lora_sgmv as k

    for rows in (1, k.SMALL_ROWS, k.SMALL_ROWS + 1, 4096):
        for width in (896, k.WIDE_N - 1, k.WIDE_N, 28672):
            e, s = k.expand_config(rows, width), k.shrink_config(rows, width)
            for v in (e.bm, e.bn, s.bm, s.bk):
                assert v >= 16 and v & (v - 1) == 0
            assert e.niter >= 1 and s.ksplit >= s.bk and not e.all_shards
