"""generate_df in a notebook: chat="auto", progress that counts every row and ends as static HTML,
and one-line interrupts. The notebook side runs on a fake IPython display (no browser, no kernel)."""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import pandas as pd
import pytest

import nbgen.progress
from nbgen.core.interrupt import GenerationInterrupted
from nbgen.dataframe import generate_df
from nbgen.dataframe_io import Checkpoint
from nbgen.dataframe_job import INTERRUPTED
from nbgen.dataframe_rows import template_mode
from nbgen.notebook.progress_bar import RowProgress
from nbgen.progress import BatchProgress, ProgressBar

sys.path.insert(0, os.path.dirname(__file__))
from nb_fakes import FakeDisplay, FakeEngine  # noqa: E402

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class _NoTemplate(FakeEngine):
    """A base model: its tokenizer has no chat template."""

    has_chat_template = False

    def apply_chat_template(self, messages, add_generation_prompt=True):
        raise ValueError("this model's tokenizer has no chat template")


class _Interrupting(FakeEngine):
    """Raises KeyboardInterrupt (the Stop button) once ``after`` rows finished."""

    def __init__(self, after: int) -> None:
        super().__init__(complete_in_reverse=False)
        self.after = after

    def generate_iter(self, prompt=None, sampling_params=None, **kw):
        for item in super().generate_iter(prompt, sampling_params, **kw):
            if self.finished > self.after:
                raise KeyboardInterrupt
            yield item


@pytest.fixture
def shown(monkeypatch) -> FakeDisplay:
    """Progress bars display into a fake Jupyter kernel."""
    fake = FakeDisplay()
    monkeypatch.setattr(nbgen.progress, "notebook_display", lambda: fake)
    return fake


def _final(shown: FakeDisplay) -> dict:
    assert len(shown.outputs) == 1, shown.outputs
    return next(iter(shown.outputs.values()))


# ---- chat="auto" ----------------------------------------------------------------------------------
def test_template_mode_rules() -> None:
    assert template_mode("auto", None, True) is True and template_mode("auto", None, False) is False
    assert template_mode(True, None, True) is True and template_mode(False, None, True) is False
    assert template_mode(True, None, None) is True  # no engine yet: checked again once there is one
    for bad in (None, "yes", 1, 0):
        with pytest.raises(ValueError, match="chat must be 'auto', True or False"):
            template_mode(bad, None, True)
    with pytest.raises(ValueError, match="chat=True needs a chat template"):
        template_mode(True, None, False)
    with pytest.raises(ValueError, match="system_prompt.*chat=False"):
        template_mode(False, "be brief", True)
    with pytest.raises(ValueError, match="system_prompt.*has none"):
        template_mode("auto", "be brief", False)


def test_chat_auto_follows_the_engine() -> None:
    df = pd.DataFrame({"prompt": ["What is it?", [{"role": "user", "content": "hi"}], None]})
    out = generate_df(df, engine=FakeEngine(), progress=False)  # chat="auto" is the default
    assert out.loc[0, "text"] == "<assistant> it? is What <user>"
    assert out.loc[1, "text"] == "<assistant> hi <user>"
    assert out.attrs["nbgen"] == {"chat": True, "rows": 3, "errors": 1, "restored": 0, "checkpoint": None}
    raw = generate_df(df, engine=_NoTemplate(), progress=False)
    assert raw.loc[0, "text"] == "it? is What" and raw.attrs["nbgen"]["chat"] is False
    assert raw.loc[1, "error"].startswith("chat template failed")  # conversations always need one
    forced_raw = generate_df(df, engine=FakeEngine(), chat=False, progress=False)
    assert forced_raw.loc[0, "text"] == "it? is What" and forced_raw.loc[1, "text"] == "<assistant> hi <user>"
    with pytest.raises(ValueError, match="chat=True"):
        generate_df(df, engine=_NoTemplate(), chat=True, progress=False)
    for bad in ("yes", None):
        with pytest.raises(ValueError, match="chat"):
            generate_df(df, engine=FakeEngine(), chat=bad, progress=False)


def test_checkpoint_key_separates_raw_and_chat_rows(tmp_path) -> None:
    df = pd.DataFrame({"prompt": ["a b", "c d", [{"role": "user", "content": "m"}]]})
    path = str(tmp_path / "run.jsonl")
    first = FakeEngine()
    generate_df(df, engine=first, chat=False, checkpoint=path, progress=False)
    assert sum(len(c) for c in first.calls) == 3
    auto = FakeEngine()
    out = generate_df(df, engine=auto, checkpoint=path, progress=False)
    # the text rows ran again with the template; the conversation was templated both times
    assert auto.calls == [["<user> a b <assistant>", "<user> c d <assistant>"]]
    assert out.loc[0, "text"] == "<assistant> b a <user>" and out.attrs["nbgen"]["restored"] == 1
    forced = FakeEngine()
    generate_df(df, engine=forced, chat=True, checkpoint=path, progress=False)
    assert forced.calls == []  # chat=True sends what "auto" sent: every row is reused


