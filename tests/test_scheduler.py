"""PagePool, PrefixCache and Scheduler without a model: a fake runner keeps a fake paged KV store.

The fake runner writes each computed token into (page, slot) through the request's page table and
reads the whole history back through it before "sampling": a wrong page table, a freed page still in
use or an overwrite of a shared page shows up as an assertion or as a different output.
"""
from __future__ import annotations

import pytest

from nbgen.core.batch import ScheduledBatch, StepOutput, TokenLogprobs
from nbgen.runtime.pages import PagePool
from nbgen.runtime.prefix_cache import PrefixCache
from nbgen.core.request import LogprobRequest, Request, Status
from nbgen.runtime.scheduler import Scheduler, SchedulerConfig
from nbgen.core.sampling import SamplingParams

V = 50  # fake vocabulary; ids >= V never appear in outputs


class FakeRunner:
    def __init__(self, sched: Scheduler, fixed: int | None = None) -> None:
        self.sched = sched
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}  # (page, slot) -> (position, token)
        self.fixed = fixed
        self.batches: list[ScheduledBatch] = []

    def step(self, batch: ScheduledBatch) -> StepOutput:
        P, rc = batch.page_size, self.sched.pool.refcount
        self.batches.append(batch)
        for s in batch.seqs:                                   # writes first, as a forward does
            assert len(s.pages) >= -(-s.kv_len // P) and 0 not in s.pages
            for j, tok in enumerate(s.token_ids):
                pos = s.start_pos + j
                key = (s.pages[pos // P], pos % P)
                old = self.slots.get(key)
                assert old is None or old == (pos, tok) or rc[key[0]] == 1, "overwrote a shared page"
                self.slots[key] = (pos, tok)
        nxt, out_lps, prm = [], [], []
        for s in batch.seqs:
            hist = [self.slots[(s.pages[p // P], p % P)] for p in range(s.kv_len)]
            assert hist == list(enumerate(s.req.all_ids[: s.kv_len])), "KV read back is wrong"
            tok = self.fixed if self.fixed is not None else (
                sum((i + 1) * t for i, (_, t) in enumerate(hist)) * 2654435761 + s.kv_len) % V
            nxt.append(tok if s.sample else -1)
            out_lps.append(TokenLogprobs(-0.5, tok, [(-0.5, tok)]) if s.sample and s.req.logprobs.return_logprob else None)
            if s.prompt_logprob_start >= 0:
                n = len(s.req.prompt_ids)
                lo, hi = max(s.prompt_logprob_start, 1, s.start_pos + 1), min(s.kv_len, n - 1)
                prm.append([TokenLogprobs(-float(t), s.req.prompt_ids[t]) for t in range(lo, hi + 1)])
            else:
                prm.append(None)
        return StepOutput(next_token_ids=nxt, output_logprobs=out_lps, prompt_logprobs=prm)


def req(rid: str, prompt: list[int], max_new: int = 8, stop=(), group=None, lsl: int = -1, **kw) -> Request:
    return Request(rid=rid, prompt_ids=list(prompt), params=SamplingParams(max_new_tokens=max_new, **kw),
                   stop_ids=frozenset(stop), group=group,
                   logprobs=LogprobRequest(return_logprob=lsl >= 0, logprob_start_len=lsl))


def sched(**kw) -> Scheduler:
    base = dict(page_size=4, num_pages=512, max_running_requests=64, chunked_prefill_size=64)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def run(s: Scheduler, runner: FakeRunner | None = None, max_steps: int = 10_000) -> FakeRunner:
    runner = runner or FakeRunner(s)
    for _ in range(max_steps):
        if not s.has_work():
            return runner
        batch = s.schedule()
        assert batch is not None, "has work but scheduled nothing (deadlock)"
        s.update(batch, runner.step(batch))
    raise AssertionError("did not finish")


def prompts(k: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 97 + 100 for j in range(lo + (i * 13) % (hi - lo))] for i in range(k)]


# ---- PagePool ---------------------------------------------------------------------------------------
def test_page_pool_alloc_ref_unref() -> None:
    pool = PagePool(6, 4)
    assert pool.num_total == 5 and pool.num_free == 5 and pool.num_used == 0
    a = pool.alloc(3)
    assert len(set(a)) == 3 and 0 not in a and pool.num_used == 3
    assert pool.alloc(3) is None and pool.num_free == 2          # failed alloc takes nothing
    pool.ref(a[:1])
    pool.unref(a)
    assert pool.num_free == 4 and pool.refcount[a[0]] == 1       # a[0] still referenced once
    b = pool.alloc(4)
    assert a[0] not in b and 0 not in b and pool.num_free == 0
    pool.unref([a[0]] + b)
    assert pool.num_free == 5 and pool.pages_for(9) == 3
    with pytest.raises(ValueError):
        PagePool(1, 4)


# ---- PrefixCache ------------------------------------------------------------------------------------
def test_prefix_cache_match_insert_duplicates() -> None:
    pool = PagePool(32, 4)
    cache = PrefixCache(pool)
    ids = list(range(10))                                        # 2 full pages + 2 tokens
    pages = pool.alloc(3)
    assert cache.insert(ids, pages) == pages[:2]                 # only full pages are cached
    assert cache.num_cached_pages == 2 and pool.refcount[pages[0]] == 2
    assert cache.match(ids) == (pages[:2], 8)
    assert cache.match(list(range(7))) == (pages[:1], 4)
    assert cache.match([0, 1, 2, 99, 4, 5]) == ([], 0)
    other = pool.alloc(3)                                        # same tokens, own copies + 1 new page
    path = cache.insert(list(range(12)), other)
    assert path == pages[:2] + [other[2]] and pool.refcount[other[0]] == 1  # duplicate left to caller
    pool.unref(pages + other)
    assert cache.num_evictable_pages == 3 and pool.num_used == 3


def test_prefix_cache_lru_evict_and_flush() -> None:
    pool = PagePool(32, 2)
    cache = PrefixCache(pool)
    a, b = pool.alloc(2), pool.alloc(2)
    cache.insert([1, 1, 2, 2], a)
    cache.insert([3, 3, 4, 4], b)
    pool.unref(a + b)                                            # only the cache holds them now
    cache.match([1, 1, 2, 2])                                    # a is now more recent than b
    assert cache.evict(1) == 1 and cache.match([3, 3, 4, 4], touch=False)[1] == 2  # b's leaf went first
    assert cache.evict(2) == 2                                   # then b's root page, then a's leaf
    assert cache.match([1, 1, 2, 2], touch=False) == ([a[0]], 2) and cache.num_cached_pages == 1
    pool.ref([a[0]])                                             # a running request uses a[0]
    assert cache.evict(5) == 0 and cache.flush() is False and cache.num_cached_pages == 1
    pool.unref([a[0]])
    assert cache.flush() is True and pool.num_used == 0


def test_pool_alloc_evicts_from_cache_and_disabled_cache() -> None:
    pool = PagePool(5, 2)
    cache = PrefixCache(pool)
    p = pool.alloc(4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], p)
    pool.unref(p)
    assert pool.num_free == 0 and cache.num_evictable_pages == 4
    assert len(pool.alloc(3)) == 3 and cache.num_cached_pages == 1   # deepest (leaf) pages evicted
    assert cache.match([1, 2, 3, 4])[1] == 2
    off_pool = PagePool(5, 2)
    off = PrefixCache(off_pool, disabled=True)
    q = off_pool.alloc(2)
    assert off.insert([1, 2, 3, 4], q) == q and off.match([1, 2, 3, 4]) == ([], 0)
    assert off.num_cached_pages == 0 and off_pool.refcount[q[0]] == 1


# ---- Scheduler ----------------------------------------------------------------------------------------
def test_chunked_prefill_splits_long_prompt() -> None:
    s = sched(chunked_prefill_size=16)
    r = req("a", list(range(100)), max_new=3)
    s.add(r)
    runner = run(s)
    shapes = [(b.seqs[0].start_pos, b.seqs[0].q_len, b.seqs[0].sample) for b in runner.batches]
    assert shapes == [(i * 16, 16, False) for i in range(6)] + [(96, 4, True), (100, 1, True), (101, 1, True)]
    assert len(r.output_ids) == 3 and r.finish_reason.to_dict() == {"type": "length"}
    decode = runner.batches[-1].seqs[0]
    assert decode.token_ids == [r.output_ids[-2]] and decode.pages is not None


def test_join_and_leave_every_step() -> None:
    s = sched(chunked_prefill_size=16)
    a = req("a", list(range(10)), max_new=4)
    s.add(a)
    runner = FakeRunner(s)
    for _ in range(2):
        s.update(b := s.schedule(), runner.step(b))
    b_req = req("b", list(range(50, 80)), max_new=3)
    s.add(b_req)
    batch = s.schedule()
    assert [(x.req.rid, x.q_len) for x in batch.seqs] == [("a", 1), ("b", 15)]  # decode + chunk in one step
    changed = s.update(batch, runner.step(batch))
    assert [r.rid for r in changed] == ["a"]
    run(s, runner)
    assert a.finished and b_req.finished and len(b_req.output_ids) == 3
    assert s.stats()["running"] == 0 and s.pool.num_used == s.cache.num_cached_pages


def test_max_running_requests_respected() -> None:
    s = sched(max_running_requests=2)
    rs = [req(str(i), p, max_new=5) for i, p in enumerate(prompts(5))]
    for r in rs:
        s.add(r)
    runner = run(s)
    assert max(len(b.seqs) for b in runner.batches) == 2
    assert all(r.finish_reason.to_dict() == {"type": "length"} and len(r.output_ids) == 5 for r in rs)


@pytest.mark.parametrize("policy, first", [("lpm", "shares"), ("fcfs", "other")])
def test_lpm_orders_by_prefix_match(policy: str, first: str) -> None:
    s = sched(max_running_requests=1, schedule_policy=policy)
    base = list(range(200, 240))
    s.add(req("warm", base, max_new=1))
    run(s)                                                       # (no further steps run here)
    s.add(req("other", list(range(300, 330)), max_new=1))
    s.add(req("shares", base[:32] + [1, 2, 3], max_new=1))
    assert s.schedule().seqs[0].req.rid == first


def test_lof_admits_longest_output_first() -> None:
    s = sched(max_running_requests=1, schedule_policy="lof", context_length=20)
    for rid, n in (("a", 3), ("b", 7), ("c", 5), ("d", 7)):
        s.add(req(rid, [100 + len(rid)] * 6, max_new=n))
    assert s.abort("d") is not None                               # removed from the sorted order
    order: list[str] = []
    runner = FakeRunner(s)
    for _ in range(200):
        if not s.has_work():
            break
        batch = s.schedule()
        order += [x.req.rid for x in batch.seqs if x.req.rid not in order]
        if order == ["b"]:
            s.add(req("e", [9] * 6, max_new=6))                  # later arrivals are sorted in
            s.add(req("f", [9] * 6, max_new=None))               # unbounded counts as longest
            order.append("(added)")
        s.update(batch, runner.step(batch))
    assert order == ["b", "(added)", "f", "e", "c", "a"]


def _outputs(kw: dict, n: int = 8) -> tuple[dict, Scheduler]:
    s = sched(**kw)
    rs = [req(str(i), p, max_new=6 + (i * 5) % 14) for i, p in enumerate(prompts(n))]
    for r in rs:
        s.add(r)
    run(s)
    assert all(r.finish_reason["type"] == "length" for r in rs)
    return {r.rid: (r.output_ids, r.cached_tokens) for r in rs}, s


@pytest.mark.parametrize("extra", [{}, {"disable_radix_cache": True}, {"chunked_prefill_size": 8}])
def test_preemption_under_tiny_page_budget_gives_same_outputs(extra: dict) -> None:
    ref, _ = _outputs({**extra})
    got, s = _outputs({"num_pages": 16, **extra})               # 15 pages = 60 tokens for 8 requests
    assert s.num_preemptions > 0 and got == ref                  # cached_tokens: first admission only
    assert s.pool.num_used == s.cache.num_cached_pages           # nothing leaked
    assert s.flush_cache() and s.pool.num_used == 0


def test_preempted_request_resumes_before_later_arrivals() -> None:
    s = sched(num_pages=9, max_running_requests=2)               # 8 pages = 32 tokens
    a, b, c = req("A", list(range(16)), max_new=12), req("B", list(range(50, 62)), max_new=12), req("C", [9] * 4)
    for r in (a, b, c):
        s.add(r)
    runner, admitted = FakeRunner(s), []
    while s.has_work():
        before = {r.rid for r in s.running}
        batch = s.schedule()
        admitted += [x.req.rid for x in batch.seqs if x.req.rid not in before]
        s.update(batch, runner.step(batch))
    assert s.num_preemptions >= 1 and admitted[:4] == ["A", "B", "B", "C"]
    assert all(r.finish_reason.to_dict() == {"type": "length"} for r in (a, b, c))


def test_lone_request_too_big_is_aborted_not_spinning() -> None:
    s = sched(num_pages=5)                                       # 4 pages = 16 tokens
    big = req("big", list(range(10)), max_new=20)
    huge = req("huge", list(range(17)))
    small = req("small", list(range(5)), max_new=3)
    for r in (big, huge, small):
        s.add(r)
    assert huge.finished and "does not fit" in huge.finish_reason["message"]
    run(s, max_steps=100)
    assert big.finish_reason["type"] == "abort" and "KV cache" in big.finish_reason["message"]
    assert len(big.output_ids) == 7                               # 16 tokens of KV: 10 + 6 computed
    assert small.finish_reason.to_dict() == {"type": "length"} and s.pool.num_used == s.cache.num_cached_pages


def test_abort_waiting_and_running_frees_pages() -> None:
    s = sched(max_running_requests=1, disable_radix_cache=True)
    a, b = req("a", list(range(30))), req("b", list(range(30)))
    s.add(a)
    s.add(b)
    runner = FakeRunner(s)
    s.update(batch := s.schedule(), runner.step(batch))
    assert s.pool.num_used == 8 and a.status is Status.RUNNING and b.status is Status.WAITING
    assert s.abort("b", "bye") is b and b.finish_reason.to_dict() == {"type": "abort", "message": "bye",
                                                                   "status_code": None, "err_type": None}
    assert s.abort("a") is a and a.finished and s.pool.num_used == 0 and not s.has_work()
    assert s.abort("a") is None and s.abort("nope") is None


def test_stop_min_new_tokens_length_and_context() -> None:
    s = sched(context_length=12)
    stop_now = req("stop", [1, 2, 3], stop=[7])
    stop_late = req("late", [1, 2, 3], stop=[7], min_new_tokens=3)
    length = req("len", [4, 5, 6], max_new=5)
    ctx = req("ctx", list(range(10)), max_new=50)
    for r in (stop_now, stop_late, length, ctx):
        s.add(r)
    run(s, FakeRunner(s, fixed=7))
    assert stop_now.output_ids == [7] and stop_now.finish_reason.to_dict() == {"type": "stop", "matched": 7}
    assert stop_late.output_ids == [7, 7, 7] and stop_late.finish_reason["type"] == "stop"
    assert len(length.output_ids) == 5 and length.finish_reason.to_dict() == {"type": "length"}
    assert len(ctx.output_ids) == 2 and ctx.finish_reason.to_dict() == {"type": "length"}


def test_finish_from_outside_and_runner_error() -> None:
    s = sched()
    a, b = req("a", list(range(10))), req("b", list(range(20, 30)))
    s.add(a)
    s.add(b)
    runner = FakeRunner(s)
    batch = s.schedule()
    out = runner.step(batch)
    out.errors[1] = "boom"
    changed = s.update(batch, out)
    assert b in changed and b.finish_reason.to_dict() == {"type": "abort", "message": "boom",
                                                           "status_code": None, "err_type": None}
    s.finish(a, {"type": "stop", "matched": "xyz"})              # a stop string matched
    assert a.finished and not s.has_work() and s.cache.num_cached_pages == 2
    assert s.pool.num_used == 2                                  # only a's cached full pages remain


def test_cached_tokens_on_second_identical_request() -> None:
    s = sched()
    p = list(range(40))
    first, second = req("1", p), req("2", p)
    s.add(first)
    runner = run(s)
    s.add(second)
    run(s, runner)
    assert first.cached_tokens == 0 and second.cached_tokens == 36  # never the whole prompt
    assert first.output_ids == second.output_ids


def test_identical_prompts_in_one_step_share_pages_after_prefill() -> None:
    s = sched(chunked_prefill_size=128)
    a, b = req("a", list(range(40))), req("b", list(range(40)))
    s.add(a)
    s.add(b)
    runner = FakeRunner(s)
    s.update(batch := s.schedule(), runner.step(batch))
    assert a.pages[:10] == b.pages[:10]                          # b's duplicate pages were swapped
    run(s, runner)
    assert a.output_ids == b.output_ids and s.pool.num_used == s.cache.num_cached_pages


def test_group_members_wait_for_shared_prompt() -> None:
    s = sched()
    p = list(range(40))
    rs = [req(f"g{i}", p, group="g") for i in range(3)]
    for r in rs:
        s.add(r)
    first = s.schedule()
    assert [x.req.rid for x in first.seqs] == ["g0"]
    runner = FakeRunner(s)
    s.update(first, runner.step(first))
    second = s.schedule()
    assert sorted((x.req.rid, x.start_pos, x.q_len) for x in second.seqs) == [
        ("g0", 40, 1), ("g1", 36, 4), ("g2", 36, 4)]
    s.update(second, runner.step(second))
    run(s, runner)
    assert [r.cached_tokens for r in rs] == [0, 36, 36]


@pytest.mark.parametrize("lsl, cached", [(0, 0), (21, 20), (39, 36)])
def test_prompt_logprobs_cap_match_and_are_complete(lsl: int, cached: int) -> None:
    s = sched(chunked_prefill_size=8)
    p = list(range(100, 140))
    s.add(req("warm", p))
    runner = run(s)
    r = req("lp", p, lsl=lsl)
    s.add(r)
    run(s, runner)
    assert r.cached_tokens == cached
    assert [t for _, t in r.input_token_logprobs] == p[max(lsl, 1):]
    assert [-v for v, _ in r.input_token_logprobs] == list(range(max(lsl, 1), 40))
    assert len(r.output_token_logprobs) == len(r.output_ids) == 8 and r.prompt_logprobs_done


def test_prompt_logprobs_survive_preemption_without_duplicates() -> None:
    s = sched(num_pages=16, chunked_prefill_size=8)
    rs = [req(str(i), p, max_new=10, lsl=2) for i, p in enumerate(prompts(6, 20, 40))]
    for r in rs:
        s.add(r)
    run(s)
    assert s.num_preemptions > 0
    for r in rs:
        assert [-v for v, _ in r.input_token_logprobs] == list(range(2, len(r.prompt_ids)))


def test_max_new_tokens_zero_only_prefills() -> None:
    s = sched(chunked_prefill_size=8)
    r = req("z", list(range(20)), max_new=0, lsl=0)
    s.add(r)
    runner = run(s)
    assert r.output_ids == [] and r.finish_reason.to_dict() == {"type": "length"}
    assert not any(x.sample for b in runner.batches for x in b.seqs)
    assert len(r.input_token_logprobs) == 19


def test_flush_cache_refused_while_running_and_stats() -> None:
    s = sched()
    s.add(req("a", list(range(20))))
    runner = FakeRunner(s)
    s.update(batch := s.schedule(), runner.step(batch))
    assert s.flush_cache() is False
    st = s.stats()
    assert st["running"] == 1 and st["waiting"] == 0 and st["pages_total"] == 511
    assert st["pages_used"] == 5 and st["prefix_cache_pages"] == 5  # 20 tokens = 5 full pages
    run(s, runner)
    assert s.flush_cache() is True and s.stats()["prefix_cache_pages"] == 0
    with pytest.raises(ValueError):
        SchedulerConfig(schedule_policy="lifo")


def _random_workload(seed: int) -> int:
    """Run one random workload tight and unconstrained; same results required. Returns preemptions."""
    import random

    rng = random.Random(seed)
    P = rng.choice([1, 2, 4, 8])
    shared = [rng.randrange(V) for _ in range(24)]
    specs = []
    for i in range(rng.randint(3, 10)):
        head = shared[: rng.randint(0, 24)] if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        specs.append(dict(rid=str(i), prompt=prompt, max_new=rng.randint(0, 12), lsl=rng.choice([-1, -1, 0, 5]),
                          group=f"g{i // 3}" if rng.random() < 0.3 else None))
    need = max(len(sp["prompt"]) + max(sp["max_new"], 1) for sp in specs)
    kw = dict(page_size=P, chunked_prefill_size=rng.choice([4, 16, 64, None]),
              max_running_requests=rng.randint(1, 6), schedule_policy=rng.choice(["fcfs", "lpm", "lof"]),
              disable_radix_cache=rng.random() < 0.3)

    def go(num_pages: int) -> tuple[dict, Scheduler]:
        s = sched(num_pages=num_pages, **kw)
        rs = [req(sp["rid"], sp["prompt"], sp["max_new"], group=sp["group"], lsl=sp["lsl"]) for sp in specs]
        for r in rs:
            s.add(r)
        run(s, max_steps=5000)
        assert s.pool.num_used == s.cache.num_cached_pages and s.flush_cache() and s.pool.num_used == 0
        return {r.rid: (r.finish_reason, r.output_ids, r.input_token_logprobs) for r in rs}, s

    ref, _ = go(4096)
    got, s = go(-(-need // P) + 2)                               # the biggest request just fits
    assert got == ref, f"seed {seed}"
    assert all(v[0]["type"] == "length" for v in got.values())
    return s.num_preemptions


def test_random_workloads_match_unconstrained_run() -> None:
    preemptions = [_random_workload(seed) for seed in range(40)]
    assert sum(n > 0 for n in preemptions) >= 10, preemptions    # the tight runs did preempt


def test_allocations_evict_the_lru_tail_in_batches() -> None:
    """An allocation short of one page frees 1/16 of the cached pages (oldest first), so a stream of
    admissions does not rescan the whole tree per request; explicit evict(n) frees exactly n."""
    from nbgen.runtime.prefix_cache import EVICT_BATCH

    pool = PagePool(65, 1)                  # 64 usable one-token pages
    cache = PrefixCache(pool)
    pages = pool.alloc(64)
    for i, p in enumerate(pages):           # 64 one-page prefixes, inserted oldest first
        cache.insert([1000 + i], [p])
    pool.unref(pages)
    assert pool.num_free == 0 and cache.num_evictable_pages == 64
    assert len(pool.alloc(1)) == 1
    assert pool.num_free == 64 // EVICT_BATCH - 1 and cache.num_cached_pages == 64 - 64 // EVICT_BATCH
    assert cache.match([1000])[1] == 0 and cache.match([1000 + 64 // EVICT_BATCH])[1] == 1  # LRU went first
    assert cache.evict(2) == 2
