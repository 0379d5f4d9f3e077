"""bench/profiling.RunProfiles: the loop thread's cProfile started at construction, printed by report."""
from __future__ import annotations

from types import SimpleNamespace

from nbgen.bench.phases import piece_counts
from nbgen.bench.profiling import RunProfiles


def _busy() -> int:
    return sum(i * i for i in range(20000))


def test_host_profile_covers_the_loop_thread_calls_between_start_and_report(capsys):
    calls = []
    eng = SimpleNamespace(loop=SimpleNamespace(call=lambda fn: (calls.append(fn), fn())[1]))
    profiles = RunProfiles(eng, gpu=False, host=True)
    _busy()                                       # profiled: cProfile runs in this (the "loop") thread
    profiles.report(1.5)
    out = capsys.readouterr().out
    assert "host profile (loop thread, wall 1.50 s under cProfile)" in out
    assert "_busy" in out and len(calls) == 2     # enable and disable, each on the loop thread


def test_no_profiles_print_nothing(capsys):
    RunProfiles(SimpleNamespace(loop=None), gpu=False, host=False).report(1.0)
    assert capsys.readouterr().out == ""


def test_piece_counts_read_the_piecewise_graphs_counters() -> None:
    assert piece_counts(SimpleNamespace(runner=SimpleNamespace(prefill_graphs=None))) == (0, 0, 0)
    pg = SimpleNamespace(decodes=SimpleNamespace(staged=7), chunks=None, whole_replays=0)
    assert piece_counts(SimpleNamespace(runner=SimpleNamespace(prefill_graphs=pg))) == (7, 0, 0)
    pg.chunks, pg.whole_replays = SimpleNamespace(staged=5), 3
    assert piece_counts(SimpleNamespace(runner=SimpleNamespace(prefill_graphs=pg))) == (7, 5, 3)
