"""Request edge cases: every bad or extreme input gets a clear error or a clean answer, never a hang."""
from __future__ import annotations

import concurrent.futures as cf
import json

import pytest

import nbgen

TIMEOUT = 120.0   # generous bound on a loaded machine; a hang fails instead of blocking the suite


def bounded(fn, *args, **kw):
    """fn(*args, **kw) on a worker thread; fails the test (instead of hanging) past TIMEOUT."""
    with cf.ThreadPoolExecutor(1) as ex:
        return ex.submit(fn, *args, **kw).result(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def small_cache_engine(tiny_llama_dir):
    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", max_total_tokens=320, random_seed=0)
    yield eng
    eng.shutdown()


def test_duplicate_rid_in_one_call_raises(tiny_engine):
    with pytest.raises(ValueError, match="rid 'x'"):
        bounded(tiny_engine.generate, ["a b", "c d"], {"max_new_tokens": 2}, rid=["x", "x"])
    assert tiny_engine.generate("a b", {"max_new_tokens": 2}, rid="x")["meta_info"]["id"] == "x"


def test_rid_of_a_running_request_raises_and_the_first_call_finishes(tiny_engine):
    it = tiny_engine.generate("a", {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0},
                              stream=True, rid="busy")
    next(it)                                         # "busy" is now in flight
    with pytest.raises(ValueError, match="rid 'busy'"):
        bounded(tiny_engine.generate, "b", {"max_new_tokens": 2}, rid="busy")
    chunks = list(it)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # once it finished, the id is free again
    assert tiny_engine.generate("b", {"max_new_tokens": 2}, rid="busy")["meta_info"]["id"] == "busy"


def test_prompt_larger_than_the_kv_cache_is_aborted_alone_or_in_a_batch(small_cache_engine):
    eng = small_cache_engine
    alone = bounded(eng.generate, input_ids=[5] * 600, sampling_params={"max_new_tokens": 4})
    assert alone["meta_info"]["finish_reason"]["type"] == "abort"
    assert "KV cache" in alone["meta_info"]["finish_reason"]["message"]
    both = bounded(eng.generate, input_ids=[[5] * 600, [6] * 10],
                   sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    assert both[0]["meta_info"]["finish_reason"] == alone["meta_info"]["finish_reason"]
    assert both[1]["meta_info"]["completion_tokens"] == 4
    assert eng.stats()["running"] == 0


def test_server_info_reports_usable_cache_capacity(small_cache_engine):
    info = small_cache_engine.get_server_info()
    assert info["max_total_tokens"] == 320
    fits = bounded(small_cache_engine.generate, input_ids=[7] * 316,
                   sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    assert fits["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize("params, needle", [
    ({"n": 2**40}, "n must be in"),
    ({"n": 0}, "n must be in"),
    ({"max_new_tokens": 2, 5: 1}, "names must be strings"),
    ({"max_new_tokens": 2, None: 1}, "names must be strings"),
    ({"logit_bias": {"3": float("inf")}}, "logit_bias"),
    ({"stop": ["ok", "a\ud800"]}, r"stop\[1\]"),
])
def test_bad_params_raise_value_error_naming_them(tiny_engine, params, needle):
    with pytest.raises(ValueError, match=needle):
        bounded(tiny_engine.generate, "hi", params)


def test_huge_top_k_means_all_tokens(tiny_engine):
    p = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    huge = bounded(tiny_engine.generate, "hi", {**p, "top_k": 2**63})["output_ids"]
    assert huge == tiny_engine.generate("hi", {**p, "top_k": -1})["output_ids"]


def test_tiny_temperature_is_greedy(tiny_engine):
    p = {"max_new_tokens": 8, "ignore_eos": True}
    greedy = tiny_engine.generate("hello", {**p, "temperature": 0})["output_ids"]
    for t in (1e-300, 1e-9):
        assert tiny_engine.generate("hello", {**p, "temperature": t})["output_ids"] == greedy


def test_lone_surrogate_names_prompt_and_position(tiny_engine):
    with pytest.raises(ValueError, match=r"prompt\[1\].*character 6"):
        tiny_engine.generate(["ok", "Hello \ud800 world"], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="prompt is not valid"):
        tiny_engine.generate("\udfff", {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="prompt"):
        tiny_engine.chat([{"role": "user", "content": "x\ud834"}], {"max_new_tokens": 2})


def test_stats_show_nothing_running_once_an_aborted_call_returned(small_cache_engine):
    eng = small_cache_engine
    out = bounded(eng.generate, input_ids=[[5] * 600, [6] * 600], sampling_params={"max_new_tokens": 4})
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in out)
    s = eng.stats()
    assert s["running"] == 0 and s["waiting"] == 0


def test_generate_iter_closed_early_leaves_nothing_running(tiny_engine):
    it = tiny_engine.generate_iter(["a", "b", "c"], {"max_new_tokens": 300, "ignore_eos": True,
                                                     "temperature": 0})
    next(it)
    it.close()
    s = tiny_engine.stats()
    assert s["running"] == 0 and s["waiting"] == 0


@pytest.mark.slow
def test_structured_output_with_sampling_never_breaks_its_grammar():
    """SGLang's structured-output docs' setting on the embedded model: every request ends as "stop"
    or "length", never as an abort for a token the grammar does not allow."""
    eng = nbgen.Engine()
    try:
        r = eng.generate("x", {"max_new_tokens": 8, "temperature": 1.0, "regex": "[a-z]+", "sampling_seed": 58})
        assert r["meta_info"]["finish_reason"]["type"] != "abort", r["meta_info"]
        schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "pattern": "^[\\w]+$"},
                             "population": {"type": "integer"}}, "required": ["name", "population"]})
        outs = eng.generate(["Give me the information of the capital of China in the JSON format."] * 3,
                            [{"temperature": 0.1, "top_p": 0.95, "json_schema": schema, "sampling_seed": s,
                              "max_new_tokens": 48} for s in range(3)], use_tqdm=False)
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] in ("stop", "length"), o["meta_info"]
        for seed in range(40):
            r = eng.generate("x", {"max_new_tokens": 4, "temperature": 1.0, "regex": "[a-z]+",
                                   "sampling_seed": seed})
            assert r["meta_info"]["finish_reason"]["type"] != "abort", (seed, r["meta_info"])
    finally:
        eng.shutdown()


def test_interrupted_batch_raises_one_line_keyboard_interrupt_and_the_engine_serves(tiny_engine):
    """The stop button (SIGINT -> KeyboardInterrupt in the main thread) mid-batch: a KeyboardInterrupt
    whose notebook rendering is one line with the counts; the aborted requests leave nothing running."""
    import _thread
    import threading
    import time

    from nbgen.core.interrupt import GenerationInterrupted

    fired = threading.Event()

    def press_stop() -> None:
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end and tiny_engine.stats()["running"] == 0:
            time.sleep(0.005)  # polling the engine's state, not waiting for time to pass
        fired.set()
        _thread.interrupt_main()

    threading.Thread(target=press_stop, daemon=True).start()
    with pytest.raises(KeyboardInterrupt) as info:
        tiny_engine.generate(["a b"] * 4, {"max_new_tokens": 1000, "ignore_eos": True}, use_tqdm=False)
    assert fired.is_set()
    assert isinstance(info.value, GenerationInterrupted)
    lines = info.value._render_traceback_()
    assert len(lines) == 1 and lines[0].startswith("interrupted: 0/4 requests"), lines
    assert tiny_engine.stats()["running"] == 0
    assert tiny_engine.generate("a b", {"max_new_tokens": 3, "ignore_eos": True})["meta_info"]["completion_tokens"] == 3
