"""Per-request output tracking on the loop thread: incremental text, stop strings, updates to callers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from nbgen.core.finish import FinishReason
from nbgen.core.request import Request
from nbgen.runtime.detokenizer import IncrementalDetokenizer
from nbgen.runtime.outputs import build_output
from nbgen.runtime.stop_regex import make_stop_matcher


class IdSink(Protocol):
    """A stream's consumer side that takes token ids and makes the text itself (``StreamBuffer``)."""

    def push(self, ids: list[int], n_out: int) -> bool:
        """Append new output ids; True when the consumer must be woken."""
        ...

    def wake(self) -> None:
        """Wake the consumer now."""
        ...


def _text_ids(req: Request, new_ids: list[int]) -> list[int]:
    """``new_ids`` without a finished request's matched stop token, which is not part of the text
    (unless ``no_stop_trim``)."""
    fr = req.finish_reason
    matched = fr.get("matched") if req.finished and fr and fr.get("type") == "stop" else None
    if isinstance(matched, int) and not req.params.no_stop_trim and new_ids and new_ids[-1] == matched:
        return new_ids[:-1]
    return new_ids


@dataclass
class Update:
    """What a caller's sink receives: a stream delta, or (finished=True) the final output dict."""

    rid: str
    output: dict[str, Any]   # SGLang-shaped dict; text/output_ids are deltas unless finished
    finished: bool


