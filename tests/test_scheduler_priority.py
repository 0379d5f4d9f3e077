"""Priority scheduling in the Scheduler (SGLang's enable_priority_scheduling) with the fake runner.

Admission order (priority, then the schedule policy), preemption beyond the threshold (slots and KV
pages, all or none), the low-values-first flip, the starvation guard, stats and config checks.
"""
from __future__ import annotations

import sys

import pytest

from nbgen.core.config import EngineConfig
from nbgen.core.scheduler_config import PriorityConfig
from nbgen.core.request import Request, Status
from nbgen.runtime.priority import DISABLED_MESSAGE
from nbgen.runtime.scheduler import Scheduler, SchedulerConfig
from tests.test_scheduler import FakeRunner, req, run


def psched(policy: str = "fcfs", **kw) -> Scheduler:
    """A scheduler with priority scheduling on; ``kw`` splits into PriorityConfig / SchedulerConfig."""
    pnames = set(PriorityConfig.__dataclass_fields__)
    pkw = {"enable_priority_scheduling": True, **{k: v for k, v in kw.items() if k in pnames}}
    base = dict(page_size=4, num_pages=512, max_running_requests=64, chunked_prefill_size=1024,
                schedule_policy=policy)
    base.update({k: v for k, v in kw.items() if k not in pnames})
    return Scheduler(SchedulerConfig(**base, priority=PriorityConfig(**pkw)))


def preq(rid: str, priority, prompt=None, max_new: int = 8, **kw) -> Request:
    r = req(rid, prompt or [100 + (sum(map(ord, rid)) + j) % 90 for j in range(6)], max_new=max_new, **kw)
    r.priority = priority
    return r


def admitted(s: Scheduler) -> list[str]:
    """rids of one step's newly admitted requests, in admission order."""
    batch = s.schedule()
    return [q.req.rid for q in batch.seqs] if batch else []


def step(s: Scheduler, runner: FakeRunner, n: int = 1) -> None:
    for _ in range(n):
        batch = s.schedule()
        if batch is not None:
            s.update(batch, runner.step(batch))


def alone(r: Request) -> list[int]:
    """The outputs of r run by itself (no priorities): the reference for preempted runs."""
    s = Scheduler(SchedulerConfig(page_size=4, num_pages=512, max_running_requests=4, chunked_prefill_size=1024))
    c = req(r.rid, r.prompt_ids, max_new=r.params.max_new_tokens)
    s.add(c)
    run(s)
    return c.output_ids


# ---- admission order ----------------------------------------------------------------------------
def test_admission_by_priority_then_arrival() -> None:
    s = psched()
    for rid, p in [("a", 1), ("b", 5), ("c", 3), ("d", 5), ("e", 1)]:
        s.add(preq(rid, p))
    assert admitted(s) == ["b", "d", "c", "a", "e"]


def test_low_values_first_flips_the_order() -> None:
    s = psched(schedule_low_priority_values_first=True)
    for rid, p in [("a", 1), ("b", 5), ("c", 3), ("d", 5), ("e", 1)]:
        s.add(preq(rid, p))
    assert admitted(s) == ["a", "e", "c", "b", "d"]


def test_equal_priority_keeps_fcfs_and_disabled_ignores_priority() -> None:
    s = psched()
    for rid in "abcde":
        s.add(preq(rid, 7))
    assert admitted(s) == list("abcde")
    off = Scheduler(SchedulerConfig(page_size=4, num_pages=512, max_running_requests=64, chunked_prefill_size=1024))
    for rid, p in [("a", 1), ("b", 5), ("c", 3)]:
        off.add(preq(rid, p))
    assert admitted(off) == ["a", "b", "c"]


def test_no_priority_is_least_important_unless_a_default_is_set() -> None:
    s = psched()
    s.add(preq("none", None))
    s.add(preq("neg", -(10**9)))
    assert admitted(s) == ["neg", "none"]
    assert s.running[1].priority == -sys.maxsize - 1
    s = psched(default_priority_value=0)
    s.add(preq("none", None))
    s.add(preq("neg", -5))
    assert admitted(s) == ["none", "neg"]


