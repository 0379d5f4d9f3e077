"""bench/gpu_gaps.py on hand-built traces: idle windows, the largest gaps and the host events beside them."""
from __future__ import annotations

import pytest

from nbgen.bench.gpu_gaps import gap_report, idle_between, loop_tid, merge


def test_merge_and_idle_between() -> None:
    busy = merge([(10, 20), (15, 30), (40, 50), (0, 5)])
    assert busy == [(0, 5), (10, 30), (40, 50)]
    assert idle_between(busy, 0, 60) == [(5, 10), (30, 40), (50, 60)]
    assert idle_between(busy, 12, 45) == [(30, 40)]
    assert idle_between([], 3, 7) == [(3, 7)]


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_gap_report_windows_and_host_events() -> None:
    ev = [_x("user_annotation", "nbgen::vision_tower", 0, 100),
          _x("kernel", "gemm", 1000, 1000, tid=7),
          _x("cuda_runtime", "cudaHostAlloc", 2100, 2800),        # the host inside the 3 ms gap
          _x("cpu_op", "aten::cat", 2000, 3500),
          _x("cpu_op", "aten::mm", 2000, 3500, tid=2),           # another thread: not reported
          _x("kernel", "gemm", 5000, 1000, tid=7),
          _x("kernel", "gemm", 6500, 1000, tid=7)]               # a 0.5 ms gap: under the 1 ms floor
    assert loop_tid(ev, "nbgen::vision_tower") == 1
    rep = gap_report(ev, {"start": (0, 1000), "steps": (1000, 7500)}, 1, 0)
    assert rep["idle_s_by_window"] == pytest.approx({"start": 1e-3, "steps": 3.5e-3})
    assert rep["gaps_over_min"] == 2 and rep["gaps_over_min_s"] == pytest.approx(4e-3)
    big = rep["largest_gaps"][0]
    assert big["at_s"] == pytest.approx(2e-3) and big["ms"] == pytest.approx(3.0)
    assert [h[0] for h in big["host"]] == ["aten::cat", "cudaHostAlloc"]
    assert big["host"][1][1:] == pytest.approx([2.8, 2.8])
    assert rep["largest_gaps"][1]["ms"] == pytest.approx(1.0) and rep["largest_gaps"][1]["at_s"] == 0
