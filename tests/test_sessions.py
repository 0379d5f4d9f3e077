"""Engine sessions (SGLang's open_session / session_params / close_session) and nbgen.chat_session.

The loop-side table is checked torch-free on the scheduler with the fake runner (prompt building,
pins, capacity, the pin cap); the engine tests run the tiny Llama: each session turn's greedy output
equals generate() on the concatenated ids, token for token, and the turn reuses the previous turn's
KV (``cached_tokens``), also after cache pressure on a small KV cache.
"""
from __future__ import annotations

import asyncio
import os
import random
import sys
import warnings
from typing import Any, Iterator

import pytest

from nbgen.core.request import Request, Status
from nbgen.core.session import SessionParams
from nbgen.runtime.sessions import SessionTable, continued_ids
from tests.test_scheduler import FakeRunner, req, run, sched

sys.path.insert(0, os.path.dirname(__file__))
from nb_fakes import FakeDisplay  # noqa: E402

from nbgen.notebook import _compat  # noqa: E402
from nbgen.notebook.chat_session import chat_session  # noqa: E402

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
P = 16   # the engine's page size


def _ids(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 380) for _ in range(n)]


def _full_pages(n_tokens: int) -> int:
    """Tokens of the full pages a finished sequence of ``n_tokens`` left in the cache (the last
    token has no KV)."""
    return (n_tokens - 1) // P * P


# ---- the loop-side table, torch-free ------------------------------------------------------------
class Bench:
    """A scheduler with a session table, stepped by one fake runner (its KV store spans turns)."""

    def __init__(self, num_pages: int = 65, overflow: bool = False) -> None:
        self.s = sched(page_size=4, num_pages=num_pages)
        self.runner = FakeRunner(self.s)
        self.timers: list = []
        self.t = SessionTable(self.s, lambda rid, msg: self.s.abort(rid, msg), bos_id=1,
                              allow_context_overflow=overflow, later=lambda delay, fn: self.timers.append(fn))
        self.s.on_finish = self.t.on_finish
        self.s.on_flush = self.t.unpin_all

    def submit(self, name: str, ids: list[int], **sp: Any) -> Request:
        r = _session_req(name, ids, **{"id": "s", **sp})
        self.t.attach(r)
        self.s.add(r)
        return r

    def turn(self, name: str, ids: list[int], **sp: Any) -> Request:
        r = self.submit(name, ids, **sp)
        run(self.s, self.runner)
        return r

    def other(self, name: str, ids: list[int], max_new: int) -> None:
        self.s.add(req(name, ids, max_new=max_new))
        run(self.s, self.runner)


def _session_req(name: str, ids: list[int], **sp: Any) -> Request:
    r = req(name, ids, max_new=6)
    r.session = SessionParams(**sp)
    return r


def test_continued_ids_follow_sglang() -> None:
    prev = req("a", [5, 6, 7])
    prev.output_ids = [8, 9]
    assert continued_ids(prev, [1, 10], SessionParams("s"), bos_id=1) == [5, 6, 7, 8, 9, 10]  # BOS dropped
    assert continued_ids(prev, [10], SessionParams("s", offset=-1), bos_id=1) == [5, 6, 7, 8, 10]
    assert continued_ids(prev, [10], SessionParams("s", offset=2), bos_id=None) == [5, 6, 10]
    assert continued_ids(prev, [10], SessionParams("s", drop_previous_output=True), bos_id=None) == [5, 6, 7, 10]


def test_table_builds_prompts_and_pins_the_latest_sequence() -> None:
    b = Bench()
    s, t = b.s, b.t
    assert t.open(1000, "s", streaming=False, timeout=None) == "s"
    assert t.open(1000, "s", streaming=False, timeout=None) is None          # already open
    r1 = b.turn("r1", list(range(10, 30)))
    assert t.pinned_pages == (20 + 6 - 1) // 4 and s.pool.num_used == s.cache.num_cached_pages
    r2 = b.turn("r2", [40, 41], rid="r1")
    assert r2.prompt_ids == r1.prompt_ids + r1.output_ids + [40, 41] and r2.cached_tokens == 24
    assert t.pinned_pages == (len(r2.all_ids) - 1) // 4                     # the pin moved to r2
    s.cache.evict(10**6)                                                     # everything evictable goes
    assert s.cache.num_cached_pages == s.pool.num_used == t.pinned_pages     # pinned pages stay
    t.close("s")
    assert t.pinned_pages == 0 and s.cache.evict(10**6) == (len(r2.all_ids) - 1) // 4 and s.pool.num_used == 0
    with pytest.raises(ValueError, match="session 's' is not open"):
        t.attach(_session_req("x", [3], id="s"))
    t.open(1000, "s", False, None)                                          # a flush drops the pins,
    b.turn("r3", [50, 51, 52, 53, 54])
    assert t.pinned_pages == 2 and s.flush_cache() and s.pool.num_used == 0
    assert t.pinned_pages == 0 and b.turn("r4", [9], rid="r3").cached_tokens == 0   # the session stays


