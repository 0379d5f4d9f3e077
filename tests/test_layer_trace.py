"""bench/layer_trace: a trace's kernels cut into layers at an anchor kernel, lined up by position."""
from __future__ import annotations

import pytest

from nbgen.bench.layer_trace import layer_table, split_layers, trace_kernels


def _trace(seq: list[tuple[str, float, float]]) -> dict:
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": d} for n, ts, d in seq]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1e6})   # not a kernel
    return {"traceEvents": events[::-1]}                                                  # any order


def _layers(n: int, t0: float, rope_gap: float) -> list[tuple[str, float, float]]:
    out, t = [], t0
    for _ in range(n):
        out += [("rope", t, 2.0), ("attn<float, 128>", t + 2.0 + rope_gap, 5.0), ("gemv", t + 6.0 + rope_gap, 10.0)]
        t += 20.0
    return out


def test_layers_cut_at_the_anchor_with_gaps_durations_and_spans():
    seq = [("head", -10.0, 4.0)] + _layers(5, 0.0, 1.0) + [("odd", 100.0, 1.0)] + _layers(3, 110.0, 1.0)
    kernels = trace_kernels(_trace(seq))
    assert [k.name for k in kernels[:3]] == ["head", "rope", "attn<float, 128>"]
    layers = split_layers(kernels, "rope")
    assert len(layers) == 7                       # 8 anchors; the last has no next anchor
    lines = layer_table(layers)
    assert lines[0] == "6 of 7 layers share the most common sequence of 3 kernels"
    rope, attn, gemv = lines[1:4]
    assert "dur    2.00" in rope and "rope" in rope
    assert "gap    1.00" in attn and "dur    5.00" in attn and attn.endswith("attn")   # template arguments dropped
    assert "gap   -1.00" in gemv and "dur   10.00" in gemv                             # overlapped its predecessor
    assert lines[-1].endswith("median 20.00 µs")
    assert "gap    3.00" in rope                 # the previous layer's gemv ended at t + 17, this rope starts at t + 20


def test_too_few_anchors_say_so():
    kernels = trace_kernels(_trace([("rope", 0.0, 1.0), ("gemv", 1.0, 1.0)]))
    assert layer_table(split_layers(kernels, "rope")) == ["no layers: the anchor kernel ran fewer than three times"]


def test_layer_anchor_needs_profile():
    from nbgen.bench.run import main

    with pytest.raises(ValueError, match="layer_anchor"):
        main(["--layer-anchor", "rope", "--device", "cpu"])
