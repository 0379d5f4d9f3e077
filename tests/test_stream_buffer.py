"""Streams through StreamBuffer: the consumer makes the text from ids, merges what it missed, loses nothing."""
from __future__ import annotations

import asyncio
import threading

import pytest

from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.runtime.stream_buffer import StreamBuffer, defers_text, merge_chunks, wake_all
from nbgen.runtime.tracker import Update
from tests.tiny_models import make_tokenizer

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = ["Caf\u00e9 cr\u00e8me", "def add(a, b):", "The capital of", "x", "\u65e5\u672c\u8a9e\u306e\u6587",
           "once upon", "1 2 3", "hello hello"]


class CountingWaker:
    def __init__(self) -> None:
        self.calls = 0

    def wake(self, bufs: list[StreamBuffer]) -> None:
        self.calls += 1
        for b in bufs:
            b.ready.set()


def _buffer(tok, **params) -> tuple[StreamBuffer, CountingWaker]:
    req = Request(rid="r", prompt_ids=[1, 2, 3], params=SamplingParams(**params))
    waker = CountingWaker()
    buf = StreamBuffer(req, tok, waker, threading.Event())
    return buf, waker


def test_merge_joins_text_ids_and_per_token_lists() -> None:
    a = {"text": "ab", "output_ids": [1, 2], "meta_info": {"id": "r", "completion_tokens": 2,
                                                          "input_token_logprobs": [(None, 5, None)],
                                                          "output_token_logprobs": [(-1.0, 1, None), (-2.0, 2, None)]}}
    b = {"text": "c", "output_ids": [3], "meta_info": {"id": "r", "completion_tokens": 3,
                                                      "output_token_logprobs": [(-3.0, 3, None)]}}
    m = merge_chunks(a, b)
    assert m["text"] == "abc" and m["output_ids"] == [1, 2, 3]
    assert m["meta_info"]["completion_tokens"] == 3
    assert [e[1] for e in m["meta_info"]["output_token_logprobs"]] == [1, 2, 3]
    assert m["meta_info"]["input_token_logprobs"] == [(None, 5, None)]      # the first chunk's only


def test_pushes_while_the_consumer_lags_become_one_chunk_and_one_wakeup() -> None:
    tok = make_tokenizer()
    buf, waker = _buffer(tok, max_new_tokens=30)
    ids = tok.encode("caf\u00e9 cr\u00e8me and more text here")
    assert buf.deferred
    woken = [buf.push(ids[i:i + 1], i + 1) for i in range(len(ids) - 1)]
    assert woken == [True] + [False] * (len(ids) - 2)      # woken once until the consumer takes
    wake_all([buf])
    assert waker.calls == 1 and buf.ready.is_set()
    chunk = buf.take()
    assert chunk["output_ids"] == ids[:-1] and chunk["meta_info"]["completion_tokens"] == len(ids) - 1
    assert chunk["meta_info"]["finish_reason"] is None
    assert buf.take() is None                              # nothing new
    assert buf.push(ids[-1:], len(ids))                    # taken: the next push wakes again
    final = {"text": "", "output_ids": ids, "meta_info": {"finish_reason": {"type": "length"}}}
    buf(Update("r", final, finished=True))
    last = buf.take()
    assert buf.done and last["output_ids"] == ids
    assert chunk["text"] + last["text"] == tok.decode(ids, skip_special_tokens=True)


def test_loop_built_chunks_merge_and_the_final_carries_the_rest() -> None:
    tok = make_tokenizer()
    buf, waker = _buffer(tok, max_new_tokens=30, stop=["never"])
    assert not buf.deferred and not defers_text(buf.req)
    meta = {"finish_reason": None}
    buf(Update("r", {"text": "ab", "output_ids": [1], "meta_info": meta}, finished=False))
    first = buf.take()
    buf(Update("r", {"text": "c", "output_ids": [2], "meta_info": meta}, finished=False))
    buf(Update("r", {"text": "d", "output_ids": [3], "meta_info": meta}, finished=False))
    assert waker.calls == 2                                # one per take, not one per chunk
    merged = buf.take()
    assert (first["text"], merged["text"], merged["output_ids"]) == ("ab", "cd", [2, 3])
    buf(Update("r", {"text": "e", "output_ids": [4], "meta_info": meta}, finished=False))   # never taken
    buf(Update("r", {"text": "abcdef", "output_ids": [1, 2, 3, 4, 5], "meta_info": {}}, finished=True))
    last = buf.take()
    assert last["text"] == "ef" and last["output_ids"] == [1, 2, 3, 4, 5] and buf.done