def test_policy_applies_within_a_priority() -> None:
    s = psched("lof")
    for rid, p, mx in [("a", 1, 4), ("b", 1, 30), ("c", 2, 2), ("d", 2, 20)]:
        s.add(preq(rid, p, max_new=mx))
    assert admitted(s) == ["d", "c", "b", "a"]
    s = psched("lpm")
    shared = list(range(200, 216))                               # 4 full pages
    warm = req("warm", shared + [1], max_new=1)
    s.add(warm)
    run(s)                                                       # the shared prefix is now cached
    s.add(preq("miss", 3, prompt=list(range(300, 317))))
    s.add(preq("hit", 3, prompt=shared + [5, 6]))
    s.add(preq("top", 4, prompt=list(range(400, 417))))
    assert admitted(s) == ["top", "hit", "miss"]


# ---- preemption ---------------------------------------------------------------------------------
def test_preemption_only_beyond_the_threshold() -> None:
    s = psched(max_running_requests=2, priority_scheduling_preemption_threshold=10)
    runner = FakeRunner(s)
    lows = [preq("low0", 0, max_new=40), preq("low1", 0, max_new=40)]
    for r in lows:
        s.add(r)
    step(s, runner, 3)
    s.add(preq("p10", 10))                                       # 10 - 0 is not > 10: it waits
    step(s, runner, 2)
    assert s.num_preemptions == 0 and [r.rid for r in s.running] == ["low0", "low1"]
    hi = preq("p11", 11, max_new=4)
    s.add(hi)
    step(s, runner)
    assert s.num_preemptions == 1 and lows[1].status is Status.WAITING   # the newest of the least important
    assert lows[1].output_ids and {r.rid for r in s.running} == {"low0", "p11"}
    run(s, runner)
    for r in lows + [hi]:
        assert r.output_ids == alone(r), r.rid                   # progress kept: same tokens


def test_preempted_request_keeps_its_output_and_cached_prefix() -> None:
    s = psched(max_running_requests=1, priority_scheduling_preemption_threshold=0)
    runner = FakeRunner(s)
    low = preq("low", 0, prompt=list(range(100, 120)), max_new=20)
    s.add(low)
    step(s, runner, 5)
    n_out = len(low.output_ids)
    s.add(preq("high", 1, max_new=2))
    step(s, runner)
    assert low.status is Status.WAITING and len(low.output_ids) == n_out
    run(s, runner)
    assert low.cached_tokens == 0 and low.output_ids == alone(low)
    assert s.pool.num_used == s.cache.num_cached_pages          # nothing leaked


def test_kv_pages_preemption_all_or_none() -> None:
    # 12 usable pages of 4 tokens; three 13-token prompts hold 4 pages each (3 decodes before growing)
    s = psched(num_pages=13, priority_scheduling_preemption_threshold=0, disable_radix_cache=True)
    runner = FakeRunner(s)
    lows = [preq(f"low{i}", 0, prompt=[100 + 10 * i + j for j in range(13)], max_new=30) for i in range(2)]
    mid = preq("mid", 5, prompt=[160 + j for j in range(13)], max_new=30)
    for r in lows + [mid]:
        s.add(r)
    step(s, runner)
    assert s.pool.num_free == 0 and len(s.running) == 3
    big = preq("big", 3, prompt=[300 + j for j in range(40)], max_new=2)   # 10 pages: the lows free only 8
    s.add(big)
    step(s, runner)
    assert big.status is Status.WAITING and s.num_preemptions == 0         # all or none: none
    top = preq("top", 9, prompt=[400 + j for j in range(7)], max_new=2)    # 2 pages: one low suffices
    s.add(top)
    step(s, runner)
    assert top.status is Status.RUNNING and s.num_preemptions == 1
    assert [r.status for r in lows + [mid, big]] == [Status.RUNNING, Status.WAITING, Status.RUNNING,
                                                     Status.WAITING]       # the newest low only
    run(s, runner)
    for r in lows + [mid, big, top]:
        assert r.output_ids == alone(r), r.rid