def test_table_capacity_and_the_pin_cap() -> None:
    b = Bench(num_pages=17)                                                  # 16 usable pages
    s, t = b.s, b.t
    t.open(8, "small", False, None)
    b.turn("a", list(range(10, 30)), id="small")                             # 25 computed tokens
    assert t.pinned_pages == 2                                               # capacity: 8 tokens
    t.open(1000, "big", False, None)
    b.turn("b", list(range(100, 130)), id="big")                             # 35 computed -> 8 pages
    assert t.pinned_pages == 16 // 2                                         # all sessions: half the pool
    for k in range(6):                                                       # pressure: other requests
        b.other(f"p{k}", list(range(200 + 20 * k, 215 + 20 * k)), max_new=10)
    r = b.turn("c", [7, 7], id="big", rid="b")
    assert r.cached_tokens == 6 * 4                                          # the pinned part survived
    t.close_all()
    assert t.pinned_pages == 0 and s.flush_cache()


def test_table_replace_branches_and_streaming() -> None:
    b = Bench()
    s, t = b.s, b.t
    t.open(1000, "s", False, None)
    r1 = b.turn("r1", [10, 11, 12])
    r2 = b.turn("r2", [20], rid="r1")
    b.turn("r3", [30], rid="r2")
    r4 = b.turn("r4", [40], rid="r1")                                        # a second branch of r1
    assert r4.prompt_ids == r1.all_ids + [40]
    b.turn("r5", [50], rid="r3")                                             # the first branch goes on
    r6 = b.turn("r6", [60], rid="r1", replace=True)
    assert r6.prompt_ids == r1.all_ids + [60]
    for gone in ("r2", "r3", "r4", "r5"):
        with pytest.raises(ValueError, match=f"request '{gone}' is not in session 's'"):
            t.attach(_session_req("x", [1], id="s", rid=gone))
    r7 = b.turn("r7", [70, 71], replace=True)                                # a new root, the rest forgotten
    assert r7.prompt_ids == [70, 71] and r2.finished
    with pytest.raises(ValueError, match="'r1' is not in session"):
        t.attach(_session_req("x", [1], id="s", rid="r1"))
    t.open(1000, "st", True, None)
    a = b.turn("a", [10, 11], id="st")
    bb = b.turn("b", [12], id="st")                                          # no rid: continues the latest
    assert bb.prompt_ids == a.all_ids + [12]
    b.submit("c", [13], id="st")                                             # in flight
    with pytest.raises(ValueError, match="already has a request in flight"):
        t.attach(_session_req("d", [14], id="st"))
    s.abort("c")                                                             # an aborted turn is not kept
    d = b.turn("d", [14], id="st")
    assert d.prompt_ids == bb.all_ids + [14]
    for bad in ({"offset": 1}, {"replace": True}, {"drop_previous_output": True}):
        with pytest.raises(ValueError, match="streaming session 'st' does not support"):
            t.attach(_session_req("e", [1], id="st", **bad))


def test_table_refuses_unfinished_rid_and_times_out() -> None:
    b = Bench()
    s, t = b.s, b.t
    t.open(1000, "s", False, 1e-9)
    r1 = b.submit("r1", [5, 6, 7])
    with pytest.raises(ValueError, match="has not finished"):
        t.attach(_session_req("r2", [8], id="s", rid="r1"))
    b.timers.pop()()                                                         # due while r1 runs: later
    assert t.num_open == 1 and len(b.timers) == 1
    run(s, b.runner)
    assert r1.status is Status.FINISHED and t.pinned_pages > 0
    b.timers.pop()()                                                         # idle: closed, pin dropped
    assert t.num_open == 0 and t.pinned_pages == 0