def test_concurrent_async_streams_join_to_the_generated_texts(tiny_engine) -> None:
    sps = [{**GREEDY, "max_new_tokens": 5 + 7 * i} for i in range(len(PROMPTS))]
    ref = tiny_engine.generate(PROMPTS, sps)

    async def one(i: int) -> list[dict]:
        return [c async for c in await tiny_engine.async_generate(PROMPTS[i], sps[i], stream=True)]

    async def main() -> list[list[dict]]:
        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))
    for chunks, r in zip(asyncio.run(main()), ref):
        assert "".join(c["text"] for c in chunks) == r["text"]
        assert sum((c["output_ids"] for c in chunks[:-1]), []) == r["output_ids"][:sum(len(c["output_ids"]) for c in chunks[:-1])]
        assert chunks[-1]["output_ids"] == r["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": len(r["output_ids"])}
        assert chunks[-1]["meta_info"]["completion_tokens"] == len(r["output_ids"])
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        counts = [c["meta_info"]["completion_tokens"] for c in chunks[:-1]]
        assert counts == sorted(counts) and len(set(counts)) == len(counts)


@pytest.mark.parametrize("params", [{}, {"stop": ["\x00never"]}, {"stop": ["\x00never"], "return_logprob": True}],
                         ids=["ids", "stop-strings", "logprobs"])
def test_a_slow_consumer_gets_the_rest_merged_and_loses_nothing(tiny_engine, params) -> None:
    lp = params.pop("return_logprob", False) if params else False
    p = {**GREEDY, "max_new_tokens": 24, **params}
    ref = tiny_engine.generate("slow reader", p, return_logprob=lp)
    it = tiny_engine.generate("slow reader", p, stream=True, return_logprob=lp)
    first = next(it)
    # a longer request started after the first chunk ends after the stream: the stream is finished
    # (all of its chunks pending) before the consumer reads on
    tiny_engine.generate("other", {**GREEDY, "max_new_tokens": 30})
    rest = list(it)
    assert len(rest) == 1                                  # everything since the first chunk, merged
    assert first["text"] + rest[0]["text"] == ref["text"]
    assert rest[0]["output_ids"] == ref["output_ids"]
    assert rest[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    if lp:
        assert [e[1] for e in rest[0]["meta_info"]["output_token_logprobs"]] == ref["output_ids"]


def test_a_stop_token_is_left_out_of_the_streamed_text(tiny_engine) -> None:
    probe = tiny_engine.generate("stop here", {**GREEDY, "max_new_tokens": 12})
    stop = probe["output_ids"][6]
    p = {"temperature": 0.0, "max_new_tokens": 12, "stop_token_ids": [stop]}
    ref = tiny_engine.generate("stop here", p)
    chunks = list(tiny_engine.generate("stop here", p, stream=True))
    assert ref["meta_info"]["finish_reason"]["type"] == "stop"
    assert "".join(c["text"] for c in chunks) == ref["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]


def test_async_stream_aborted_midway_ends_with_abort_and_closing_it_aborts(tiny_engine) -> None:
    p = {**GREEDY, "max_new_tokens": 500}

    async def aborted() -> dict:
        agen = await tiny_engine.async_generate("a", p, stream=True, rid="abort-me")
        first = await agen.__anext__()
        tiny_engine.abort(first["meta_info"]["id"])
        return [c async for c in agen][-1]

    async def closed() -> None:
        agen = await tiny_engine.async_generate("a", p, stream=True)
        await agen.__anext__()
        await agen.aclose()                                 # the caller stops reading: the request goes

    assert asyncio.run(aborted())["meta_info"]["finish_reason"]["type"] == "abort"
    before = tiny_engine.stats()["total_aborted"]
    asyncio.run(closed())
    tiny_engine.generate("b", {**GREEDY, "max_new_tokens": 2})   # submitted after the abort: handled after it
    assert tiny_engine.stats()["total_aborted"] == before + 1


def test_stream_host_bench_streams_the_generated_texts(tmp_path) -> None:
    """bench.stream_host on 12 requests: streamed texts equal the generated ones in both stream modes."""
    from nbgen.bench.stream_host import main

    tok = make_tokenizer()
    tok.save_pretrained(str(tmp_path))
    rows = main(["--requests", "12", "--scale", "0.05", "--step-ms", "0.5", "--launch-ms", "0", "--prefill-us", "0",
                 "--modes", "ids", "text", "stream", "sync-stream", "--tokenizer-path", str(tmp_path)])
    assert [r["mode"] for r in rows] == ["ids", "text", "stream", "sync-stream"]
    assert all(r["texts_equal"] for r in rows[1:])
    assert rows[2]["chunks"] >= 12 and rows[2]["out_tokens"] == rows[0]["out_tokens"]
