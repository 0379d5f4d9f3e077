"""start_profile / stop_profile (SGLang) and nbgen.profile: a real torch.profiler trace of the steps."""
from __future__ import annotations

import gzip
import json
import os

import pytest

import nbgen
from nbgen.notebook import _compat
from tests.nb_fakes import FakeDisplay

SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _trace_events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_profile_writes_a_trace_of_the_steps(tiny_engine, tmp_path):
    tiny_engine.start_profile(output_dir=str(tmp_path), activities=["CPU"], record_shapes=True)
    out = tiny_engine.generate(["a b", "c d"], SP, use_tqdm=False)
    res = tiny_engine.stop_profile()
    assert os.path.dirname(res.path) == str(tmp_path) and res.path.endswith("-TP-0.trace.json.gz")
    names = {e.get("name", "") for e in _trace_events(res.path)}
    assert any(n.startswith("aten::") for n in names)   # the model's ops ran on the profiled thread
    assert res.steps >= SP["max_new_tokens"]            # one prefill + decode steps
    assert res.ops and all({"name", "calls", "cpu_us", "device_us"} <= set(r) for r in res.ops)
    assert [o["meta_info"]["completion_tokens"] for o in out] == [6, 6]


def test_profile_stops_by_itself_after_num_steps(tiny_engine, tmp_path):
    tiny_engine.start_profile(output_dir=str(tmp_path), num_steps=2, activities=["CPU"])
    tiny_engine.generate("a b", SP)
    res = tiny_engine.stop_profile()        # collects the profile that stopped after 2 steps
    assert res.steps == 2 and os.path.exists(res.path)
    with pytest.raises(RuntimeError, match="no profile is running"):
        tiny_engine.stop_profile()


def test_profile_misuse_is_a_clear_error_and_the_engine_serves(tiny_engine, tmp_path):
    with pytest.raises(RuntimeError, match="no profile is running"):
        tiny_engine.stop_profile()
    for kw, needle in [({"num_steps": 0}, "num_steps"), ({"activities": ["TPU"]}, "activities"),
                       ({"profile_by_stage": True}, "profile_by_stage")]:
        with pytest.raises(ValueError, match=needle):
            tiny_engine.start_profile(output_dir=str(tmp_path), **kw)
    tiny_engine.start_profile(output_dir=str(tmp_path), activities=["CPU"])
    with pytest.raises(RuntimeError, match="already running"):
        tiny_engine.start_profile(output_dir=str(tmp_path))
    tiny_engine.stop_profile()
    assert tiny_engine.generate("a b", SP)["meta_info"]["completion_tokens"] == 6


def test_notebook_profile_shows_the_top_ops(tiny_engine, tmp_path, monkeypatch):
    shown = FakeDisplay()
    monkeypatch.setattr(_compat, "display", shown)
    monkeypatch.setattr(_compat, "ipython_active", lambda: True)
    with nbgen.profile(tiny_engine, output_dir=str(tmp_path), activities=["CPU"]) as prof:
        tiny_engine.generate("a b", SP)
    assert os.path.exists(prof.path)
    (bundle,) = shown.outputs.values()
    assert "nbgen-profile" in bundle["text/html"] and "aten::" in bundle["text/html"]
    table = prof.table()
    assert len(table) > 0 and {"name", "calls", "device_us"} <= set(table.columns)


def test_profile_table_has_a_device_column_only_with_device_time():
    from nbgen.notebook.profile import ops_table_html
    from nbgen.runtime.profiler import ProfileResult

    op = {"name": "aten::mm", "calls": 3, "cpu_us": 2000.0, "self_cpu_us": 1500.0, "device_us": 0.0}
    cpu = ProfileResult("t.json.gz", 4, 0.5, [op])
    assert "device ms" not in ops_table_html(cpu) and "<td>1.50</td>" in ops_table_html(cpu)
    gpu = ProfileResult("t.json.gz", 4, 0.5, [dict(op, device_us=700.0)])
    assert "device ms" in ops_table_html(gpu) and "<td>0.70</td>" in ops_table_html(gpu)


def test_freeze_gc_freezes_the_heap(tiny_engine):
    import gc

    before = gc.get_freeze_count()
    junk = [[i] for i in range(1000)]
    tiny_engine.freeze_gc()
    assert gc.get_freeze_count() >= before + 1000
    assert tiny_engine.generate("a b", SP)["meta_info"]["completion_tokens"] == 6
    del junk