# ---- the engine ---------------------------------------------------------------------------------------
@pytest.fixture
def sid(tiny_engine) -> Iterator[str]:
    sid = tiny_engine.open_session(10_000)
    yield sid
    tiny_engine.close_session(sid)


def _ref(eng: Any, ids: list[int], sp: dict = GREEDY) -> dict:
    """generate() on the ids from an empty prefix cache."""
    assert eng.flush_cache()
    return eng.generate(input_ids=ids, sampling_params=sp)


def test_turns_match_generate_on_the_concatenated_ids(tiny_engine, sid) -> None:
    eng = tiny_engine
    chunks = [_ids(1, 40), _ids(2, 7), _ids(3, 11)]
    outs, seq, rid = [], [], None
    for k, chunk in enumerate(chunks):
        out = eng.generate(input_ids=chunk, sampling_params=GREEDY, session_params={"id": sid, "rid": rid})
        m = out["meta_info"]
        assert m["prompt_tokens"] == len(seq) + len(chunk)
        assert m["cached_tokens"] == (_full_pages(len(seq)) if k else 0)     # the previous turn's KV
        seq = seq + chunk + out["output_ids"]
        rid = m["id"]
        outs.append(out["output_ids"])
    eng.close_session(sid)
    seq = []
    for chunk, got in zip(chunks, outs):
        ref = _ref(eng, seq + chunk)
        assert ref["output_ids"] == got
        seq = seq + chunk + got


def test_offset_and_drop_previous_output(tiny_engine, sid) -> None:
    eng = tiny_engine
    a, b = _ids(4, 37), _ids(5, 6)
    first = eng.generate(input_ids=a, sampling_params=GREEDY, session_params={"id": sid})
    rid, ctx = first["meta_info"]["id"], a + first["output_ids"]
    cases = [({"offset": -1}, ctx[:-1] + b), ({"offset": 20}, ctx[:20] + b),
             ({"drop_previous_output": True}, a + b), ({"offset": 0}, ctx + b)]
    got = []
    for extra, want_prompt in cases:
        out = eng.generate(input_ids=b, sampling_params=GREEDY, session_params={"id": sid, "rid": rid, **extra})
        assert out["meta_info"]["prompt_tokens"] == len(want_prompt), extra
        got.append(out["output_ids"])
    eng.close_session(sid)
    for (extra, want_prompt), ids in zip(cases, got):
        assert _ref(eng, want_prompt)["output_ids"] == ids, extra


def test_replace_and_branches(tiny_engine, sid) -> None:
    eng = tiny_engine

    def turn(ids, **sp):
        return eng.generate(input_ids=ids, sampling_params=GREEDY, session_params={"id": sid, **sp})

    r1 = turn(_ids(6, 20))
    r2 = turn(_ids(7, 5), rid=r1["meta_info"]["id"])
    r3 = turn(_ids(8, 5), rid=r1["meta_info"]["id"])                          # a branch beside r2
    r4 = turn(_ids(9, 5), rid=r2["meta_info"]["id"])                          # r2's branch goes on
    assert r4["meta_info"]["prompt_tokens"] == 20 + 8 + 5 + 8 + 5
    r5 = turn(_ids(10, 5), rid=r1["meta_info"]["id"], replace=True)           # r1's continuations go
    assert r5["meta_info"]["prompt_tokens"] == 20 + 8 + 5
    for gone in (r2, r3, r4):
        with pytest.raises(ValueError, match="is not in session"):
            turn(_ids(11, 3), rid=gone["meta_info"]["id"])
    root = turn(_ids(12, 9))                                                  # no rid: a new root
    assert root["meta_info"]["prompt_tokens"] == 9
    turn(_ids(13, 4), replace=True)                                           # no rid + replace: all go
    with pytest.raises(ValueError, match="is not in session"):
        turn(_ids(11, 3), rid=r1["meta_info"]["id"])


