"""The awaitable half of Engine: async_generate and async streaming, bridged onto the caller's loop.

Results cross from the loop thread into an asyncio.Queue per call on the caller's own event loop;
cancelling the awaiting task aborts its requests. The loop thread hands a step's updates for one event
loop over in one ``call_soon_threadsafe`` (``LoopPost``): with 256 concurrent streams a wake-up per
token cost the loop thread ~3 us each and the event loop a callback each, per step.
"""
from __future__ import annotations

import asyncio
import threading
import warnings
import weakref
from typing import Any, AsyncIterator, Callable

from nbgen.core.request import Request
from nbgen.runtime.stream_buffer import StreamBuffer, take_chunks
from nbgen.runtime.tracker import Update


def ensure_event_loop() -> None:
    """Give the calling thread a current event loop when it has none, as SGLang's Engine does at
    start: SGLang scripts run ``asyncio.get_event_loop().run_until_complete(llm.async_generate(...))``,
    which raises once an earlier ``asyncio.run`` left the thread without one. A running loop (a
    notebook cell) is left alone."""
    try:
        asyncio.get_running_loop()
        return
    except RuntimeError:
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        asyncio.set_event_loop(asyncio.new_event_loop())


def _set_ready(buf: StreamBuffer) -> None:
    buf.ready.set()


class LoopPost:
    """Hands updates from the loop thread to queues of one asyncio loop, and wakes its streams'
    consumers: the first item after a drain schedules the drain (one ``call_soon_threadsafe``),
    later ones only join its list. It is the ``Waker`` of the loop's ``StreamBuffer``s."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[Any], None], Any]] = []   # (callback on the loop, its argument)

    def put(self, queue: asyncio.Queue, update: Update) -> None:
        """Queue ``update`` for ``queue`` (any thread); dropped when the event loop is closed."""
        self._add([(queue.put_nowait, update)])

    def wake(self, bufs: list[StreamBuffer]) -> None:
        """Set the ``ready`` events of ``bufs`` (any thread), all in one wake-up of the loop."""
        self._add([(_set_ready, b) for b in bufs])

    def _add(self, items: list[tuple[Callable[[Any], None], Any]]) -> None:
        with self._lock:
            first = not self._items
            self._items.extend(items)
            if not first:                    # a drain is already scheduled
                return
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:                 # the caller's loop is gone; nobody is listening
            with self._lock:
                self._items.clear()

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for fn, arg in items:
            fn(arg)


_POSTS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopPost]" = weakref.WeakKeyDictionary()
_POSTS_LOCK = threading.Lock()


def loop_post(loop: asyncio.AbstractEventLoop) -> LoopPost:
    """The one LoopPost of an event loop (made on first use; forgotten with the loop)."""
    with _POSTS_LOCK:
        post = _POSTS.get(loop)
        if post is None:
            post = _POSTS[loop] = LoopPost(loop)
        return post


class AsyncGenerateMixin:
    """async_generate() for Engine (uses its _prepare, _single, _abort_quietly, tokenizer and _loop)."""

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                             stream: bool = False, return_logprob: Any = False, top_logprobs_num: Any = 0,
                             logprob_start_len: Any = -1, token_ids_logprob: Any = None,
                             rid: Any = None, return_hidden_states: Any = False,
                             custom_logit_processor: Any = None, return_text_in_logprobs: bool = False,
                             priority: Any = None, session_params: Any = None, session_id: Any = None,
                             lora_path: Any = None, image_data: Any = None) -> Any:
        """Awaitable twin of generate(); with ``stream=True`` it returns an async iterator of chunks."""
        reqs, single = self._prepare(prompt, sampling_params, input_ids, return_logprob,
                                     top_logprobs_num, logprob_start_len, token_ids_logprob, rid,
                                     return_hidden_states, custom_logit_processor, return_text_in_logprobs,
                                     priority, session_params, session_id, lora_path, image_data)
        if stream:
            return self._astream(reqs)
        results: dict[str, dict] = {}
        async for upd in self._asubmit(reqs, stream=False):
            results[upd.rid] = upd.output
        outs = [results[r.rid] for r in reqs]
        return outs[0] if single and len(outs) == 1 else outs

    async def _asubmit(self, reqs: list[Request], stream: bool) -> AsyncIterator[Update]:
        post = loop_post(asyncio.get_running_loop())
        aq: asyncio.Queue = asyncio.Queue()

        def sink(u: Update) -> None:
            post.put(aq, u)

        pending = {r.rid for r in reqs}
        self._loop.submit(reqs, sink, stream=stream)
        try:
            while pending:
                upd: Update = await aq.get()
                if upd.finished:
                    pending.discard(upd.rid)
                yield upd
        finally:
            if pending:  # cancelled or closed early
                self._abort_quietly(list(pending), wait=False)   # never block the caller's loop

    async def _astream(self, reqs: list[Request]) -> AsyncIterator[dict[str, Any]]:
        """Chunks of the call's requests, as ``_stream`` (``index`` with several), on the caller's loop."""
        ready = asyncio.Event()
        bufs = [StreamBuffer(r, self.tokenizer, loop_post(asyncio.get_running_loop()), ready) for r in reqs]
        self._submit_streams(bufs)
        try:
            while not all(b.done for b in bufs):
                await ready.wait()
                ready.clear()
                for chunk in take_chunks(bufs):
                    yield chunk
        finally:
            left = [b.req.rid for b in bufs if not b.done]
            if left:  # cancelled or closed early
                self._abort_quietly(left, wait=False)   # never block the caller's loop
