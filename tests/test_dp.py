"""Data parallelism: dp_size=2 gives dp_size=1's outputs (greedy, fp32, CPU), one engine's stats with
per-replica detail; the router (torch-free) balances load, keeps groups and sessions together and
sends a known prefix back to its replica while that wins."""
from __future__ import annotations

import pandas as pd
import pytest

import nbgen
from nbgen.notebook.state import StatsHistory, dashboard_html
from nbgen.runtime.dp_loop import merge_stats
from nbgen.runtime.dp_router import PREFIX_TOKENS, PlanItem, Router

PROMPTS = ["Hello there", "def add(a, b):", "The quick brown fox jumps", "Once upon a time"] * 3
SP = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    one = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", random_seed=0)
    two = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", random_seed=0, dp_size=2)
    yield one, two
    one.shutdown()
    two.shutdown()


def test_dp2_matches_dp1(engines):
    one, two = engines
    a = one.generate(PROMPTS, SP, return_logprob=True, use_tqdm=False)
    b = two.generate(PROMPTS, SP, return_logprob=True, use_tqdm=False)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert [o["text"] for o in a] == [o["text"] for o in b]
    st = two.stats()
    assert st["dp_size"] == 2 and len(st["replicas"]) == 2
    assert all(r["total_finished"] > 0 for r in st["replicas"])       # both replicas served
    assert st["total_finished"] == sum(r["total_finished"] for r in st["replicas"])
    assert st["kv_pages_total"] == 2 * one.stats()["kv_pages_total"]
    assert two.get_server_info()["dp_size"] == 2
    h = StatsHistory()
    h.append(st)
    html = dashboard_html(h)
    assert "nbgen-replicas" in html and "0: 0 running" in html and "1: 0 running" in html


def test_dp_generate_df_stream_and_samples(engines):
    one, two = engines
    df = pd.DataFrame({"prompt": PROMPTS[:4]})
    a = nbgen.generate_df(df, "prompt", engine=one, sampling_params=SP, progress=False)
    b = nbgen.generate_df(df, "prompt", engine=two, sampling_params=SP, progress=False)
    assert a["text"].tolist() == b["text"].tolist()
    streamed = "".join(c["text"] for c in two.generate(PROMPTS[0], SP, stream=True))
    assert streamed == one.generate(PROMPTS[0], SP)["text"]
    outs = two.generate(PROMPTS[1], {**SP, "n": 3, "temperature": 0.8, "sampling_seed": 5})
    assert len(outs) == 3 and all(len(o["output_ids"]) == SP["max_new_tokens"] for o in outs)


def test_dp_refuses_single_copy_calls(engines):
    _one, two = engines
    with pytest.raises(ValueError, match="dp_size"):
        two.update_weights_from_disk("/nonexistent")
    with pytest.raises(ValueError, match="dp_size"):
        nbgen.Engine(device="cpu", dp_size=0)


def test_dp_refused_part_aborts_the_parts_already_sent(engines, monkeypatch):
    """A call one replica refuses is refused whole: its requests already submitted to another replica are
    aborted (no work for a caller that got the error) and the router's loads return to zero."""
    _, two = engines
    loop = two.loop
    before = loop.replicas[0].stats()["total_aborted"]

    def refuse(*args, **kw):
        raise ValueError("refused by replica 1")
    sent = []
    submit0 = loop.replicas[0].submit

    def counted(reqs, *args, **kw):
        sent.extend(r.rid for r in reqs)
        return submit0(reqs, *args, **kw)
    monkeypatch.setattr(loop.replicas[0], "submit", counted)
    monkeypatch.setattr(loop.replicas[1], "submit", refuse)
    with pytest.raises(ValueError, match="refused by replica 1"):
        two.generate(input_ids=[[5] * 60, [6] * 4, [7] * 4],
                     sampling_params={"max_new_tokens": 200, "ignore_eos": True})
    monkeypatch.undo()
    # replica 0 handles the abort before this later call (its loop takes them in order)
    loop.replicas[0].call(lambda: None)
    two.generate(input_ids=[[8] * 4], sampling_params={"max_new_tokens": 2})
    assert 1 <= len(sent) < 3 and loop.replicas[0].stats()["total_aborted"] == before + len(sent)
    assert loop.router.loads() == [0, 0]