# ---- progress: every row counts, live numbers, static finish ------------------------------------
def test_bar_counts_errors_and_ends_as_static_html(shown) -> None:
    df = pd.DataFrame({"prompt": ["one two", None, "three", 42, "FAIL here"]})
    out = generate_df(df, engine=FakeEngine())
    assert out["error"].notna().sum() == 3
    first = shown.objects[0]
    assert WIDGET_MIME in shown.history[0][1]  # live: tqdm's widget
    final = _final(shown)
    assert WIDGET_MIME not in final and set(final) == {"text/html", "text/plain"}
    assert 'data-outcome="done"' in final["text/html"] and 'data-n="5" data-total="5"' in final["text/html"]
    assert final["text/plain"].startswith("generate_df (chat template): 5/5 rows · 3 errors")
    assert "out tok/s" in final["text/plain"]
    assert first.pbar.n == 5 and first.comm is None  # every row counted; the widget model is closed


def test_bar_advances_on_each_completion(shown) -> None:
    class Watching(FakeEngine):
        def __init__(self) -> None:
            super().__init__(complete_in_reverse=False)
            self.seen: list[int] = []

        def generate_iter(self, prompt=None, sampling_params=None, **kw):
            for item in super().generate_iter(prompt, sampling_params, **kw):
                self.seen.append(shown.objects[0].pbar.n)  # the bar's count as this row finishes
                yield item

    eng = Watching()
    generate_df(pd.DataFrame({"prompt": ["a", None, "b", "c", "d"]}), engine=eng, chat=False)
    assert eng.seen == [1, 2, 3, 4]  # the bad row is settled up front; each completion advances it


def test_restored_rows_are_initial_and_the_clock_starts_with_new_work(shown) -> None:
    rp = RowProgress(10, "generate_df (raw text)", presettled=4, errors=1, restored=3)
    tq = rp.bar.bar
    assert tq.format_dict["initial"] == 4 and rp.bar.n == 4
    mark = time.time()
    assert tq.start_t <= mark
    rp.start()
    assert tq.start_t >= mark  # rate and ETA cover the rows run from here on
    rp.settle(out_tokens=7)
    rp.settle(error=True)
    assert rp.postfix().startswith("3 from checkpoint · 2 errors")
    rp.close()
    final = _final(shown)
    assert 'data-outcome="stopped"' in final["text/html"]  # 6/10 settled: not complete
    assert "6/10 rows · 3 from checkpoint · 2 errors" in final["text/plain"]


def test_resumed_run_shows_checkpoint_rows(shown, tmp_path) -> None:
    df = pd.DataFrame({"prompt": ["w0", "w1", "FAIL 2", "w3", "w4"]})
    path = str(tmp_path / "run.jsonl")
    generate_df(df.head(3), engine=FakeEngine(), checkpoint=path, progress=False)
    eng = FakeEngine()
    out = generate_df(df, engine=eng, checkpoint=path)
    assert sum(len(c) for c in eng.calls) == 3  # the failed row is retried (and fails again)
    assert out.attrs["nbgen"] == {"chat": True, "rows": 5, "errors": 1, "restored": 2, "checkpoint": path}
    text = _final(shown)["text/plain"]
    assert text.startswith("generate_df (chat template): 5/5 rows · 2 from checkpoint · 1 error ·")