def test_disable_priority_preemption_orders_only() -> None:
    s = psched(max_running_requests=1, priority_scheduling_preemption_threshold=0, disable_priority_preemption=True)
    runner = FakeRunner(s)
    s.add(preq("low", 0, max_new=10))
    step(s, runner)
    s.add(preq("mid", 5, max_new=2))
    s.add(preq("high", 9, max_new=2))
    step(s, runner, 3)
    assert s.num_preemptions == 0 and s.running[0].rid == "low"
    order = []
    while s.has_work():
        b = s.schedule()
        order += [q.req.rid for q in b.seqs if q.req.rid not in order and q.req.rid != "low"]
        s.update(b, runner.step(b))
    assert order == ["high", "mid"]


def test_low_values_first_flips_preemption() -> None:
    s = psched(max_running_requests=1, schedule_low_priority_values_first=True,
               priority_scheduling_preemption_threshold=10)
    runner = FakeRunner(s)
    s.add(preq("bg", 20, max_new=10))
    step(s, runner)
    s.add(preq("p15", 15))                                       # more important by 5: waits
    step(s, runner)
    assert s.num_preemptions == 0
    s.add(preq("p0", 0))                                         # more important by 20 > 10
    step(s, runner)
    assert s.num_preemptions == 1 and s.running[0].rid == "p0"


def test_kv_exhaustion_during_decode_preempts_the_least_important() -> None:
    s = psched(num_pages=9, priority_scheduling_preemption_threshold=100)   # 8 pages; no priority preemption
    runner = FakeRunner(s)
    a = preq("a", 5, prompt=list(range(100, 107)), max_new=20)
    b = preq("b", 0, prompt=list(range(120, 127)), max_new=20)
    c = preq("c", 9, prompt=list(range(140, 147)), max_new=20)
    s.add(b)
    step(s, runner)
    s.add(a)
    s.add(c)
    while s.num_preemptions == 0:
        step(s, runner)
    assert [r.rid for r in s.running] == ["c", "a"]              # b went, not a (the newest admitted)
    assert b.status is Status.WAITING and b.output_ids
    run(s, runner)
    assert [r.output_ids for r in (a, b, c)] == [alone(r) for r in (a, b, c)]


# ---- starvation guard ---------------------------------------------------------------------------
def _stream(s: Scheduler, runner: FakeRunner, low: Request, steps: int) -> list[str]:
    """A steady stream of priority-9 requests (two new ones a step); returns admission order."""
    order: list[str] = []
    for i in range(steps):
        for j in range(2):
            s.add(preq(f"h{i}.{j}", 9, max_new=1))
        b = s.schedule()
        order += [q.req.rid for q in b.seqs if q.req.admit_seq >= len(order)]
        s.update(b, runner.step(b))
        if low.finished:
            break
    return order


def test_no_starvation_under_a_stream_of_high_priority() -> None:
    s = psched(max_running_requests=1, max_priority_bypass=5)
    runner = FakeRunner(s)
    low = preq("low", 0, max_new=3)
    s.add(low)
    s.add(preq("h", 9, max_new=1))
    order = _stream(s, runner, low, 200)
    assert low.finished and low.output_ids == alone(low)
    assert order.index("low") == 5                               # passed over exactly 5 times
    assert low.priority_promoted and s.num_preemptions == 0     # and never preempted once in


def test_strict_priority_starves_without_the_guard() -> None:
    s = psched(max_running_requests=1, max_priority_bypass=None)
    runner = FakeRunner(s)
    low = preq("low", 0, max_new=3)
    s.add(low)
    order = _stream(s, runner, low, 60)
    assert "low" not in order and low.status is Status.WAITING  # SGLang's strict priority


