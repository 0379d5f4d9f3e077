"""The SGLang-compatible Engine API on a tiny random Llama: shapes, modes, validation, control."""
from __future__ import annotations

import asyncio
import gc
import threading
import time
import types
import weakref

import pytest

import nbgen
from nbgen.utils import async_stream_and_merge, stream_and_merge

GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


def test_single_and_batch_shapes(tiny_engine):
    out = tiny_engine.generate("Hello, my name is", GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    for key in ("id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency"):
        assert key in meta
    assert meta["completion_tokens"] == len(out["output_ids"]) > 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    prompts = ["The capital of France is", "Hello", "def add(a, b):"]
    outs = tiny_engine.generate(prompts, GREEDY)
    assert [o["text"] for o in outs] == [tiny_engine.generate(p, GREEDY)["text"] for p in prompts]


def test_per_prompt_params_and_n(tiny_engine):
    outs = tiny_engine.generate(["a b", "c d"], [{"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                                                 {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 5]
    outs = tiny_engine.generate(["x y", "z"], {"temperature": 1.0, "n": 3, "max_new_tokens": 8,
                                               "ignore_eos": True, "sampling_seed": 7})
    assert len(outs) == 6
    assert all(o["meta_info"]["prompt_tokens"] == outs[0]["meta_info"]["prompt_tokens"] for o in outs[:3])
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1  # samples differ


def test_stream_joins_to_full_text(tiny_engine):
    p = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    full = tiny_engine.generate("Caf\u00e9 cr\u00e8me", p)
    chunks = list(tiny_engine.generate("Caf\u00e9 cr\u00e8me", p, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert stream_and_merge(tiny_engine, "Caf\u00e9 cr\u00e8me", p) == full["text"]


def test_async_modes(tiny_engine):
    p = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    ref = tiny_engine.generate("Hello", p)["text"]

    async def main():
        one = await tiny_engine.async_generate("Hello", p)
        many = await asyncio.gather(*[tiny_engine.async_generate("Hello", p) for _ in range(8)])
        pieces = [c["text"] async for c in await tiny_engine.async_generate("Hello", p, stream=True)]
        merged = [t async for t in async_stream_and_merge(tiny_engine, "Hello", p)]
        return one, many, pieces, merged

    one, many, pieces, merged = asyncio.run(main())
    assert one["text"] == ref and all(m["text"] == ref for m in many)
    assert "".join(pieces) == ref and "".join(merged) == ref


def test_threads_at_once(tiny_engine):
    p = {"temperature": 0.0, "max_new_tokens": 8}
    ref = tiny_engine.generate("thread", p)["text"]
    results = []

    def work():
        results.append(tiny_engine.generate("thread", p)["text"])

    ts = [threading.Thread(target=work) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert results == [ref] * 6


@pytest.mark.parametrize("params,needle", [
    ({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"n": 0}, "n must"),
    ({"logit_bias": {10**6: 1.0}}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"temprature": 0.5}, "temperature"), ({"max_new_tokens": 10**6}, "max_new_tokens"),
    ({"top_k": "5"}, "top_k"),
])
def test_bad_sampling_params(tiny_engine, params, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        tiny_engine.generate("hi", params)


def test_bad_inputs(tiny_engine):
    with pytest.raises(ValueError, match="exactly one"):
        tiny_engine.generate()
    with pytest.raises(ValueError, match="exactly one"):
        tiny_engine.generate("a", input_ids=[1, 2])
    with pytest.raises(ValueError, match="empty"):
        tiny_engine.generate([])
    with pytest.raises(TypeError, match=r"prompt\[1\]"):
        tiny_engine.generate(["ok", 3])
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_engine.generate(input_ids=[1, 10**6])
    with pytest.raises(ValueError, match=r"input_ids\[1\] has token ids outside the vocabulary .*\[-3\]"):
        tiny_engine.generate(input_ids=[[1, 2], [5, -3, 7]])
    with pytest.raises(TypeError, match=r"input_ids\[1\] must be a list of ints"):
        tiny_engine.generate(input_ids=[[1, 2], [5, True]])     # a bool is not a token id
    with pytest.raises(TypeError, match=r"input_ids\[0\] must be a list of ints"):
        tiny_engine.generate(input_ids=[[1, 2.0]])
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        tiny_engine.generate(["a", "b"], [{}])
    # a bad item fails the whole call and nothing runs
    before = tiny_engine.stats()["total_finished"]
    with pytest.raises(ValueError, match="top_p"):
        tiny_engine.generate(["a", "b"], [{}, {"top_p": 2}])
    assert tiny_engine.stats()["total_finished"] == before


def test_unknown_engine_kwarg_suggests():
    with pytest.raises(ValueError, match="did you mean 'max_running_requests'"):
        nbgen.Engine("/nonexistent", max_runing_requests=4)


def test_stop_strings_and_ids(tiny_engine):
    base = tiny_engine.generate("The capital", {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    ids, text = base["output_ids"], base["text"]
    stop_tok = ids[5]
    out = tiny_engine.generate("The capital", {"temperature": 0, "max_new_tokens": 16,
                                               "stop_token_ids": [stop_tok]})
    first = ids.index(stop_tok)
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    if len(text) >= 6:
        stop = text[3:6]
        out = tiny_engine.generate("The capital", {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True,
                                                   "stop": [stop]})
        assert out["text"] == text[: text.index(stop)]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        kept = tiny_engine.generate("The capital", {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True,
                                                    "stop": stop, "no_stop_trim": True})
        assert kept["text"] == text[: text.index(stop) + len(stop)]


def test_generate_iter_close_aborts(tiny_engine):
    p = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    it = tiny_engine.generate_iter(["a", "b", "c"], [{"temperature": 0, "max_new_tokens": 1}, p, p])
    idx, out = next(it)
    assert idx == 0 and out["meta_info"]["completion_tokens"] == 1
    it.close()
    deadline = time.time() + 10
    while tiny_engine.stats()["running"] + tiny_engine.stats()["waiting"] and time.time() < deadline:
        time.sleep(0.05)
    assert tiny_engine.stats()["running"] == 0


def test_keyboard_interrupt_aborts_and_engine_survives(tiny_llama_dir):
    """Ctrl-C in a blocking generate() aborts its requests and the engine serves the next call.

    Event-driven, so it holds on a loaded machine: a logit processor (on the loop thread) sends the
    interrupt at its first token, then holds the engine until the main thread's SIGINT handler
    has run; the requests can therefore not finish before the interrupt lands."""
    import _thread
    import signal

    handled, sent = threading.Event(), threading.Event()

    def processor(logits, params=None):
        if not sent.is_set():
            sent.set()
            _thread.interrupt_main()
            assert handled.wait(60), "the main thread never took the interrupt"
        return logits

    def on_sigint(signum, frame):
        handled.set()
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, on_sigint)
    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", enable_custom_logit_processor=True)
    try:
        params = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}
        with pytest.raises(KeyboardInterrupt):
            eng.generate(["long"] * 8, params, use_tqdm=False,
                         custom_logit_processor=[None] * 7 + [processor])
        assert handled.is_set()
        stats = eng.stats()                      # the aborted call has returned: nothing left running
        assert stats["running"] == 0 and stats["waiting"] == 0
        assert stats["total_output_tokens"] < 8 * 900
        out = eng.generate("after", {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 4
    finally:
        signal.signal(signal.SIGINT, old)
        eng.shutdown()


def test_cancelled_task_aborts_request(tiny_engine):
    async def main():
        task = asyncio.ensure_future(tiny_engine.async_generate(
            "x", {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}))
        deadline = time.time() + 60
        while tiny_engine.stats()["running"] == 0 and not task.done() and time.time() < deadline:
            await asyncio.sleep(0.002)     # until the request runs: cancelled mid-generation, however fast
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.time() + 10
    while tiny_engine.stats()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert tiny_engine.stats()["running"] == 0


def test_partial_stream_ends_with_abort(tiny_engine):
    gen = tiny_engine.generate("x", {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}, stream=True)
    next(gen)
    rid = None
    for chunk in gen:
        rid = chunk["meta_info"]["id"]
        tiny_engine.abort(rid)
        break
    last = list(gen)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"


def test_failure_in_one_request_spares_the_rest(tiny_engine, monkeypatch):
    from nbgen.runtime import tracker

    orig = tracker.Tracked.advance

    def flaky(self, scheduler):
        if self.req.prompt_ids and self.req.params.max_new_tokens == 7:
            raise RuntimeError("boom in one request")
        return orig(self, scheduler)

    monkeypatch.setattr(tracker.Tracked, "advance", flaky)
    outs = tiny_engine.generate(["a", "b"], [{"temperature": 0, "max_new_tokens": 7},
                                             {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}])
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "boom" in outs[0]["meta_info"]["finish_reason"]["message"]
    assert outs[1]["meta_info"]["completion_tokens"] == 5


def test_chat_stats_info(tiny_engine):
    out = tiny_engine.chat([{"role": "user", "content": "Hello"}], {"temperature": 0, "max_new_tokens": 4})
    assert out["meta_info"]["prompt_tokens"] > 3
    s = tiny_engine.stats()
    for key in ("running", "waiting", "kv_pages_used", "kv_pages_total", "prefix_cache_pages",
                "input_tok_s", "output_tok_s", "total_input_tokens", "total_output_tokens"):
        assert key in s
    assert s["total_output_tokens"] > 0 and s["kv_pages_total"] > 0
    info = tiny_engine.get_server_info()
    assert info["page_size"] == 16 and info["attention_backend"]
    assert tiny_engine.get_model_info()["architectures"] == ["LlamaForCausalLM"]


def test_model_info_has_sglang_keys(tiny_engine):
    """Every key of SGLang's Engine.get_model_info(), so code reading any of them runs."""
    info = tiny_engine.get_model_info()
    for key in ("model_path", "served_model_name", "is_generation", "weight_version", "load_format",
                "reasoning_parser", "tool_call_parser"):
        assert key in info, key
    assert info["reasoning_parser"] is None and info["tool_call_parser"] is None
    assert info["is_generation"] is True and info["weight_version"] == tiny_engine.weight_version


def test_flush_cache(tiny_engine):
    tiny_engine.generate("flush me " * 10, {"temperature": 0, "max_new_tokens": 2})
    assert tiny_engine.stats()["prefix_cache_pages"] > 0
    assert tiny_engine.flush_cache().success is True
    assert tiny_engine.stats()["prefix_cache_pages"] == 0


def _engine_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """nbgen's own threads started since ``before`` that are still alive (torch or tqdm helper
    threads that outlive an engine are not the engine's)."""
    return [t for t in threading.enumerate() if t not in before and t.name.startswith("nbgen")]


def test_shutdown_and_recreate(tiny_llama_dir):
    before = set(threading.enumerate())
    for _ in range(2):
        eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu")
        assert eng.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] <= 2
        eng.shutdown()
        assert eng.final_stats["total_finished"] == 1 and eng.final_stats["running"] == 0
        eng.shutdown()  # idempotent
        with pytest.raises(RuntimeError, match="engine is shut down"):
            eng.generate("hi")
    assert _engine_threads(before) == []      # shutdown() joined the loop thread and its workers
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu") as eng:
        assert eng.generate("x", {"max_new_tokens": 1})
    with pytest.raises(RuntimeError, match="engine is shut down"):
        eng.stats()


def test_seed_reproducible_across_batch_compositions(tiny_engine):
    p = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 1234}
    alone = tiny_engine.generate("seeded prompt", p)["output_ids"]
    others = {"temperature": 0.7, "max_new_tokens": 9, "ignore_eos": True}
    batch = tiny_engine.generate(["other one", "seeded prompt", "and another"], [others, p, others])
    assert batch[1]["output_ids"] == alone
    other_seed = tiny_engine.generate("seeded prompt", {**p, "sampling_seed": 99})["output_ids"]
    assert other_seed != alone


def test_output_logprobs_match_teacher_forcing(tiny_engine, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    out = tiny_engine.generate("Hello, my name is", {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
                               return_logprob=True, top_logprobs_num=3, token_ids_logprob=[5, 7])
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(len(row) == 3 and row[0][0] >= row[1][0] >= row[2][0] for row in meta["output_top_logprobs"])
    assert all([t for _, t, _ in row] == [5, 7] for row in meta["output_token_ids_logprobs"])
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = tiny_engine.tokenizer.encode("Hello, my name is")
    full = torch.tensor([ids + out["output_ids"]])
    with torch.no_grad():
        ref = hf(full).logits[0, len(ids) - 1:-1].log_softmax(-1)
    for i, (lp, tok, _) in enumerate(lps):
        assert abs(lp - ref[i, tok].item()) < 1e-4
        assert meta["output_top_logprobs"][i][0][1] == ref[i].argmax().item()


@pytest.mark.filterwarnings("ignore:1 other nbgen Engine is still running")
def test_sampled_logprobs_are_temperature_scaled_as_sglang(tiny_engine, tiny_llama_dir):
    """SGLang's default: a sampled token's logprobs are log_softmax(logits / temperature) (before
    top-k/top-p); prompt logprobs stay raw. ``return_original_logprob=True`` (SGLang's
    SGLANG_RETURN_ORIGINAL_LOGPROB) reports them without the temperature."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    import nbgen

    sp = {"temperature": 0.6, "top_k": 20, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 5}
    kw = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = tiny_engine.tokenizer.encode("Hello, my name is")
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device=os.environ.get("NBGEN_TEST_DEVICE", "cpu"),
                      return_original_logprob=True) as orig_eng:
        for eng, temp in ((tiny_engine, 0.6), (orig_eng, 1.0)):
            out = eng.generate("Hello, my name is", sp, **kw)
            meta = out["meta_info"]
            with torch.no_grad():
                logits = hf(torch.tensor([ids + out["output_ids"]])).logits[0]
            ref = (logits[len(ids) - 1:-1] / temp).log_softmax(-1)
            for i, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
                assert abs(lp - ref[i, tok].item()) < 1e-4, (temp, i)
                assert [t for _, t, _ in meta["output_top_logprobs"][i]] == ref[i].topk(2).indices.tolist()
            raw = logits[: len(ids) - 1].log_softmax(-1)
            for pos in range(1, len(ids)):
                assert abs(meta["input_token_logprobs"][pos][0] - raw[pos - 1, ids[pos]].item()) < 1e-4
    with pytest.raises(ValueError, match="return_original_logprob must be a bool"):
        nbgen.Engine(tiny_llama_dir, return_original_logprob="yes")


def test_script_without_main_guard_exits_cleanly(tiny_llama_dir, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text("import nbgen\n"
                      f"llm = nbgen.Engine({tiny_llama_dir!r}, dtype='float32')\n"
                      "print(len(llm.generate(['a', 'b'], {'max_new_tokens': 3}, use_tqdm=False)))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "2"


def test_prompt_top_and_id_logprobs(tiny_engine, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    out = tiny_engine.generate("Hello, my name is", {"temperature": 0, "max_new_tokens": 1},
                               return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                               token_ids_logprob=[5, 6])
    meta = out["meta_info"]
    ids = tiny_engine.tokenizer.encode("Hello, my name is")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)          # [L, V]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(ids)
    for pos in range(1, len(ids)):
        top = meta["input_top_logprobs"][pos]
        assert [t for _, t, _ in top] == ref[pos - 1].topk(2).indices.tolist()
        got = {t: lp for lp, t, _ in meta["input_token_ids_logprobs"][pos]}
        assert abs(got[5] - ref[pos - 1, 5].item()) < 1e-4 and abs(got[6] - ref[pos - 1, 6].item()) < 1e-4


def test_startup_heap_is_frozen(tiny_engine):
    """After start-up the heap (torch, the model) sits in the GC's permanent generation, so a full
    collection during generation does not walk it while holding the GIL."""
    import gc

    assert gc.get_freeze_count() > 10_000   # torch alone is hundreds of thousands of objects
    out = tiny_engine.generate("hello", {"temperature": 0.0, "max_new_tokens": 4})
    assert len(out["output_ids"]) == 4


def test_code_loaded_by_steps_is_frozen_when_idle(tiny_engine):
    """Modules imported after start-up (on CUDA the first prefill loads flashinfer's prefill module)
    join the frozen heap once the loop goes idle after its steps, so later full collections skip them;
    without new modules an idle loop freezes nothing."""
    import gc
    import sys
    import types

    def in_collected_heap(obj: object) -> bool:
        return any(o is obj for o in gc.get_objects())

    tiny_engine.generate("warm", {"temperature": 0.0, "max_new_tokens": 2})
    time.sleep(0.2)                                   # the loop goes idle (and freezes) after delivering
    fresh = types.ModuleType("nbgen_test_lazy_module")
    exec("def helper(x):\n    return [x]\n", fresh.__dict__)
    before = gc.get_freeze_count()
    tiny_engine.generate("hello", {"temperature": 0.0, "max_new_tokens": 2})
    time.sleep(0.2)
    assert gc.get_freeze_count() <= before           # no module loaded: nothing frozen (frozen objects may die)
    assert in_collected_heap(fresh.helper)
    sys.modules[fresh.__name__] = fresh               # "imported" while the engine runs steps
    try:
        tiny_engine.generate("hello", {"temperature": 0.0, "max_new_tokens": 2})
        deadline = time.time() + 5
        while in_collected_heap(fresh.helper) and time.time() < deadline:
            time.sleep(0.02)
        assert not in_collected_heap(fresh.helper)    # now in the permanent generation
        assert gc.get_freeze_count() > before
    finally:
        del sys.modules[fresh.__name__]


# ---- several engines, start-up feedback, model name, aborted requests ------------------------------
def _running_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "still running in this process" in str(w.message)]


def test_a_second_running_engine_warns_once_naming_the_others(tiny_llama_dir):
    import gc
    import os
    import warnings

    from nbgen.engine import running_engines

    base = len(running_engines())  # the shared test engine may be running

    def start() -> tuple[nbgen.Engine, list[str]]:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu")
        return eng, _running_warnings(record)

    def expected(n: int) -> list[str]:
        return [f"{n} other nbgen Engine{'s are' if n > 1 else ' is'} still running"] if n else []

    a, said = start()
    assert [m[:len(e)] for m, e in zip(said, expected(base))] == expected(base) and len(said) == len(expected(base))
    b, said = start()
    assert len(said) == 1 and said[0].startswith(expected(base + 1)[0])
    name = os.path.basename(tiny_llama_dir)
    assert f"({name})" in said[0] and "llm.shutdown()" in said[0] and "with nbgen.Engine() as llm:" in said[0]
    assert a in running_engines() and b in running_engines()
    a.shutdown()
    b.shutdown()
    assert a not in running_engines()
    c, said = start()                      # the shut-down ones do not count
    assert len(said) == len(expected(base))
    del c
    gc.collect()                           # a collected engine does not count either
    assert len(running_engines()) == base
    d, said = start()
    assert len(said) == len(expected(base))
    d.shutdown()


def test_model_name_in_server_info(tiny_engine, tiny_llama_dir):
    import os

    from nbgen.engine_loading import model_name

    assert tiny_engine.model_name == os.path.basename(tiny_llama_dir)
    assert tiny_engine.get_server_info()["model_name"] == tiny_engine.model_name
    cache = "/root/.cache/nbgen"
    assert model_name(f"{cache}/converted/SmolLM2-135M-Instruct.Q4_1-3114a230d21cd82a") == "SmolLM2-135M-Instruct"
    assert model_name(f"{cache}/embedded/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert model_name("/m/Qwen2.5-0.5B-Instruct-Q8_0.gguf") == "Qwen2.5-0.5B-Instruct"
    assert model_name("/hf/models--meta-llama--Llama-3.1-8B/snapshots/0e9e39f249a16976918f6564b8830bc894c89659") \
        == "Llama-3.1-8B"
    assert model_name("/models/Llama-3.1-8B-Instruct/") == "Llama-3.1-8B-Instruct"


def test_stats_count_aborted_requests_apart_from_finished(tiny_engine):
    before = tiny_engine.stats()
    tiny_engine.generate("a b", {"max_new_tokens": 2})
    it = tiny_engine.generate("a b", {"max_new_tokens": 500, "ignore_eos": True}, stream=True)
    next(it)
    it.close()  # aborts the request and returns once the loop let it go
    after = tiny_engine.stats()
    assert after["total_finished"] - before["total_finished"] == 1
    assert after["total_aborted"] - before["total_aborted"] == 1


def test_start_up_stages_reach_the_callback_in_order(tiny_llama_dir, capsys, caplog):
    import logging
    import warnings

    stages: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the shared test engine is running too
        with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", on_stage=stages.append):
            pass
        assert stages == ["loading weights", "sizing the KV cache"]  # CPU: no CUDA graphs to capture
        # no callback, no notebook: one INFO log line per stage and the summary, nothing printed
        with caplog.at_level(logging.INFO, logger="nbgen"):
            with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", log_level="info"):
                pass
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert logged[:2] == ["nbgen: loading weights", "nbgen: sizing the KV cache"]
    assert logged[2].startswith("nbgen: loaded ") and " on cpu in " in logged[2]
    assert capsys.readouterr().out == ""


def test_embedded_model_fetch_is_a_stage(tmp_path, monkeypatch):
    """Finding (or downloading) the embedded model is reported as a stage before it happens."""
    from nbgen.models import embedded

    stages: list[str] = []
    gguf = tmp_path / "model.gguf"

    def fake_download():
        assert stages == ["fetching the embedded model"]   # reported before the download starts
        return gguf

    monkeypatch.setattr(embedded, "download_gguf", fake_download)
    monkeypatch.setattr(embedded, "is_converted", lambda path: False)
    assert embedded.default_model_path(stages.append) == str(gguf)
    assert stages == ["fetching the embedded model"]


def test_loading_line_in_a_notebook_ends_without_a_spinner(tiny_llama_dir, monkeypatch):
    import re
    import types
    import warnings

    IPython = pytest.importorskip("IPython")
    import IPython.display

    from nbgen.engine_loading import StartupFeedback

    class Handle:
        def __init__(self, bundle):
            self.bundles = [bundle]

        def update(self, bundle, raw=False):
            self.bundles.append(bundle)

    shown: list[Handle] = []
    with monkeypatch.context() as m:  # a Jupyter kernel only while the feedback line is made
        m.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=object()))
        m.setattr(IPython.display, "display", lambda b, raw=False, display_id=None: shown.append(Handle(b)) or shown[-1])
        line = StartupFeedback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", on_stage=line) as eng:
            line.done(eng.model_name, eng.device)
    [handle] = shown
    *live, final = handle.bundles
    assert [re.search(r'data-stage="([^"]+)"', b["text/html"]).group(1) for b in live] == \
        ["starting the engine", "loading weights", "sizing the KV cache"]
    assert all("<progress" in b["text/html"] for b in live)
    assert "<progress" not in final["text/html"] and "nbgen-loaded" in final["text/html"]
    assert re.fullmatch(r"nbgen: loaded tiny_llama\d* on cpu in \d+\.\d s", final["text/plain"])
    line2 = StartupFeedback()  # outside a kernel: nothing displayed
    line2.failed()
    assert len(shown) == 1


def test_a_batch_of_text_prompts_tokenizes_as_each_alone(tiny_engine) -> None:
    texts = ["Hello world", "<|im_start|>user\nhi<|im_end|>", "  café 😀", "a" * 300]
    sp = {"max_new_tokens": 1, "temperature": 0}
    outs = tiny_engine.generate(texts, sp)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(tiny_engine.tokenizer.encode(t)) for t in texts]
    assert [o["output_ids"] for o in outs] == [tiny_engine.generate(t, sp)["output_ids"] for t in texts]


# not followed: Python modules and functions (their globals reach every engine of the process)
_SKIP = (type, types.ModuleType, types.FunctionType, str, bytes, int, float)


def _models_reachable_from(root: object) -> list:
    """The torch modules named *ForCausalLM reachable from ``root`` through references."""
    seen, todo, found = {id(root)}, [root], []
    while todo:
        obj = todo.pop()
        if type(obj).__name__.endswith("ForCausalLM"):
            found.append(obj)
            continue
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, _SKIP):
                seen.add(id(ref))
                todo.append(ref)
    return found


def test_shutdown_lets_go_of_the_model(tiny_llama_dir):
    """After shutdown nothing keeps the model alive (its GPU memory must return before another
    Engine in the same process sizes its KV cache)."""
    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu")
    eng.generate("hello", {"max_new_tokens": 2})
    models = _models_reachable_from(eng)
    assert len(models) == 1
    ref = weakref.ref(models[0])
    del models
    eng.shutdown()
    assert ref() is None