def test_streaming_session_and_stream_output(tiny_engine) -> None:
    eng = tiny_engine
    sid = eng.open_session(10_000, streaming=True)
    try:
        a, b = _ids(14, 30), _ids(15, 6)
        first = eng.generate(input_ids=a, sampling_params=GREEDY, session_params={"id": sid})
        chunks = list(eng.generate(input_ids=b, sampling_params=GREEDY, session_params={"id": sid}, stream=True))
        last = chunks[-1]["meta_info"]
        assert last["prompt_tokens"] == 30 + 8 + 6 and last["cached_tokens"] == _full_pages(38)
        streamed = "".join(c["text"] for c in chunks)
        with pytest.raises(ValueError, match="does not support offset"):
            eng.generate(input_ids=b, sampling_params=GREEDY, session_params={"id": sid, "offset": 3})
        long = {"temperature": 0.0, "max_new_tokens": 900, "ignore_eos": True}
        it = eng.generate(input_ids=[5, 6], sampling_params=long, session_params={"id": sid}, stream=True)
        next(it)                                                              # running now
        with pytest.raises(ValueError, match="already has a request in flight"):
            eng.generate(input_ids=b, sampling_params=GREEDY, session_params={"id": sid})
        it.close()                                                            # aborted: not kept
        c = _ids(16, 4)
        third = eng.generate(input_ids=c, sampling_params=GREEDY, session_params={"id": sid})
        assert third["meta_info"]["prompt_tokens"] == 44 + 8 + 4
    finally:
        eng.close_session(sid)
    ref2 = _ref(eng, a + first["output_ids"] + b)
    assert ref2["text"] == streamed
    ref3 = _ref(eng, a + first["output_ids"] + b + ref2["output_ids"] + c)
    assert ref3["output_ids"] == third["output_ids"]


def test_async_generate_in_a_session(tiny_engine, sid) -> None:
    eng = tiny_engine
    a, b = _ids(17, 25), _ids(18, 5)

    async def main():
        one = await eng.async_generate(input_ids=a, sampling_params=GREEDY, session_params={"id": sid})
        two = await eng.async_generate(input_ids=b, sampling_params=GREEDY,
                                       session_params={"id": sid, "rid": one["meta_info"]["id"]})
        return one, two

    one, two = asyncio.run(main())
    assert two["meta_info"]["cached_tokens"] == _full_pages(33)
    eng.close_session(sid)
    assert _ref(eng, a + one["output_ids"] + b)["output_ids"] == two["output_ids"]


def test_bad_session_input_raises_and_the_engine_keeps_serving(tiny_engine, sid) -> None:
    eng = tiny_engine
    ok = eng.generate(input_ids=_ids(19, 5), sampling_params=GREEDY, session_params={"id": sid})
    bad = [({"id": "nope"}, "session 'nope' is not open"),
           ({"id": sid, "rid": "unknown-rid"}, f"request 'unknown-rid' is not in session '{sid}'"),
           ({"id": sid, "offset": 1.5}, r"session_params\['offset'\] must be an int"),
           ({"id": sid, "replace": "yes"}, r"session_params\['replace'\] must be a bool"),
           ({"id": sid, "turn": 2}, "unknown key 'turn'"),
           ({"id": 7}, r"session_params\['id'\] must be a non-empty str"),
           ([sid], "session_params must be a dict"),
           (sid, "session_params must be a dict")]
    for sp, msg in bad:
        with pytest.raises(ValueError, match=msg):
            eng.generate(input_ids=[5, 6], sampling_params=GREEDY, session_params=sp)
    with pytest.raises(ValueError, match="single prompt with n=1"):
        eng.generate(input_ids=[[5, 6], [7]], sampling_params=GREEDY, session_params={"id": sid})
    with pytest.raises(ValueError, match="single prompt with n=1"):
        eng.generate(input_ids=[5, 6], sampling_params={**GREEDY, "n": 2}, session_params={"id": sid})
    with pytest.raises(ValueError, match="cannot both be set"):
        eng.generate(input_ids=[5, 6], session_params={"id": sid}, session_id="x")
    with pytest.raises(ValueError, match="exceeds the context length"):
        eng.generate(input_ids=_ids(20, 500), sampling_params={"max_new_tokens": 520},
                     session_params={"id": sid, "rid": ok["meta_info"]["id"]})
    for kw, msg in (({"capacity_of_str_len": -1}, "capacity_of_str_len"), ({"capacity_of_str_len": 9, "timeout": 0},
                                                                          "timeout")):
        with pytest.raises(ValueError, match=msg):
            eng.open_session(**kw)
    assert eng.open_session(100, session_id=sid) is None                     # already open (SGLang: None)
    eng.close_session("never-opened")                                        # ignored, as SGLang
    for kw in ({"session_params": {"id": None}}, {"session_id": "tag"}):     # no session: the prompt as is
        assert eng.generate(input_ids=[5, 6], sampling_params=GREEDY, **kw)["meta_info"]["prompt_tokens"] == 2
    cont = eng.generate(input_ids=[5, 6], sampling_params=GREEDY,
                        session_params={"id": sid, "rid": ok["meta_info"]["id"]})
    assert cont["meta_info"]["prompt_tokens"] == 5 + 8 + 2
    eng.close_session(sid)
    with pytest.raises(ValueError, match=f"session '{sid}' is not open"):
        eng.generate(input_ids=[5, 6], session_params={"id": sid, "rid": ok["meta_info"]["id"]})
    assert eng.generate("hello", {"max_new_tokens": 3})["meta_info"]["completion_tokens"] == 3