class Tracked:
    """Turns a request's new token ids into text deltas, finishing it when a stop string matches.

    A streamed request is sent its first token at once, then a chunk whenever ``stream_interval``
    new tokens are unsent (SGLang's rule; its sampling param ``stream_interval`` overrides the
    engine's), and its finish at once. Without a tokenizer the outputs carry no ``text`` key."""

    def __init__(self, req: Request, sink: Callable[[Update], None], stream: bool, tokenizer: Any,
                 stream_interval: int = 1, buffer: Optional[IdSink] = None) -> None:
        self.req = req
        self.sink = sink
        self.stream = stream
        self.tokenizer = tokenizer
        self.interval = req.params.stream_interval or stream_interval
        p = req.params
        # a stream whose consumer makes its text (runtime/stream_buffer.py): this side hands it the new
        # ids and never detokenizes
        self.buffer = buffer
        self.detok = (IncrementalDetokenizer(tokenizer, req.prompt_ids, p.skip_special_tokens,
                                             p.spaces_between_special_tokens)
                      if tokenizer is not None and req.embed is None and buffer is None else None)
        self.matcher = make_stop_matcher(p.stop_strs, p.stop_regex, p.no_stop_trim)
        # nobody reads this request's text before it finishes: the loop only counts its tokens per
        # step and calls advance() once, at the finish (the text is detokenized in one go there)
        self.quiet = not stream and self.matcher is None
        # a stream without stop strings is not even detokenized between its chunks
        self.lazy = stream and self.matcher is None and (self.interval > 1 or buffer is not None)
        self.n_ids = 0            # output ids already seen (counted as generated)
        self.n_text = 0           # output ids already turned into text
        self.n_sent_ids = 0       # output ids already sent to a streaming caller
        self.text = ""            # text released so far
        self.n_sent_text = 0
        # SGLang's return_text_in_logprobs: each logprob triple carries its token's own text
        self.decode = (self._token_text if (tokenizer is not None and req.logprobs.return_text_in_logprobs)
                       else None)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def within_interval(self, n_out: int) -> bool:
        """A stream that sent its first chunk waits until ``stream_interval`` new tokens are unsent
        (the loop skips ``advance`` for a ``lazy`` one meanwhile)."""
        return 0 < self.n_sent_ids and n_out - self.n_sent_ids < self.interval

    def push_new(self) -> bool:
        """A pushed stream's new ids to its consumer; True when the consumer must be woken."""
        req = self.req
        n = len(req.output_ids)
        new = req.output_ids[self.n_sent_ids:n]
        self.n_sent_ids = self.n_ids = self.n_text = n
        return self.buffer.push(new, n)

    def _finish_pushed(self) -> Update:
        """A pushed stream's finish: its last text ids (a matched stop token left out) to the consumer,
        then the finished output, whose text the consumer completes."""
        req = self.req
        new = _text_ids(req, req.output_ids[self.n_sent_ids:])
        self.n_sent_ids = self.n_ids = self.n_text = len(req.output_ids)
        self.buffer.push(new, len(req.output_ids))     # no wake-up: the finished output follows at once
        return Update(req.rid, build_output(req, self._text(""), list(req.output_ids), self.decode, finished=True),
                      finished=True)

    def advance(self, scheduler: Any) -> Optional[Update]:
        """Consume new ids; may finish the request on a stop string. Returns an Update to send, or None.
        (The loop skips quiet requests until they finish.)"""
        req = self.req
        if self.buffer is not None:             # its consumer makes the text
            if req.finished:
                return self._finish_pushed()
            if self.push_new():
                self.buffer.wake()
            return None
        self.n_ids = len(req.output_ids)
        new_ids = req.output_ids[self.n_text:]
        self.n_text = len(req.output_ids)
        text_ids = _text_ids(req, new_ids)
        if self.matcher is not None and not self.matcher.done and self.detok is not None and len(text_ids) > 1:
            emit, matched = self._feed_each(text_ids)   # a speculative step's run of tokens
            piece = None
        else:
            piece = self.detok.add(text_ids) if (self.detok is not None and text_ids) else ""
            if req.finished and self.detok is not None:
                piece += self.detok.flush()
        if self.matcher is not None and (piece is None or not self.matcher.done):
            if piece is not None:
                emit, matched = self.matcher.feed(piece)
            if matched is not None:
                if not req.finished:
                    scheduler.finish(req, FinishReason.stop(matched))
                else:  # finished by length/token in the same step: the string wins (SGLang's
                    # check_finished reports length first; docs/api.md, Output dict)
                    req.finish_reason = FinishReason.stop(matched)
            elif req.finished:
                emit += self.matcher.flush()
            piece = emit
        elif self.matcher is not None:
            piece = ""  # text after a matched stop string is dropped
        self.text += piece
        if req.finished:
            return Update(req.rid, build_output(req, self._text(self.text), list(req.output_ids), self.decode,
                                                finished=True), finished=True)
        n_out = len(req.output_ids)
        if (not self.stream or (n_out == self.n_sent_ids and len(self.text) == self.n_sent_text)
                or self.within_interval(n_out)):
            return None
        delta_ids = req.output_ids[self.n_sent_ids:]
        out = build_output(req, self._text(self.text[self.n_sent_text:]), delta_ids, self.decode, finished=False,
                           logprob_start=self.n_sent_ids)
        self.n_sent_ids, self.n_sent_text = n_out, len(self.text)
        return Update(req.rid, out, finished=False)

    def _feed_each(self, ids: list[int]) -> tuple[str, Optional[str]]:
        """Several new tokens (accepted drafts): matched one token at a time, as plain decoding
        meets them; a stop string inside the run cuts the output after its last token."""
        req, emit = self.req, ""
        first = len(req.output_ids) - len(ids)
        for j, tok in enumerate(ids):
            last = j == len(ids) - 1
            piece = self.detok.add([tok])
            if last and req.finished:
                piece += self.detok.flush()
            out, matched = self.matcher.feed(piece)
            emit += out
            if matched is not None:
                if not last:
                    req.trim_output(first + j + 1)
                    self.n_ids = self.n_text = len(req.output_ids)
                return emit, matched
        return emit, None

    def _text(self, text: str) -> Optional[str]:
        """The text of an output, or None (no text key) without a tokenizer."""
        return text if self.tokenizer is not None else None

    def final_update(self) -> Update:
        """The finished output with whatever text was released so far (used after a failure)."""
        return Update(self.req.rid, build_output(self.req, self._text(self.text), list(self.req.output_ids),
                                                 self.decode, finished=True), finished=True)