def test_router_least_loaded_and_groups():
    r = Router(3)
    assert [r.route(f"a{i}", [1, 2]) for i in range(3)] == [0, 1, 2]
    r.done("a1")
    assert r.route("b", [3]) == 1                      # the replica that freed up
    groups: dict[str, int] = {}
    assert r.route("g0", [5], group="g", groups=groups) == 0
    assert r.route("g1", [5], group="g", groups=groups) == 0    # samples of one prompt together
    with pytest.raises(ValueError, match="rid 'b'"):
        r.route("b", [3])
    r.bind_session("s", 2)
    assert r.route("s1", [9], session="s") == 2       # where the session's KV lives
    assert r.loads() == [3, 1, 2]


def test_router_prefix_affinity_within_slack():
    r = Router(2)
    shared = list(range(PREFIX_TOKENS))
    assert Router.slack(0) == 2
    # the first prompt picks replica 0; the next two follow their prefix although 1 is idle
    assert [r.route(f"p{i}", shared + [i]) for i in range(3)] == [0, 0, 0]
    assert r.prefix_routed == 2
    # replica 0 is now 3 ahead, more than the slack: load wins, and the prefix moves to replica 1
    assert r.route("p3", shared + [3]) == 1
    assert r.route("p4", shared + [4]) == 1
    assert r.route("short", shared[:10]) == 1         # too short to key: by load alone (2 < 3)
    assert r.loads() == [3, 3]


def test_router_balances_tokens_not_request_counts():
    """A replica given one long request takes the short ones after it until the tokens even out (by
    count the two would alternate); a finish gives back exactly the tokens the request held."""
    r = Router(2)
    assert r.route("long", [1], cost=1000) == 0
    assert [r.route(f"s{i}", [2], cost=100) for i in range(10)] == [1] * 10
    assert r.loads() == [1000, 1000]
    assert r.route("tie", [3], cost=50) == 0            # equal loads: the lowest index
    r.done("long")
    assert r.loads() == [50, 1000] and r.where("long") is None and r.where("s3") == 1
    assert r.route("next", [4], cost=10) == 0


def test_dp_routes_by_the_kv_its_decode_reads(engines, monkeypatch):
    """The engine counts each request's KV reads (decode steps x context, plus the prompt) and plans a
    call's requests: the long one alone, the short ones on the other replica; every unit is given
    back when they finish. The fixed part of a step is the weights in KV tokens."""
    _, two = engines
    router = two.loop.router
    assert router.loads() == [0, 0]
    runner = two.loop.replicas[0].runner
    wb = sum(p.numel() * p.element_size() for p in (*runner.model.parameters(), *runner.model.buffers()))
    kv_token = runner.kv_spec.bytes_per_page() // runner.kv_spec.page_size
    assert router.step_cost == wb // kv_token > 0
    calls = []
    route = router.route

    def spy(*args, **kw):
        i = route(*args, **kw)
        calls.append((kw["cost"], i))
        return i
    monkeypatch.setattr(router, "route", spy)
    outs = two.generate(input_ids=[[5] * 60, [6] * 4, [7] * 4],
                        sampling_params=[{"max_new_tokens": 40, "ignore_eos": True}, {"max_new_tokens": 4},
                                         {"max_new_tokens": 4}])
    # 40 steps over a 60-token prompt: 40 * 60 + 40 * 41 / 2 + 60; 4 over 4: 16 + 10 + 4
    assert calls == [(3280, 0), (30, 1), (30, 1)] and len(outs[0]["output_ids"]) == 40
    assert router.loads() == [0, 0]


def test_router_prefix_slack_is_at_least_two_requests_of_this_size():
    """In tokens, an idle replica must not win over the prefix's replica holding one request like this
    one: the slack's floor is two requests of the routed request's cost, then a quarter of the load."""
    r = Router(2)
    shared = list(range(PREFIX_TOKENS))
    assert Router.slack(0, 300) == 600 and Router.slack(4000, 300) == 1000
    assert [r.route(f"p{i}", shared + [i], cost=300) for i in range(3)] == [0, 0, 0]   # 0, 300, 600 ahead
    assert r.route("p3", shared + [3], cost=300) == 1  # 900 ahead of an idle replica: more than 600
    assert r.loads() == [900, 300]


