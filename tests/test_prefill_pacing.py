"""Decode-aware prefill pacing (runtime/prefill_pacing.py): the budget rule, whole schedules, the default."""
from __future__ import annotations

import random

import pytest

from nbgen.bench.sim import trace
from nbgen.core.config import EngineConfig
from nbgen.core.request import LogprobRequest, Request
from nbgen.core.sampling import SamplingParams
from nbgen.runtime.prefill_pacing import PACED_TOKENS, PrefillPacer, paced_budget, pacing_tokens


def req(rid: str, prompt: int, out: int | None, computed: int = 0, produced: int = 0) -> Request:
    r = Request(rid=rid, prompt_ids=[1] * prompt, params=SamplingParams(max_new_tokens=out, ignore_eos=True),
                stop_ids=frozenset(), logprobs=LogprobRequest())
    r.output_ids = [7] * produced
    r.num_computed = computed
    return r


def test_budget_rule() -> None:
    decoding = req("a", 10, 100, computed=10 + 19, produced=20)            # 80 outputs left
    assert paced_budget([], [req("q", 50, 10)], 32, 512) == 512            # nothing decodes: full chunks
    assert paced_budget([decoding], [req("q", 50, 60)], 32, 512) == 32     # due before the horizon: paced
    assert paced_budget([decoding], [req("q", 50, 60), req("r", 5, 80)], 32, 512) == 512   # would outlast it
    assert paced_budget([decoding], [req("q", 50, None)], 32, 512) == 512  # unbounded output
    assert paced_budget([decoding, req("b", 10, None, computed=10)], [req("q", 5, 1)], 32, 512) == 512
    longest_prefilling = req("p", 400, 90, computed=100)                   # mid-prefill, longest output
    assert paced_budget([decoding, longest_prefilling], [req("q", 5, 1)], 32, 512) == 512
    assert paced_budget([decoding], [], 32, 512) == 32
    assert paced_budget([decoding], [req("q", 50, 60)], 1024, 512) == 512  # never above the configured budget


def test_no_request_is_held_back_longer_than_max_wait() -> None:
    pacer = PrefillPacer(32, max_wait=3)
    decoding = req("a", 10, 100, computed=10 + 19, produced=20)
    short, later = req("s", 50, 5), req("l", 50, 6)
    assert [pacer.budget([decoding], iter([short]), 512) for _ in range(4)] == [32, 32, 32, 512]
    assert pacer.budget([decoding], iter([later]), 512) == 32        # admitted ones are forgotten
    assert pacer.budget([decoding], iter([later, short]), 512) == 32  # "s" is back: a new wait


def _workload(n: int, seed: int, fixed_out: int | None = None) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(10, 120))] for _ in range(n)]
    return prompts, [fixed_out or rng.randint(10, 120) for _ in range(n)]


def test_lof_with_pacing_lasts_no_longer_and_fills_decode_steps() -> None:
    prompts, outs = _workload(64, 0)
    plain = trace(prompts, outs, "lof", 512, page_size=4)
    paced = trace(prompts, outs, "lof", 512, page_size=4, pacing=48)
    assert len(paced) <= max(outs) + 2 <= len(plain) + 2       # the run ends with its longest output
    assert sum(s.rows for s in paced) == sum(s.rows for s in plain)   # the same work
    # prompts ride on decode steps: few steps compute prompt tokens beyond the paced budget
    assert sum(1 for s in paced if s.prefill_pairs and s.rows > 48) < len(paced) // 10
    assert sum(1 for s in paced if s.prefill_pairs and s.decode_kv) > 3 * sum(
        1 for s in plain if s.prefill_pairs and s.decode_kv)


def test_equal_outputs_are_not_paced() -> None:
    prompts, outs = _workload(48, 1, fixed_out=64)
    assert trace(prompts, outs, "fcfs", 512, page_size=4, pacing=48) == trace(prompts, outs, "fcfs", 512, page_size=4)


def test_default_is_chosen_only_when_the_user_sets_neither() -> None:
    assert EngineConfig().schedule_policy is None
    assert EngineConfig().resolved("cuda", 80 << 30).schedule_policy == "fcfs"
    assert EngineConfig(schedule_policy="lpm").resolved("cuda").schedule_policy == "lpm"
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(schedule_policy="lifo")
    assert pacing_tokens(16 << 30, True) == PACED_TOKENS
    assert pacing_tokens(1 << 30, True) == 0 and pacing_tokens(16 << 30, False) == 0


def test_cpu_engine_reports_fcfs_without_pacing(tiny_engine) -> None:
    info = tiny_engine.get_server_info()
    assert info["schedule_policy"] == "fcfs" and info["prefill_pacing_min_tokens"] == 0
