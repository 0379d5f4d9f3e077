"""StreamBuffer: one streamed request's hand-off from the loop thread to the caller that consumes it.

The loop thread only appends a step's new token ids (``push``) and wakes the consumer when it had
taken everything before; the consumer (``take``) turns all ids that arrived since its last chunk into
one chunk: its own incremental detokenizer makes the text, so text, dicts and the wake-ups of a
stream cost the loop thread nothing per token. A consumer that lags gets one merged chunk — text
and output ids of every step it missed, joined — as SGLang's ``async_generate(stream=True)`` coalesces
its incremental chunks; nothing is lost, and joining all chunks' texts equals the non-streamed text.

Streams whose text the loop thread must see (stop strings or stop_regex, grammars, logprobs,
hidden states) get their chunks built there as before; the buffer merges those while the consumer
lags (text, output ids and the per-token meta_info lists joined, the rest from the latest). The
final chunk is the finished output with the text not yet handed out, as before.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Optional, Protocol

from nbgen.core.request import Request
from nbgen.runtime.detokenizer import IncrementalDetokenizer
from nbgen.runtime.outputs import build_output
from nbgen.runtime.tracker import Update

# meta_info lists with one entry per output token: a merged chunk joins them
PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs", "hidden_states")


class Waker(Protocol):
    """Wakes the consumers of buffers (called on the loop thread, once per step for all of them)."""

    def wake(self, bufs: list["StreamBuffer"]) -> None: ...


class DirectWaker:
    """For consumers blocked on a ``threading.Event`` (the sync iterator): set each one's event."""

    def wake(self, bufs: list["StreamBuffer"]) -> None:
        for b in bufs:
            b.ready.set()


DIRECT = DirectWaker()


def defers_text(req: Request) -> bool:
    """True when the consumer can build a stream's chunks from its ids alone: nothing on the loop
    thread reads the text (no stop strings, stop_regex or grammar) and no chunk carries per-token
    logprobs or hidden states."""
    p, lp = req.params, req.logprobs
    return (not p.stop_strs and not p.stop_regex and not p.constrained and req.embed is None
            and not lp.return_logprob and lp.logprob_start_len < 0 and not req.return_hidden_states)


def merge_chunks(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Chunk ``b`` after ``a`` as one chunk: text and output ids joined, meta_info from ``b`` with the
    per-token lists joined (keys only ``a`` has, such as the first chunk's prompt logprobs, kept)."""
    out = dict(b)
    out["output_ids"] = list(a["output_ids"]) + list(b["output_ids"])
    if "text" in b:
        out["text"] = a["text"] + b["text"]
    meta = {**a["meta_info"], **b["meta_info"]}
    for k in PER_TOKEN_META:
        if k in a["meta_info"] and k in b["meta_info"]:
            meta[k] = list(a["meta_info"][k]) + list(b["meta_info"][k])
    out["meta_info"] = meta
    return out


def wake_all(bufs: list["StreamBuffer"]) -> None:
    """Wake the consumers of ``bufs``: one ``wake`` call per waker (one event-loop wake-up each)."""
    if not bufs:
        return
    groups: dict[int, tuple[Waker, list[StreamBuffer]]] = {}
    for b in bufs:
        groups.setdefault(id(b.waker), (b.waker, []))[1].append(b)
    for waker, group in groups.values():
        waker.wake(group)


class StreamBuffer:
    """Made by the caller for one ``stream=True`` request and passed to ``submit`` as its sink.

    The consumer gives ``ready`` (a ``threading.Event``, or an ``asyncio.Event`` that its waker sets
    on the right event loop), waits on it, clears it, then calls ``take`` until ``done``."""

    def __init__(self, req: Request, tokenizer: Any, waker: Waker, ready: Any) -> None:
        self.req = req
        self.waker = waker
        self.ready = ready                   # the consumer's Event (threading or asyncio)
        self.deferred = defers_text(req)     # the consumer makes the text from ids
        self.done = False                    # the final chunk was taken
        self._lock = threading.Lock()
        self._ids: list[int] = []            # pushed ids not taken yet
        self._n_out = 0                      # output ids generated as of the last push
        self._chunk: Optional[dict[str, Any]] = None   # loop-built chunk(s) not taken yet, merged
        self._final: Optional[dict[str, Any]] = None   # the finished output
        self._signaled = False               # a wake-up is due or done since the last take
        self._pushed = False                 # the loop thread sends ids (else it sends built chunks)
        self.finish_hooks: list[Callable[[str], None]] = []   # called with the rid at the finish (loop thread)
        p = req.params
        self._detok = (IncrementalDetokenizer(tokenizer, req.prompt_ids, p.skip_special_tokens,
                                              p.spaces_between_special_tokens)
                       if self.deferred and tokenizer is not None else None)
        self._sent_chars = 0                 # text handed out in loop-built chunks

    # ---- loop thread ------------------------------------------------------------------------------
    def push(self, ids: list[int], n_out: int) -> bool:
        """Append new output ids (``n_out`` generated so far); True when the consumer must be woken."""
        with self._lock:
            self._pushed = True
            self._ids.extend(ids)
            self._n_out = n_out
            if self._signaled:
                return False
            self._signaled = True
            return True

    def __call__(self, upd: Update) -> None:
        """The sink: a loop-built chunk (merged into one not taken yet) or the finished output."""
        if upd.finished:
            for hook in self.finish_hooks:
                hook(upd.rid)
        with self._lock:
            if upd.finished:
                self._final = upd.output
            elif self._chunk is None:
                self._chunk = upd.output
            else:
                self._chunk = merge_chunks(self._chunk, upd.output)
            wake = upd.finished or not self._signaled   # a finish is always woken (its last push was not)
            self._signaled = True
        if wake:
            self.wake()

    def wake(self) -> None:
        """Wake the consumer now (a push that returned True, outside a step's batch of wake-ups)."""
        self.waker.wake([self])

    # ---- consumer ---------------------------------------------------------------------------------
    def take(self) -> Optional[dict[str, Any]]:
        """Everything that arrived since the last take as one chunk (None when nothing did)."""
        with self._lock:
            ids, self._ids = self._ids, []
            chunk, self._chunk = self._chunk, None
            final, self._final = self._final, None
            n_out = self._n_out
            pushed = self._pushed
            self._signaled = False
        if final is not None:
            self.done = True
            return self._final_chunk(final, ids, pushed)
        if chunk is not None:
            self._sent_chars += len(chunk.get("text") or "")
            return chunk
        if not ids:
            return None
        text = self._detok.add(ids) if self._detok is not None else None
        out = build_output(self.req, text, ids, None, finished=False)
        out["meta_info"]["completion_tokens"] = n_out
        return out

    def _final_chunk(self, final: dict[str, Any], ids: list[int], pushed: bool) -> dict[str, Any]:
        """The finished output with only the text no earlier chunk carried."""
        if "text" not in final:              # no tokenizer: no text key
            return final
        out = dict(final)
        if pushed and self._detok is not None:   # the last ids (a matched stop token left out), the held tail
            out["text"] = (self._detok.add(ids) if ids else "") + self._detok.flush()
        else:
            out["text"] = final["text"][self._sent_chars:]
        return out


def take_chunks(bufs: list[StreamBuffer]) -> Iterator[dict[str, Any]]:
    """The chunks ready in ``bufs``; with more than one buffer each is tagged with its ``index``."""
    for i, b in enumerate(bufs):
        chunk = None if b.done else b.take()
        if chunk is not None:
            if len(bufs) > 1:
                chunk["index"] = i
            yield chunk
