"""Priority scheduling through the Engine on the tiny Llama (CPU): a late high-priority request
finishes before a batch of low-priority ones, with the same greedy outputs as run alone."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import nbgen
from nbgen.runtime.overlap import OverlapStepper
from nbgen.runtime.priority import DISABLED_MESSAGE

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_high_priority_request_finishes_first_with_the_same_outputs(tiny_llama_dir, device, overlap):
    """Preemption for priority also while the overlap stepper has a step in flight."""
    lows = [[5 + (i * 7 + j) % 300 for j in range(8 + i)] for i in range(6)]
    high = [350 + j for j in range(10)]
    sp_low, sp_high = {**GREEDY, "max_new_tokens": 64}, {**GREEDY, "max_new_tokens": 8}
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device=device, max_running_requests=2,
                      enable_priority_scheduling=True, disable_overlap_schedule=not overlap) as e:
        if overlap and e.loop._overlap is None:                 # the CPU steps synchronously by default
            loop = e.loop
            loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
        done: dict[int, tuple[float, dict]] = {}

        def run_lows() -> None:
            for i, out in e.generate_iter(input_ids=lows, sampling_params=sp_low, priority=0):
                done[i] = (time.perf_counter(), out)

        worker = threading.Thread(target=run_lows)
        worker.start()
        deadline = time.time() + 60
        while (s := e.stats())["running"] < 2 and time.time() < deadline:
            time.sleep(0.001)
        assert s["priorities"] == {0: {"running": 2, "waiting": 4}}
        unfinished = set(range(len(lows))) - set(done)
        out_high = e.generate(input_ids=high, sampling_params=sp_high, priority=100)
        t_high = time.perf_counter()
        worker.join(timeout=120)
        assert len(done) == len(lows)
        # it came first: before every low that was waiting when it arrived (fcfs ran lows 0 and 1; the
        # low left running beside the high may finish first when this thread was slow to submit it)
        assert unfinished >= {2, 3, 4, 5} and all(done[i][0] > t_high for i in (2, 3, 4, 5))
        assert e.loop.scheduler.num_preemptions >= 1            # it took a running low's slot
        assert e.stats()["priorities"] == {}                      # nothing left (keys of live requests)
        alone = [e.generate(input_ids=p, sampling_params=sp_low)["output_ids"] for p in lows]
        assert [done[i][1]["output_ids"] for i in range(len(lows))] == alone
        assert out_high["output_ids"] == e.generate(input_ids=high, sampling_params=sp_high)["output_ids"]


@pytest.mark.parametrize("bad", ["high", 1.5, True, [1, 2], {"p": 1}])
def test_invalid_priority_is_a_value_error_and_the_engine_keeps_serving(tiny_engine, bad):
    with pytest.raises(ValueError, match="priority"):
        tiny_engine.generate("hello", {"max_new_tokens": 2}, priority=bad)
    with pytest.raises(ValueError, match="priority"):
        list(tiny_engine.generate_iter(["a", "b"], {"max_new_tokens": 2}, priority=bad))
    with pytest.raises(ValueError, match="priority"):
        asyncio.run(tiny_engine.async_generate("hello", {"max_new_tokens": 2}, priority=bad))
    assert tiny_engine.generate("hello", {"max_new_tokens": 2, "ignore_eos": True})["meta_info"]["completion_tokens"] == 2


def test_priority_ignored_when_disabled(tiny_engine):
    sp = {**GREEDY, "max_new_tokens": 4}
    assert tiny_engine.generate("x y", sp, priority=7)["output_ids"] == tiny_engine.generate("x y", sp)["output_ids"]


def test_abort_on_priority_when_disabled_and_config_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="priority_scheduling_preemption_threshold"):
        nbgen.Engine(tiny_llama_dir, priority_scheduling_preemption_threshold=-1)
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", abort_on_priority_when_disabled=True) as e:
        out = e.generate(["a", "b"], {"max_new_tokens": 2}, priority=1)
        assert [o["meta_info"]["finish_reason"] for o in out] == [{"type": "abort", "message": DISABLED_MESSAGE,
                                                                   "status_code": None, "err_type": None}] * 2
        assert e.generate("a", {"max_new_tokens": 2})["meta_info"]["finish_reason"]["type"] == "length"


def test_dashboard_shows_priorities():
    from nbgen.notebook.state import StatsHistory, dashboard_html, dashboard_text

    st = {"running": 3, "waiting": 4, "time": 1.0,
          "priorities": {10: {"running": 1, "waiting": 0}, None: {"running": 2, "waiting": 4}}}
    h = StatsHistory()
    h.append(st)
    assert "priority 10: 1 running, 0 waiting | none: 2 running, 4 waiting" in dashboard_html(h)
    assert dashboard_text(st).endswith("| priority 10: 1 running, 0 waiting | none: 2 running, 4 waiting")
    h.append({**st, "priorities": {}})
    assert "nbgen-priorities" not in dashboard_html(h) and "priority" not in dashboard_text({"running": 1})


def test_max_queued_requests_aborts_the_overflow_of_a_batch(tiny_llama_dir, device):
    sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device=device, max_running_requests=1,
                      max_queued_requests=1) as eng:
        outs = eng.generate(["a b", "c d", "e f"], sp)
        assert len(outs[0]["output_ids"]) == 3 and outs[0]["meta_info"]["finish_reason"]["type"] == "length"
        for o in outs[1:]:       # submitted together: one waits, the others find the queue full
            fr = o["meta_info"]["finish_reason"]
            assert fr["type"] == "abort" and fr["message"] == "The request queue is full."
        assert len(eng.generate("again", sp)["output_ids"]) == 3     # the engine keeps serving
