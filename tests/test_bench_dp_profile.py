"""bench.dp_profile: the shard split is the router's, and a traced dp-2 run on the CPU accounts for
every request, step and output token on the replica that served it."""
from __future__ import annotations

import threading
import time

import pytest

from nbgen.bench.dp_profile import main, profile_run, shard
from nbgen.bench.dp_trace import ThreadCpu
from nbgen.bench.workloads import make_workload
from nbgen.runtime.dp_router import PlanItem, Router, request_cost


def test_shard_is_the_routers_split_and_a_partition():
    prompts, outs = make_workload("nano")
    expect = Router(2, 10000).plan([PlanItem(request_cost(len(p), o), o) for p, o in zip(prompts, outs)])
    parts = [shard(prompts, outs, k, 2, 10000) for k in range(2)]
    for k, (ps, os_) in enumerate(parts):
        assert ps == [p for p, r in zip(prompts, expect) if r == k]
        assert os_ == [o for o, r in zip(outs, expect) if r == k]
    assert len(parts[0][0]) + len(parts[1][0]) == len(prompts)
    assert max(parts[0][1]) == max(outs) > max(parts[1][1])       # the longest requests together


def test_dp2_trace_accounts_for_every_request(tiny_llama_dir):
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    outs = [3, 9, 4, 12, 5, 7]
    run = profile_run(tiny_llama_dir, "auto", "cpu", 2, prompts, outs)
    assert run["dp_size"] == 2 and run["out_tokens"] == sum(outs)
    reps = run["replicas"]
    assert [r["replica"] for r in reps] == [0, 1]
    assert sum(r["requests"] for r in reps) == len(prompts)
    assert sum(r["max_new_tokens"] for r in reps) == sum(outs)
    for r in reps:
        assert r["requests"] > 0
        # each replica decodes at least its longest request's tokens, one step each after its prefill
        assert r["steps"] >= 1 and r["prefill_steps"] >= 1
        assert 0 <= r["first_s"] <= r["last_s"] <= run["seconds"]
        assert sum(r["steps_by_window"]) == r["steps"]
    assert max(r["steps"] for r in reps) >= max(outs) - 1
    assert {"replica 0", "replica 1"} & set(run["thread_cpu_s"])


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="sizes"):
        main(["--device", "cpu", "--sizes", "0"])
    with pytest.raises(ValueError, match="shard"):
        main(["--device", "cpu", "--sizes", "1", "--shard", "2/2"])


def test_thread_cpu_charges_the_thread_that_ran():
    """A thread that burns 0.2 s of its own CPU time shows most of it under its id (the kernel counts
    in clock ticks); read while the thread is still alive (a finished thread has no /proc entry)."""
    cpu = ThreadCpu()
    cpu.start()
    burned, release = threading.Event(), threading.Event()
    done: dict[str, int] = {}

    def burn() -> None:
        done["tid"] = threading.get_native_id()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:
            pass
        burned.set()
        release.wait()
    t = threading.Thread(target=burn, name="burner")
    t.start()
    burned.wait()
    used = cpu.stop()
    assert ThreadCpu.names()[done["tid"]] == "burner"
    release.set()
    t.join()
    assert used.get(done["tid"], 0.0) >= 0.15