def test_guard_protects_a_preempted_request() -> None:
    s = psched(max_running_requests=1, max_priority_bypass=3, priority_scheduling_preemption_threshold=0)
    runner = FakeRunner(s)
    low = preq("low", 0, max_new=6)
    s.add(low)
    step(s, runner)
    for i in range(30):                                          # each high arrival preempts or waits
        s.add(preq(f"h{i}", 9, max_new=1))
        step(s, runner)
        if low.finished:
            break
    assert low.finished and low.output_ids == alone(low)
    assert s.num_preemptions == 1                                # the first arrival preempted it, once


# ---- abort when disabled, stats, config -----------------------------------------------------------
def test_abort_on_priority_when_disabled() -> None:
    s = Scheduler(SchedulerConfig(page_size=4, num_pages=64, chunked_prefill_size=64,
                                  priority=PriorityConfig(abort_on_priority_when_disabled=True)))
    bad, ok = preq("bad", 3), preq("ok", None)
    s.add(bad)
    s.add(ok)
    assert bad.finished and bad.finish_reason.type == "abort" and bad.finish_reason.message == DISABLED_MESSAGE
    run(s)
    assert ok.finished and ok.finish_reason.type != "abort"


def test_stats_count_per_priority() -> None:
    s = psched(max_running_requests=2, priority_scheduling_preemption_threshold=100)
    for rid, p in [("a", 1), ("b", None), ("c", 5), ("d", 1), ("e", 1)]:
        s.add(preq(rid, p))
    s.schedule()
    assert s.stats()["priorities"] == {5: {"running": 1, "waiting": 0}, 1: {"running": 1, "waiting": 2},
                                       None: {"running": 0, "waiting": 1}}
    assert Scheduler(SchedulerConfig()).stats()["priorities"] == {}


@pytest.mark.parametrize("name,value", [
    ("priority_scheduling_preemption_threshold", -1), ("priority_scheduling_preemption_threshold", 1.5),
    ("enable_priority_scheduling", "yes"), ("default_priority_value", "high"), ("max_priority_bypass", 0),
    ("schedule_low_priority_values_first", 1)])
def test_config_errors_name_the_argument(name: str, value) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: value})


def test_max_queued_requests_aborts_arrivals_beyond_the_queue() -> None:
    """SGLang's max_queued_requests: once that many wait, an arrival is aborted at once (the queue
    and the running requests are untouched); a running request does not count."""
    from tests.test_scheduler import sched

    s = sched(max_queued_requests=2, max_running_requests=1)
    a, b, c = req("a", [1, 2, 3]), req("b", [4, 5, 6]), req("c", [7, 8, 9])
    for r in (a, b, c):
        s.add(r)
    assert c.finished and c.finish_reason.to_dict()["message"] == "The request queue is full."
    assert not a.finished and not b.finished and c in s.take_finished_outside()
    s.schedule()                                  # a runs: one waits, so an arrival fits again
    d = req("d", [1, 1, 1])
    s.add(d)
    assert not d.finished
    run(s)
    assert a.finished and b.finished and d.finished and a.finish_reason.type == "length"


def test_max_queued_requests_with_priorities_displaces_the_least_preferred() -> None:
    s = psched(max_queued_requests=2)
    low_old, low_new = preq("low_old", 1), preq("low_new", 1)
    s.add(low_old)
    s.add(low_new)
    same = preq("same", 1)
    s.add(same)                                   # not more important: the arrival is refused
    assert same.finished and not low_new.finished
    high = preq("high", 5)
    s.add(high)                                   # more important: the newest least preferred goes
    assert not high.finished and low_new.finished and not low_old.finished
    assert low_new.finish_reason.to_dict()["message"] == "The request is aborted by a higher priority request."
    assert admitted(s) == ["high", "low_old"]


def test_max_queued_requests_is_checked() -> None:
    with pytest.raises(ValueError, match="max_queued_requests"):
        EngineConfig(max_queued_requests=0)
