"""A step that raises where no guard catches it (the scheduler's update, a grammar's jump-forward) aborts the
running requests with the error; the engine keeps serving, with no pages held, on the synchronous and the
overlapped step (runtime/loop.py ``_step_failed``, ``OverlapStepper.drop``)."""
from __future__ import annotations

import json

import pytest

import nbgen
from nbgen.runtime.overlap import OverlapStepper


def _raise_at(n: int, real):
    """``real`` wrapped to raise RuntimeError('injected') at its n-th call, once."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    return wrapped


def _check_aborted_then_serving(eng: nbgen.Engine, outs: list[dict]) -> None:
    for o in outs:
        reason = o["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "RuntimeError: injected" in reason["message"], reason
    again = eng.generate(["one", "two"], {"max_new_tokens": 6, "ignore_eos": True})
    assert [o["meta_info"]["completion_tokens"] for o in again] == [6, 6]
    assert eng.flush_cache()            # nothing running: the aborted requests left the scheduler
    stats = eng.stats()
    assert stats["running"] == 0 and stats["kv_pages_used"] == 0, stats


@pytest.fixture(params=["sync", "overlap"])
def eng(request):
    with nbgen.Engine(device="cpu", enable_jump_forward=True) as e:
        if request.param == "overlap":   # the stepper CUDA engines run, forced on here
            loop = e.loop
            loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
        yield e


def test_an_update_that_raises_aborts_the_running_requests(eng):
    sched = eng.loop.scheduler
    real = sched.update
    eng.loop.call(lambda: setattr(sched, "update", _raise_at(3, real)))
    outs = eng.generate(["a", "b", "c"], {"max_new_tokens": 10, "ignore_eos": True})
    eng.loop.call(lambda: setattr(sched, "update", real))
    _check_aborted_then_serving(eng, outs)


def test_a_jump_forward_that_raises_aborts_the_running_requests(eng):
    schema = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    eng.generate("x", {"max_new_tokens": 1, "regex": "[ab]"})   # makes the grammar service
    jumper = eng.loop.delivery.grammar.jumper
    real = jumper.jump_rows
    eng.loop.call(lambda: setattr(jumper, "jump_rows", _raise_at(2, real)))
    outs = eng.generate(["Describe a person:", "Another person:"],
                        {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)})
    eng.loop.call(lambda: setattr(jumper, "jump_rows", real))
    _check_aborted_then_serving(eng, outs)