def test_unfinished_rid_is_refused(tiny_engine, sid) -> None:
    eng = tiny_engine
    long = {"temperature": 0.0, "max_new_tokens": 900, "ignore_eos": True}
    it = eng.generate(input_ids=[5, 6, 7], sampling_params=long, session_params={"id": sid}, stream=True)
    rid = next(it)["meta_info"]["id"]
    try:
        with pytest.raises(ValueError, match="has not finished"):
            eng.generate(input_ids=[8], sampling_params=GREEDY, session_params={"id": sid, "rid": rid})
        out = eng.generate(input_ids=[8], sampling_params=GREEDY,              # replace aborts it
                           session_params={"id": sid, "rid": rid, "replace": True})
        rest = list(it)
        assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["prompt_tokens"] == 3 + rest[-1]["meta_info"]["completion_tokens"] + 1
    finally:
        it.close()


def test_pinned_session_survives_pressure_and_close_releases_it(tiny_llama_dir) -> None:
    import nbgen

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # the shared test engine is running too
        eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device=os.environ.get("NBGEN_TEST_DEVICE", "cpu"),
                           max_total_tokens=256, random_seed=0)
    try:
        assert eng.get_server_info()["max_total_tokens"] == 256                 # 16 pages
        sid = eng.open_session(10_000)
        a = _ids(21, 60)
        one = eng.generate(input_ids=a, sampling_params=GREEDY, session_params={"id": sid})
        other = _ids(22, 60)
        eng.generate(input_ids=other, sampling_params=GREEDY)                   # cached, not pinned
        pressure = [_ids(30 + k, 50) for k in range(5)]
        eng.generate(input_ids=pressure, sampling_params={**GREEDY, "max_new_tokens": 30})  # > 16 pages at once
        again = eng.generate(input_ids=other, sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] == 0                          # pressure evicted it
        b = _ids(23, 5)
        two = eng.generate(input_ids=b, sampling_params=GREEDY, session_params={"id": sid, "rid": one["meta_info"]["id"]})
        assert two["meta_info"]["cached_tokens"] == _full_pages(68)               # the pin held
        seq = a + one["output_ids"] + b + two["output_ids"]
        eng.generate(input_ids=pressure, sampling_params={**GREEDY, "max_new_tokens": 30})
        eng.close_session(sid)                                                    # the pin goes: evictable
        eng.generate(input_ids=pressure, sampling_params={**GREEDY, "max_new_tokens": 30})
        assert eng.generate(input_ids=seq + [7], sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0
        assert eng.flush_cache() and eng.stats()["kv_pages_used"] == 0            # all back in the pool
        ref = eng.generate(input_ids=a + one["output_ids"] + b, sampling_params=GREEDY)
        assert ref["output_ids"] == two["output_ids"]
        live = eng.open_session(10_000)
        three = eng.generate(input_ids=a, sampling_params=GREEDY, session_params={"id": live})
        assert eng.flush_cache() and eng.stats()["kv_pages_used"] == 0            # a flush drops pins too
        four = eng.generate(input_ids=b, sampling_params=GREEDY,
                            session_params={"id": live, "rid": three["meta_info"]["id"]})
        assert four["meta_info"]["cached_tokens"] == 0 and four["output_ids"] == two["output_ids"]
    finally:
        eng.shutdown()                                                            # with a session open
    with pytest.raises(RuntimeError, match="shut down"):
        eng.open_session(10)


def test_session_timeout_closes_it(tiny_engine) -> None:
    import time

    eng = tiny_engine
    sid = eng.open_session(10_000, timeout=0.2)
    out = eng.generate(input_ids=_ids(24, 40), sampling_params=GREEDY, session_params={"id": sid})
    deadline = time.monotonic() + 10
    while eng.open_session(10, session_id=sid) is None:     # None while open; reopens once timed out
        assert time.monotonic() < deadline, "the session did not time out"
        time.sleep(0.05)
    with pytest.raises(ValueError, match="is not in session"):                 # a new session of that id
        eng.generate(input_ids=[5], session_params={"id": sid, "rid": out["meta_info"]["id"]})
    eng.close_session(sid)


# ---- chat_session -------------------------------------------------------------------------------------
@pytest.fixture
def fake_display(monkeypatch) -> FakeDisplay:
    d = FakeDisplay()
    monkeypatch.setattr(_compat, "display", d)
    monkeypatch.setattr(_compat, "ipython_active", lambda: True)
    return d


def test_chat_session_continues_its_turns_in_the_engine_session(tiny_engine, fake_display) -> None:
    eng = tiny_engine
    tok = eng.get_tokenizer()
    (word,) = tok.encode(" is")
    sp = {"temperature": 0.0, "max_new_tokens": 3, "logit_bias": {str(word): 100.0}}  # " is is is": round-trips
    chat = chat_session(eng, system_prompt="Be brief.", sampling_params=sp, widget=False)
    chat.show()
    turns = [chat.send(q) for q in ("Hello", "The capital of France is", "And of Japan?")]
    for t in turns:
        t.wait()
    assert [t.continued for t in turns] == [False, True, True]
    msgs = chat.messages
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3
    assert all(m["content"] == " is is is" for m in msgs if m["role"] == "assistant")
    for k, t in enumerate(turns):
        prompt = tok.encode(eng.apply_chat_template(msgs[:2 + 2 * k]))
        assert t.state.meta["prompt_tokens"] == len(prompt)
        if k:                                     # the previous turn's prompt + reply, from the pin
            prev = tok.encode(eng.apply_chat_template(msgs[:2 * k])) + turns[k - 1].state.output_ids
            assert t.state.meta["cached_tokens"] == _full_pages(len(prev))
    # each turn's display ends as static HTML with its reply; the chat's own shows the transcript
    finals = list(fake_display.outputs.values())
    assert len(finals) == 4 and all(set(b) == {"text/plain", "text/html"} for b in finals)
    assert all('data-done="1"' in b["text/html"] for b in finals[1:])
    chat.close()
    final = list(fake_display.outputs.values())[0]
    assert "(closed)" in final["text/html"] and final["text/html"].count("nbgen-chat-assistant") == 3
    assert "user: And of Japan?" in final["text/plain"]
    with pytest.raises(ValueError, match="closed"):
        chat.send("more")


class _EditingEngine:
    """The engine with a chat template that rewrites earlier replies: renderings stop extending."""

    def __init__(self, eng: Any) -> None:
        self._eng = eng

    def __getattr__(self, name: str) -> Any:
        return getattr(self._eng, name)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        edited = [dict(m, content=m["content"] + " (edited)") if m["role"] == "assistant" else m for m in messages]
        return self._eng.apply_chat_template(edited, add_generation_prompt)


def test_chat_session_falls_back_to_the_whole_conversation(tiny_engine) -> None:
    eng = tiny_engine
    sp = {"temperature": 0.0, "max_new_tokens": 4}
    with chat_session(_EditingEngine(eng), sampling_params=sp) as chat:
        one = chat.send("Hello", display=False)
        two = chat.send("Tell me more", display=False)
        two.wait()
        assert not one.continued and not two.continued
        prompt = eng.get_tokenizer().encode(_EditingEngine(eng).apply_chat_template(chat.messages[:3]))
        assert two.state.meta["prompt_tokens"] == len(prompt) and two.state.meta["cached_tokens"] > 0
        ref = eng.generate(input_ids=prompt, sampling_params=sp)
        assert ref["text"] == two.text
    assert chat.closed
