"""Widget logic without a browser: pure state/rendering, ipywidgets with their dummy comm, patched display."""
from __future__ import annotations

import gc
import os
import re
import sys
import threading
import time
from datetime import datetime

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from nb_fakes import FakeEngine  # noqa: E402

from nbgen.notebook import _compat  # noqa: E402
from nbgen.notebook.dashboard import Dashboard, dashboard  # noqa: E402
from nbgen.notebook._compat import Debouncer  # noqa: E402
from nbgen.notebook.playground import (CONTROL_WIDTH, LABEL_WIDTH, SLIDERS, Playground,  # noqa: E402
                                       sample_params)
from nbgen.notebook.state import (StatsHistory, dashboard_html, dashboard_text, fmt_num, kv_summary,  # noqa: E402
                                  nice_ceil, svg_bars, svg_lines)
from nbgen.notebook.stream import StreamState, stream  # noqa: E402


def _wait_for(pred, timeout: float = 5.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


# ---- pure state ----------------------------------------------------------------------------------
def test_fmt_and_kv_summary() -> None:
    assert [fmt_num(x) for x in (0, 7, 2.5, 950, 12345, 4.56e6)] == ["0", "7", "2.5", "950", "12.3k", "4.56M"]
    kv = kv_summary({"kv_pages_used": 25, "kv_pages_total": 100, "prefix_cache_pages": 10})
    assert kv == {"used": 25, "total": 100, "frac": 0.25, "prefix_frac": 0.1}
    assert kv_summary({})["frac"] == 0.0  # no division by zero before the engine reports


def test_stats_history_ring_buffer_and_frame() -> None:
    h = StatsHistory(maxlen=3)
    for i in range(5):
        h.append({"output_tok_s": float(i), "time": 100.0 + i})
    assert len(h) == 3 and h.series("output_tok_s") == [2.0, 3.0, 4.0]
    assert h.seconds_ago() == [-2.0, -1.0, 0.0]
    frame = h.to_frame()
    assert list(frame["output_tok_s"]) == [2.0, 3.0, 4.0]
    assert frame["time"].dtype.kind == "M"  # a datetime column, printed as a date and time
    assert str(frame["time"].iloc[0]) == str(datetime.fromtimestamp(102.0))


def test_svg_lines_scales_points_into_the_box_with_labelled_axes() -> None:
    # plot box: x 46..446 (400 px), y 8..108 (100 px); x spans 20 s ago .. now, y 0 .. 10
    svg = svg_lines([-20, -10, 0], {"a": ([0.0, 5.0, 10.0], "#f00")}, width=456, height=138)
    pts = svg.split('points="')[1].split('"')[0].split()
    xy = [tuple(map(float, p.split(","))) for p in pts]
    assert xy == [(46.0, 108.0), (246.0, 58.0), (446.0, 8.0)]  # y grows downward
    labels = re.findall(r">([^<>]+)</text>", svg)
    assert labels == ["10", "tok/s", "0", "now", "5", "10", "15", "20", "seconds ago"]  # y max, unit, ticks, x title
    assert "<polyline" not in svg_lines([0], {"a": ([1.0], "#f00")})  # one point draws no line
    # a young history still spans min_span seconds: the line starts at the right edge
    young = svg_lines([-1, 0], {"a": ([1.0, 2.0], "#f00")}, width=456, height=138)
    assert young.split('points="')[1].startswith("406.0,")
    assert [nice_ceil(x) for x in (0, 0.3, 7, 10, 1234, 2400)] == [1.0, 0.5, 10, 10, 2000, 2500]


def test_svg_bars_fits_long_labels_and_titles_above() -> None:
    labels = ["W-nano · SmolLM2-135M-Instruct · nbgen · cuda", "short"]
    svg = svg_bars(labels, [1234.0, 10.0], " tok/s", title="output tokens / s")
    label_x = float(re.search(r'<text x="([\d.]+)" y="[\d.]+" font-size="12" text-anchor="end">', svg).group(1))
    assert label_x >= len(labels[0]) * 6  # the label column holds the longest label
    assert 'class="nbgen-bars-title" x="4" y="16"' in svg and svg.index("output tokens / s") < svg.index("<rect")
    first_bar_y = float(re.search(r'<rect x="[\d.]+" y="([\d.]+)"', svg).group(1))
    assert first_bar_y > 16  # under the title
    assert "1.23k tok/s" in svg and ">short</text>" in svg
    cut = svg_bars(["x" * 80], [1.0], max_label_chars=20)
    assert "<title>" + "x" * 80 + "</title>" + "x" * 19 + "…" in cut  # ellipsised, full text as tooltip
    assert 'width="520"' in svg_bars(["a"], [1.0], width=520)


def test_dashboard_html_and_text_show_the_numbers() -> None:
    h = StatsHistory()
    h.append({"running": 3, "waiting": 2, "kv_pages_used": 50, "kv_pages_total": 200, "prefix_cache_pages": 20,
              "input_tok_s": 1500.0, "output_tok_s": 250.0, "total_output_tokens": 12345, "time": 1.0,
              "total_finished": 7, "total_aborted": 2})
    page = dashboard_html(h, "t", "live")
    assert 'data-running="3"' in page and 'data-total-output-tokens="12345"' in page
    assert re.search(r'nbgen-finished"[^>]*>7<', page) and re.search(r'nbgen-aborted"[^>]*>2<', page)
    assert "seconds ago" in page  # the chart's x axis
    assert "50 / 200 pages (25%)" in page and "prefix cache 10%" in page and "1.5k" in page
    text = dashboard_text(h.latest)
    assert "running 3, waiting 2" in text and "KV 50/200 pages (25%, prefix 10%)" in text
    assert "finished 7, aborted 2" in text


def test_stream_state_accumulates_and_reports() -> None:
    t = iter([0.0, 1.0, 2.0])
    s = StreamState(clock=lambda: next(t))
    s.add({"text": "Hel", "meta_info": {"completion_tokens": 1}})
    s.add({"text": "lo <b>", "meta_info": {"completion_tokens": 4, "finish_reason": {"type": "length"}}})
    assert s.text == "Hello <b>" and s.tokens == 4 and s.tok_s == 2.0 and s.done
    assert s.status() == "done (length) · 4 tokens · 2.0 tok/s"
    assert "Hello &lt;b&gt;" in s.html()  # generated text is escaped, never rendered as HTML


def test_sample_params_and_debouncer() -> None:
    ps = sample_params({"temperature": 0.5, "top_k": 0, "max_new_tokens": 16.0}, 3, seed=7)
    assert [p["sampling_seed"] for p in ps] == [7, 8, 9]
    assert ps[0]["top_k"] == -1 and ps[0]["max_new_tokens"] == 16 and isinstance(ps[0]["max_new_tokens"], int)
    with pytest.raises(ValueError, match="top_p"):
        sample_params({"top_p": 0.0}, 1, 0)
    calls = []
    d = Debouncer(0.5, lambda: calls.append(time.time()))
    for _ in range(5):       # well inside the interval even on a loaded machine
        d.trigger()
        time.sleep(0.01)
    assert _wait_for(lambda: calls, 5.0)
    time.sleep(0.6)          # nothing triggers it now: a second call could only come from the first five
    assert len(calls) == 1  # five quick changes -> one regeneration


# ---- dashboard -------------------------------------------------------------------------------------
def test_dashboard_refreshes_in_background_and_stops_at_shutdown() -> None:
    pytest.importorskip("ipywidgets")
    eng = FakeEngine(delay=0.02)
    d = Dashboard(eng, interval=0.05, widget=True).start()
    assert d.widget is not None and "nbgen-dashboard" in d.widget.value
    it = eng.generate("a b c d e f g h i j", {"max_new_tokens": 10}, stream=True)
    next(it)  # one request running now
    assert _wait_for(lambda: 'data-running="1"' in d.widget.value)
    list(it)
    assert _wait_for(lambda: 'data-total-output-tokens="10"' in d.widget.value and 'data-running="0"' in d.widget.value)
    eng.shutdown()
    assert _wait_for(lambda: not d.running)
    assert d.status == "engine shut down" and 'data-status="engine shut down"' in d.widget.value


def test_dashboard_does_not_keep_engine_alive() -> None:
    eng = FakeEngine()
    d = Dashboard(eng, interval=0.05, widget=False).start()
    del eng
    gc.collect()
    assert _wait_for(lambda: not d.running) and d.status == "engine released"


def test_dashboard_without_widgets_updates_a_display_handle(monkeypatch) -> None:
    updates, shown = [], []

    class Handle:
        def update(self, obj, raw=False):
            updates.append(obj)

    def fake_display(obj, **kw):
        shown.append((obj, kw))
        return Handle()

    monkeypatch.setattr(_compat, "display", fake_display)
    monkeypatch.setattr(_compat, "ipython_active", lambda: True)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install ipywidgets"):
        _compat.require_widgets()
    eng = FakeEngine()
    with pytest.warns(UserWarning, match="pip install ipywidgets"):
        monkeypatch.setattr(_compat, "_warned", False)
        d = dashboard(eng, interval=0.05)
    assert d.widget is None and shown[0][1]["raw"] and "text/html" in shown[0][0]
    assert "application/vnd.jupyter.widget-view+json" not in shown[0][0]
    assert _wait_for(lambda: len(updates) >= 2) and "nbgen-dashboard" in updates[-1]["text/html"]
    d.stop()
    assert not d.running


def test_shown_once_per_cell(monkeypatch) -> None:
    count, shown = [5], []
    monkeypatch.setattr(_compat, "_exec_count", lambda: count[0])
    monkeypatch.setattr(_compat, "ipython_active", lambda: True)
    monkeypatch.setattr(_compat, "display", lambda obj, **kw: shown.append(obj))
    d = Dashboard(FakeEngine(), widget=False)
    d.show()
    d._ipython_display_()  # the same cell's result: not shown twice
    assert len(shown) == 1
    count[0] = 6
    d._ipython_display_()  # `d` alone in a later cell shows it again
    assert len(shown) == 2 and "text/html" in d._repr_mimebundle_()


def test_dashboard_live_during_blocking_generate(tiny_engine) -> None:
    pytest.importorskip("ipywidgets")
    """The refresh thread keeps sampling while the caller's thread is blocked in generate()."""
    d = Dashboard(tiny_engine, interval=0.05, widget=True).start()
    before = tiny_engine.stats()["total_output_tokens"]
    # long enough (~0.5 s even with the CPU kernels) that several 50 ms samples land mid-generation
    tiny_engine.generate(["hello"] * 4, {"max_new_tokens": 600, "ignore_eos": True, "temperature": 0.0})
    after = tiny_engine.stats()["total_output_tokens"]
    time.sleep(0.15)
    d.stop()
    seen = d.history.series("total_output_tokens")
    assert after - before == 4 * 600
    assert any(before < v < after for v in seen), seen  # a snapshot taken mid-generation
    assert max(d.history.series("running")) >= 1


# ---- stream cell ---------------------------------------------------------------------------------------
def test_stream_cell_stop_button_aborts() -> None:
    pytest.importorskip("ipywidgets")
    eng = FakeEngine(delay=0.05)
    cell = stream(eng, " ".join(f"w{i}" for i in range(40)), {"max_new_tokens": 40}, widget=True, display=False)
    assert _wait_for(lambda: cell.state.tokens >= 2)
    cell._button.click()  # what a click in the browser runs
    text = cell.wait(5)
    assert cell.done and cell.state.finish_reason["type"] == "abort"
    assert 2 <= len(text.split()) < 40 and cell._button.disabled
    assert cell._label.value.startswith("stopped")


def test_stream_cell_real_engine_matches_generate(tiny_engine) -> None:
    pytest.importorskip("ipywidgets")
    sp = {"max_new_tokens": 12, "temperature": 0.0}
    cell = stream(tiny_engine, "The capital of France is", sp, widget=True, display=False)
    text = cell.wait(30)
    assert text == tiny_engine.generate("The capital of France is", sp)["text"]
    assert cell.output["meta_info"]["completion_tokens"] == cell.state.tokens > 0
    assert "done (" in cell._label.value


def test_stream_rejects_bad_params_in_the_callers_cell() -> None:
    with pytest.raises(ValueError, match="top_p"):
        stream(FakeEngine(), "x", {"top_p": 2.0}, display=False)
    for bad in (5, ["a", "b"], []):
        with pytest.raises(ValueError, match="prompt must be text or a list of chat messages"):
            stream(FakeEngine(), bad, display=False)


def test_stream_takes_a_conversation_through_the_chat_template(tiny_engine) -> None:
    msgs = [{"role": "user", "content": "The capital of France is"}]
    sp = {"max_new_tokens": 6, "temperature": 0.0}
    cell = stream(tiny_engine, msgs, sp, widget=False, display=False)
    assert cell.wait(30) == tiny_engine.chat(msgs, sp)["text"]


# ---- playground ----------------------------------------------------------------------------------------
def test_playground_regenerates_on_change() -> None:
    pytest.importorskip("ipywidgets")
    eng = FakeEngine()
    pg = Playground(eng, prompt="a b c", k=2, debounce=0.05, widget=True, temperature=0.3)
    pg.regenerate(wait=True)
    assert pg.texts == ["c b a", "c b a"] and len(eng.calls) == 0  # streamed, not batch calls
    pg.prompt_box.value = "x y"
    pg.controls["k"].value = 3
    pg.controls["max_new_tokens"].value = 1
    assert _wait_for(lambda: pg.texts == ["y"] * 3, 3.0)
    assert pg.out.value.count("nbgen-sample") == 3 and "1 tokens" in pg.out.value
    pg.controls["top_p"].value = 0.05  # still valid
    pg.controls["chat"].value = True
    assert _wait_for(lambda: pg.texts[0] == "<assistant>", 3.0)
    with pytest.raises(ValueError, match="unknown playground setting"):
        Playground(eng, temprature=1.0, widget=False)
    pg.close()


def test_playground_real_engine_seeds_are_reproducible(tiny_engine) -> None:
    pg = Playground(tiny_engine, prompt="hello", k=2, seed=3, widget=False, temperature=1.0, max_new_tokens=8)
    pg.regenerate(wait=True)
    first = list(pg.texts)
    pg.regenerate(wait=True)
    assert pg.texts == first and all(first)
    ref = tiny_engine.generate("hello", {**sample_params(pg.values, 2, 3)[1]})
    assert first[1] == ref["text"]


def test_dashboard_waits_for_the_final_numbers_while_shutdown_runs() -> None:
    """shutdown() makes stats() refuse at once but publishes final_stats only after the loop stopped; a
    refresh in between keeps the dashboard live, so it ends with the final numbers, not a stale view."""

    class Stopping:
        shutting_down, final_stats = True, None

        def stats(self):
            raise RuntimeError("engine is shut down")

    eng = Stopping()
    d = Dashboard(eng, interval=10.0, widget=False)          # __init__ polls once
    assert d.status == "live" and d.poll() is True and d.history.latest is None
    eng.shutting_down = False
    eng.final_stats = {"running": 0, "waiting": 0, "total_output_tokens": 192, "total_input_tokens": 80}
    assert d.poll() is False and d.status == "engine shut down"
    assert d.history.latest["total_output_tokens"] == 192


def test_engine_publishes_final_stats_after_the_loop_stops(tiny_llama_dir) -> None:
    import nbgen

    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu")
    assert not eng.shutting_down and eng.final_stats is None
    eng.generate(input_ids=[[5, 6, 7]] * 2, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    eng.shutdown()
    assert not eng.shutting_down and eng.final_stats["running"] == 0
    assert eng.final_stats["total_output_tokens"] == 6
    with pytest.raises(RuntimeError):
        eng.stats()


# ---- finished widgets leave static HTML; widgets follow a shut-down engine --------------------------
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class FakeDisplays:
    """IPython's display() patched: each display and its later updates, by display order."""

    def __init__(self) -> None:
        self.bundles: list[list[dict]] = []
        self.changed = threading.Condition()

    def display(self, obj, raw=False, display_id=None, **kw):
        assert raw and display_id is True
        with self.changed:
            self.bundles.append([obj])
            self.changed.notify_all()
        return _FakeHandle(self, len(self.bundles) - 1)

    def last(self, i: int) -> dict:
        with self.changed:
            return self.bundles[i][-1]

    def wait_for(self, pred, timeout: float = 10.0) -> bool:
        """Wait until ``pred()`` holds, re-checked at every display or update (no sleeping)."""
        with self.changed:
            return self.changed.wait_for(pred, timeout)


class _FakeHandle:
    def __init__(self, displays: FakeDisplays, i: int) -> None:
        self.displays, self.i = displays, i

    def update(self, obj, raw=False):
        assert raw
        with self.displays.changed:
            self.displays.bundles[self.i].append(obj)
            self.displays.changed.notify_all()


@pytest.fixture
def displays(monkeypatch) -> FakeDisplays:
    d = FakeDisplays()
    monkeypatch.setattr(_compat, "display", d.display)
    monkeypatch.setattr(_compat, "ipython_active", lambda: True)
    return d


def _static(bundle: dict) -> bool:
    return WIDGET_VIEW not in bundle and set(bundle) == {"text/plain", "text/html"}


def test_dashboard_ends_as_static_html_with_the_final_numbers(displays) -> None:
    pytest.importorskip("ipywidgets")
    eng = FakeEngine()
    eng.generate("a b c", {"max_new_tokens": 3})
    d = dashboard(eng, interval=0.05, widget=True)
    assert WIDGET_VIEW in displays.last(0)  # live: the widget view (and the HTML fallback)
    d.stop()  # stopped by hand: a static snapshot, resumable
    assert d.status == "stopped" and _static(displays.last(0))
    d.start()
    assert d.running and WIDGET_VIEW in displays.last(0)
    eng.shutdown()
    assert d.wait(5) and d.status == "engine shut down"
    final = displays.last(0)
    assert _static(final), final.keys()
    assert 'data-status="engine shut down"' in final["text/html"] and 'data-total-output-tokens="3"' in final["text/html"]
    assert "finished 1" in final["text/plain"]


def test_stream_cell_ends_as_static_html(displays) -> None:
    pytest.importorskip("ipywidgets")
    cell = stream(FakeEngine(), "one two three", {"max_new_tokens": 8}, widget=True)
    assert WIDGET_VIEW in displays.bundles[0][0]      # shown as a widget first (the fake may finish at once)
    assert cell.wait(30) == "three two one"
    assert displays.wait_for(lambda: _static(displays.last(0)), 30)
    assert "three two one" in displays.last(0)["text/html"] and "done (stop)" in displays.last(0)["text/html"]


def test_playground_close_leaves_static_samples_and_settings(displays) -> None:
    pytest.importorskip("ipywidgets")
    pg = Playground(FakeEngine(), prompt="a b c", k=2, widget=True, temperature=0.8).show()
    pg.regenerate(wait=True)
    assert WIDGET_VIEW in displays.last(0)
    pg.close()
    final = displays.last(0)
    assert _static(final) and final["text/html"].count("c b a") == 2
    assert "temperature 0.8" in final["text/html"] and "(closed)" in final["text/html"]
    assert pg.status == "closed" and all(c.disabled for c in pg.controls.values())
    pg.regenerate()  # a closed playground runs nothing more
    assert pg.texts == ["c b a", "c b a"]


def test_widgets_follow_a_shut_down_engine(tiny_llama_dir, displays) -> None:
    pytest.importorskip("ipywidgets")
    import warnings

    import nbgen

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the shared test engine is running too
        eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu")
    d = dashboard(eng, interval=0.05, widget=True)                                   # display 0
    pg = Playground(eng, prompt="hello", k=1, widget=True, max_new_tokens=4).show()  # display 1
    pg.regenerate(wait=True)
    cell = stream(eng, "hello", {"max_new_tokens": 1000, "ignore_eos": True}, widget=False)  # display 2
    assert displays.wait_for(lambda: cell.state.tokens >= 2)
    eng.shutdown()
    assert d.wait(5) and d.status == "engine shut down" and _static(displays.last(0))
    cell.wait(10)
    assert cell.state.engine_gone and cell.state.status().startswith("engine shut down")
    assert displays.wait_for(lambda: "engine shut down" in displays.last(2)["text/html"])
    assert displays.wait_for(lambda: pg.status == "engine shut down" and _static(displays.last(1)))
    assert all(c.disabled for c in pg.controls.values()) and "engine shut down" in pg.status_label.value
    assert "(engine shut down)" in displays.last(1)["text/html"]


def test_playground_controls_are_wide_typed_and_log_scaled() -> None:
    w = pytest.importorskip("ipywidgets")
    pg = Playground(FakeEngine(), widget=True, debounce=60.0)  # no run starts during the test
    sliders = {n: pg.controls[n] for n in SLIDERS}
    assert all(c.layout.width == CONTROL_WIDTH and c.style.description_width == LABEL_WIDTH for c in sliders.values())
    assert int(CONTROL_WIDTH[:-2]) - int(LABEL_WIDTH[:-2]) >= 300  # track + readout: ~4x the old 74 px track
    assert all(c.readout and not c.continuous_update for c in sliders.values())  # editable readout, one run per drag
    rp = sliders["repetition_penalty"]
    assert isinstance(rp, w.FloatLogSlider) and (rp.base ** rp.min, rp.base ** rp.max) == (0.5, 2.0)
    assert isinstance(sliders["top_k"], w.IntSlider) and isinstance(sliders["temperature"], w.FloatSlider)
    # the controls' column is as wide as the controls: no empty band between sliders and samples
    assert pg.left.layout.width == CONTROL_WIDTH and pg.right.layout.flex.startswith("1 1")
    # a typed value (the readout box sets .value) lands in pg.values and in the sampling params
    sliders["temperature"].value = 1.23
    rp.value = 1.5
    sliders["max_new_tokens"].value = 24
    sliders["top_k"].value = 40
    assert {k: pg.values[k] for k in ("temperature", "repetition_penalty", "max_new_tokens", "top_k")} == \
        {"temperature": 1.23, "repetition_penalty": 1.5, "max_new_tokens": 24, "top_k": 40}
    p = sample_params(pg.values, 1, 0)[0]
    assert (p["temperature"], p["repetition_penalty"], p["max_new_tokens"], p["top_k"]) == (1.23, 1.5, 24, 40)
    pg.close()


def test_dashboard_title_is_the_model_name() -> None:
    class Named(FakeEngine):
        model_name, device = "SmolLM2-135M-Instruct", "cpu"

    assert Dashboard(Named(), widget=False).title == "nbgen · SmolLM2-135M-Instruct · cpu"
