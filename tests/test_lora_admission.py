"""``max_loras_per_batch`` at admission (runtime/lora_batch.py), torch-free: the real Scheduler with the
fake paged runner of test_scheduler; each step's distinct adapters stay within the limit (the base
counted when an adapter's request is checked, as SGLang), outputs equal an unlimited run, and a blocked adapter is not starved."""
from __future__ import annotations

from nbgen.runtime.lora_batch import LoRABatchLimit
from nbgen.runtime.scheduler import Scheduler, SchedulerConfig
from tests.test_scheduler import FakeRunner, prompts, req


def _sched(limit: LoRABatchLimit | None, **kw) -> Scheduler:
    base = dict(page_size=4, num_pages=512, max_running_requests=64, chunked_prefill_size=64)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base), limit)


def _run(s: Scheduler, max_steps: int = 5000) -> tuple[FakeRunner, list[set]]:
    runner, per_step = FakeRunner(s), []
    for _ in range(max_steps):
        if not s.has_work():
            return runner, per_step
        batch = s.schedule()
        assert batch is not None, "has work but scheduled nothing (deadlock)"
        per_step.append({seq.req.lora_id for seq in batch.seqs})
        s.update(batch, runner.step(batch))
    raise AssertionError("did not finish")


def _reqs(adapters: list, n: int, max_new: int = 6) -> list:
    out = []
    for i, p in enumerate(prompts(n)):
        r = req(f"r{i}", p, max_new=max_new)
        r.lora_id = adapters[i % len(adapters)]
        out.append(r)
    return out


def test_fits_counts_base_and_pinned() -> None:
    lim = LoRABatchLimit(3, patience=10)
    assert lim.fits({None, 1, 2}) and not lim.fits({None, 1, 2, 3})
    lim.pinned = {7, 8}                      # 3 slots, 2 pinned: one left for the others
    assert lim.fits({7, 8, None}) and lim.fits({7, 1}) and not lim.fits({None, 1})


def test_steps_hold_at_most_max_loras() -> None:
    adapters = [1, 2, 3, None, 4, 5]
    limited = _sched(LoRABatchLimit(3, patience=64))
    for r in _reqs(adapters, 30):
        limited.add(r)
    _, steps = _run(limited)
    # the limit is used and never passed by adapters; base rows need no slot (SGLang admits them always)
    assert max(len(ids - {None}) for ids in steps) == 3
    # while base requests run, a new adapter is checked with the base counted, as SGLang does
    assert any(None in ids and len(ids) == 3 for ids in steps)
    free = _sched(None)
    want = _reqs(adapters, 30)
    for r in want:
        free.add(r)
    _, free_steps = _run(free)
    assert max(len(ids) for ids in free_steps) == 6      # without the limit all run together
    assert all(r.finished for r in want)


def test_outputs_equal_unlimited_run() -> None:
    adapters = [1, None, 2, 3]
    runs = []
    for limit in (LoRABatchLimit(2, patience=64), None):
        s = _sched(limit)
        reqs = _reqs(adapters, 16)
        for r in reqs:
            s.add(r)
        _run(s)
        runs.append([(r.output_ids, r.finish_reason.to_dict()["type"]) for r in reqs])
    assert runs[0] == runs[1]


def test_base_requests_never_held_back() -> None:
    s = _sched(LoRABatchLimit(1, patience=1000))
    a = _reqs([1], 1, max_new=20)[0]
    s.add(a)
    batch = s.schedule()
    s.update(batch, FakeRunner(s).step(batch))
    base = req("base", prompts(2)[1], max_new=4)
    other = req("other", prompts(3)[2], max_new=4)
    other.lora_id = 2
    s.add(other)
    s.add(base)
    ids = {seq.req.rid for seq in s.schedule().seqs}
    assert "base" in ids and "other" not in ids          # adapter 2 waits, the base request runs


def test_blocked_adapter_not_starved() -> None:
    """Adapter 1's requests keep arriving; adapter 2's request gets in once the patience is spent."""
    s = _sched(LoRABatchLimit(1, patience=4), max_running_requests=4)
    runner = FakeRunner(s)
    blocked = req("b", prompts(1)[0], max_new=3)
    blocked.lora_id = 2
    k = 0

    def feed(n: int) -> None:
        nonlocal k
        for _ in range(n):
            r = req(f"a{k}", prompts(k + 2)[k + 1], max_new=3)
            r.lora_id = 1
            s.add(r)
            k += 1

    feed(4)
    s.add(blocked)
    for step in range(200):
        feed(2)                                          # adapter 1 never runs dry
        batch = s.schedule()
        assert len({seq.req.lora_id for seq in batch.seqs}) == 1
        s.update(batch, runner.step(batch))
        if blocked.finished:
            break
    assert blocked.finished and len(blocked.output_ids) == 3, "adapter 2's request starved"
