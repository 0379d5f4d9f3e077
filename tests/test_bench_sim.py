"""The schedule cost model (nbgen.bench.sim): the real scheduler's trace and the pricing, by hand."""
from __future__ import annotations

import random

import pytest

from nbgen.bench.floor import floor_seconds
from nbgen.bench.sim import CostModel, StepShape, main, price, trace


def _workload(k: int = 12) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(5, 60))] for _ in range(k)]
    return prompts, [rng.randint(1, 40) for _ in range(k)]


@pytest.mark.parametrize("policy", ["fcfs", "lof"])
def test_trace_computes_every_token_and_reads_the_floors_kv(policy: str) -> None:
    prompts, outs = _workload()
    steps = trace(prompts, outs, policy, budget=64)
    # each request: its prompt, then one row per output token after the first (which prefill samples)
    assert sum(s.rows for s in steps) == sum(len(p) + o - 1 for p, o in zip(prompts, outs))
    assert sum(s.sampled for s in steps) == sum(outs)
    # the decode rows read exactly the KV the floor counts (bench_floor: step j reads in_i + j tokens)
    ins = [len(p) for p in prompts]
    assert sum(s.decode_kv for s in steps) == round(floor_seconds(ins, outs, 0, 1, 1.0))
    assert len(steps) >= max(outs)
    assert all(s.rows <= 64 and s.padded_rows >= s.rows for s in steps)
    # prefill attention: every prompt token attends to itself and the tokens before it
    assert sum(s.prefill_pairs for s in steps) == sum(n * (n + 1) // 2 for n in ins)


def test_price_by_hand() -> None:
    m = CostModel(gemm_points=((10, 1.0), (110, 3.0)), bandwidth=100.0, matmul_rate=1000.0, kv_bytes_per_token=2,
                  layer_weight_bytes=400.0, lm_head_bytes=50.0, attn_flops_per_pair=10.0, per_step_s=0.5, per_row_s=0.25)
    assert m.gemm_seconds(5) == 1.0                      # below the table: its first point
    assert m.gemm_seconds(60) == pytest.approx(2.0)      # interpolated
    assert m.gemm_seconds(220) == pytest.approx(6.0)     # beyond: the last point's time per row
    s = StepShape(rows=60, padded_rows=60, decode_kv=100, prefill_pairs=30, sampled=4)
    # gemm 2.0; attention 100 x 2 / 100 + 30 x 10 / 1000; head max(50 / 100, 4 x 50 / 1000); other 0.5 + 15
    want = {"gemm": 2.0, "attention": 2.3, "lm_head": 0.5, "other": 15.5}
    got = price([s, s], m)
    assert got == pytest.approx({**{k: 2 * v for k, v in want.items()}, "total": 2 * sum(want.values())})
    ideal = CostModel(bandwidth=100.0, layer_weight_bytes=400.0, ideal_gemm_rate=8000.0)
    assert ideal.gemm_seconds(10) == 4.0                 # the weight read: 400 B at 100 B/s
    assert ideal.gemm_seconds(100) == pytest.approx(5.0)  # compute: 100 rows x 400 FLOPs / 8000


def test_cli_prints_each_budget(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--workload", "nano", "--schedule-policy", "lof", "--chunked-prefill-size", "8192,384"])
    out = capsys.readouterr().out
    assert [r["budget"] for r in rows] == [8192, 384] and "% floor" in out
    assert all(r["total"] > r["floor"] > 0 for r in rows)
    assert rows[0]["steps"] >= 1023 and rows[1]["gemm"] < rows[0]["gemm"]   # nano's longest output is 1 024