def test_bar_without_ipywidgets_is_html_updated_in_place(shown, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.notebook", None)  # import fails as without ipywidgets
    generate_df(pd.DataFrame({"prompt": ["a", "b"]}), engine=FakeEngine(), chat=False)
    assert isinstance(shown.objects[0], dict) and "text/html" in shown.objects[0]
    final = _final(shown)
    assert "generate_df (raw text): 2/2 rows" in final["text/plain"] and 'data-outcome="done"' in final["text/html"]


def test_bar_outside_a_kernel_is_text(monkeypatch, capsys) -> None:
    monkeypatch.setattr(nbgen.progress, "notebook_display", lambda: None)
    generate_df(pd.DataFrame({"prompt": ["a", None]}), engine=FakeEngine(), chat=False)
    err = capsys.readouterr().err
    assert "generate_df (raw text)" in err and "2/2" in err and "1 error" in err


def test_ticker_redraws_a_burst_without_further_updates(monkeypatch) -> None:
    class Watched(FakeDisplay):
        def __init__(self) -> None:
            super().__init__()
            self.saw_three = threading.Event()

        def __call__(self, obj, raw=False, display_id=None, update=False):
            handle = super().__call__(obj, raw=raw, display_id=display_id, update=update)
            if 'data-n="3"' in self.outputs[handle.display_id].get("text/html", ""):
                self.saw_three.set()
            return handle

    fake = Watched()
    monkeypatch.setattr(nbgen.progress, "notebook_display", lambda: fake)
    monkeypatch.setitem(sys.modules, "tqdm.notebook", None)  # the HTML view: only the ticker redraws it
    bar = ProgressBar(10, "burst", unit="row", refresh_s=0.01)
    bar.start_clock()
    bar.update(3)  # three rows finish at once, then nothing more arrives
    assert fake.saw_three.wait(10), "the live view never showed the burst"
    bar.close()
    assert 'data-outcome="stopped"' in _final(fake)["text/html"]


def test_batch_progress_ends_as_static_html(shown) -> None:
    out = {"meta_info": {"prompt_tokens": 3, "completion_tokens": 2}}
    bp = BatchProgress(3, enabled=True)
    for _ in range(3):
        bp.update(out)
    bp.close()
    final = _final(shown)
    assert WIDGET_MIME not in final and 'data-outcome="done"' in final["text/html"]
    assert final["text/plain"].startswith("generate: 3/3 reqs · in ")


# ---- interrupts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_interrupt_is_one_line_and_keeps_finished_rows(shown, tmp_path, suffix) -> None:
    if suffix == "parquet":
        pytest.importorskip("pyarrow")
    df = pd.DataFrame({"prompt": [f"w{i} v{i}" for i in range(20)] + [None]})
    path = str(tmp_path / f"run.{suffix}")
    with pytest.raises(KeyboardInterrupt) as info:
        generate_df(df, engine=_Interrupting(after=7), checkpoint=path, batch_size=5)
    e = info.value
    assert isinstance(e, GenerationInterrupted) and e.__cause__ is None and e.__suppress_context__
    assert e._render_traceback_() == [f"interrupted: 7/21 rows saved to {path}; run the cell again to resume"]
    assert (e.done, e.total, e.checkpoint) == (7, 21, path)
    saved = {r["_row"] for r in Checkpoint(path).load() if not r.get("error")}
    assert saved == set(range(7))
    final = _final(shown)
    assert WIDGET_MIME not in final and 'data-outcome="stopped"' in final["text/html"]
    assert "8/21 rows · 1 error" in final["text/plain"]  # the 7 finished rows and the missing prompt


def test_interrupt_without_checkpoint_says_how_to_keep_rows() -> None:
    df = pd.DataFrame({"prompt": [f"w{i}" for i in range(6)]})
    with pytest.raises(GenerationInterrupted) as info:
        generate_df(df, engine=_Interrupting(after=2), progress=False)
    lines = info.value._render_traceback_()
    assert lines == ["interrupted: 2/6 rows done (kept in this exception's .partial); "
                     "pass checkpoint= to keep finished rows across interrupts"]


def test_interrupt_keeps_finished_rows_in_a_partial_frame(tmp_path) -> None:
    df = pd.DataFrame({"prompt": ["a b", None] + [f"w{i} v{i}" for i in range(8)], "x": range(10)},
                      index=[f"r{i}" for i in range(10)])
    path = str(tmp_path / "run.jsonl")
    with open(path, "w") as f:  # a checkpoint row for a prompt that has changed since: not reused
        f.write(json.dumps({"_row": 9, "_key": "stale", "text": "old", "error": None}) + "\n")
    with pytest.raises(GenerationInterrupted) as info:
        generate_df(df, engine=_Interrupting(after=3), progress=False, batch_size=4, chat=False, checkpoint=path)
    part = info.value.partial
    assert list(part.index) == list(df.index) and part["x"].tolist() == list(range(10))
    assert part["text"].tolist()[:4] == ["b a", None, "v0 w0", "v1 w1"]  # 3 rows finished, 1 failed
    assert part["error"].tolist() == [None, "missing prompt", None, None] + [INTERRUPTED] * 6
    assert part["text"].tolist()[4:] == [None] * 6 and part["completion_tokens"].tolist()[:4] == [2, pd.NA, 2, 2]
    assert part.attrs["nbgen"]["errors"] == 7 and part.attrs["nbgen"]["rows"] == 10
    with pytest.raises(GenerationInterrupted) as info:  # resumed: the restored rows are in it too
        generate_df(df, engine=_Interrupting(after=1), progress=False, batch_size=4, chat=False, checkpoint=path)
    part = info.value.partial
    assert part["error"].tolist() == [None, "missing prompt", None, None, None] + [INTERRUPTED] * 5
    assert part["text"].iloc[4] == "v2 w2" and part.attrs["nbgen"]["restored"] == 3


def test_stop_while_the_default_engine_loads(tmp_path, monkeypatch) -> None:
    pytest.importorskip("pyarrow")
    import nbgen.dataframe

    df = pd.DataFrame({"prompt": ["a b", None, "c d"]})
    path = tmp_path / "run.parquet"
    generate_df(df.iloc[:1], engine=FakeEngine(), checkpoint=str(path), progress=False, chat=False)

    def loading() -> FakeEngine:
        raise KeyboardInterrupt  # the Stop button during the model load

    monkeypatch.setattr(nbgen.dataframe, "default_engine", loading)
    with pytest.raises(GenerationInterrupted, match="1/3 rows saved") as info:
        generate_df(df, checkpoint=str(path), progress=False, chat=False)
    assert info.value.partial["text"].tolist() == ["b a", None, None]
    assert info.value.partial["error"].tolist() == [None, "missing prompt", INTERRUPTED]
    assert not os.path.exists(str(path) + ".partial.jsonl")   # the journal was merged, its file closed
    assert sorted(r["_row"] for r in Checkpoint(str(path)).load()) == [0, 1]