def test_merge_stats_sums_counts_and_nested_priorities():
    a = {"running": 1, "page_size": 16, "output_tok_s": 2.5, "priorities": {0: {"running": 1, "waiting": 0}},
         "uptime_s": 3.0}
    b = {"running": 2, "page_size": 16, "output_tok_s": 1.5, "priorities": {0: {"running": 0, "waiting": 4},
                                                                            5: {"running": 1, "waiting": 0}},
         "uptime_s": 5.0}
    m = merge_stats([a, b])
    assert m["running"] == 3 and m["page_size"] == 16 and m["output_tok_s"] == 4.0 and m["uptime_s"] == 5.0
    assert m["priorities"] == {0: {"running": 1, "waiting": 4}, 5: {"running": 1, "waiting": 0}}
    assert m["replicas"] == [a, b] and m["dp_size"] == 2


def test_dp_session_stays_on_its_replica(engines):
    one, two = engines
    long_prompt = " ".join(["tell me more about the quick brown fox"] * 8)
    results = []
    for eng in (one, two):
        sid = eng.open_session(4096)
        first = eng.generate(long_prompt, SP, session_params={"id": sid})
        second = eng.generate(" and then?", SP, session_params={"id": sid, "rid": first["meta_info"]["id"]})
        eng.close_session(sid)
        results.append((first["output_ids"], second["output_ids"], second["meta_info"]["cached_tokens"]))
    assert results[0] == results[1]
    assert results[1][2] >= 16         # the second turn read the first one's KV: the same replica


def test_dp_open_session_refuses_an_id_open_on_another_replica(engines, monkeypatch):
    """A second open_session of an open id answers None even when another replica is less loaded
    (as SGLang): that replica must not open a second copy that takes the id's requests."""
    _one, two = engines
    assert two.open_session(4096, session_id="dp-dup") == "dp-dup"
    first = two._loop.router.session_replica("dp-dup")
    monkeypatch.setattr(two._loop.router, "least_loaded", lambda: 1 - first)
    try:
        assert two.open_session(4096, session_id="dp-dup") is None
        assert [r.sessions.num_open for r in two._loop.replicas] == [int(i == first) for i in range(2)]
        out = two.generate("Hello there", SP, session_params={"id": "dp-dup"})
        assert two._loop.router.session_replica("dp-dup") == first and out["meta_info"]["prompt_tokens"] > 0
    finally:
        two.close_session("dp-dup")
    assert [r.sessions.num_open for r in two._loop.replicas] == [0, 0]


def test_router_plan_puts_the_longest_requests_together():
    """With a fixed cost per decode step, a call's longest requests share one replica (its steps are
    paid once) and the rest balance the time: 500 + 50 + 10 * 100 on one, 400 + 5 * 50 + 10 * 90 on
    the other (1550 each), where two replicas stepping 100 and 90 times would pay 1900 steps."""
    r = Router(2, step_cost=10)
    items = [PlanItem(500, 100), PlanItem(400, 90)] + [PlanItem(50, 10)] * 6
    assert r.plan(items) == [0, 1, 0, 1, 1, 1, 1, 1]
    # a few long requests and many short ones: the long ones alone on one replica (16000), the short
    # ones on the other (13000); any long one moved costs its 10000 steps again
    assert r.plan([PlanItem(2000, 1000)] * 3 + [PlanItem(200, 100)] * 60) == [0] * 3 + [1] * 60


def test_router_plan_without_step_cost_is_least_loaded_in_turn():
    r = Router(3)
    assert r.plan([PlanItem(10, 1), PlanItem(5, 9), PlanItem(1, 1), PlanItem(1, 1)]) == [0, 1, 2, 2]
    assert r.loads() == [0, 0, 0]                                 # a plan counts nothing


def test_router_plan_counts_running_work_and_its_steps():
    """A replica still stepping a long request takes a request within its steps while that is best
    (1400 against 2000 for both elsewhere), not when it is busy enough already; the router forgets
    a request's load and steps when it finishes."""
    r = Router(2, step_cost=10)
    assert r.route("short", [1], cost=100, steps=100, planned=0) == 0
    assert r.plan([PlanItem(300, 80), PlanItem(900, 10)]) == [0, 1]
    r.done("short")
    assert r.route("long", [1], cost=500, steps=100, planned=0) == 0
    assert r.plan([PlanItem(300, 80), PlanItem(100, 10)]) == [1, 1]     # 1500 there, 1200 here
    r.done("long")
    assert r.loads() == [0, 0]
    assert r.plan([PlanItem(300, 80), PlanItem(100, 10)]) == [0, 1]     # 1100 and 200
