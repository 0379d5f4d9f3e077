"""Incremental detokenization and stop-string matching for streamed output text.

IncrementalDetokenizer turns output token ids into text pieces as they arrive. It decodes only a
small window (prefix_offset .. end) and emits what the window's decode adds beyond its first part
(prefix_offset .. read_offset). That keeps each step O(window) and is right for tokenizers whose
decode of a suffix differs from the full decode (SentencePiece drops the leading space of the first
token; the window's first token is never emitted from that decode). Text that ends in U+FFFD is held
back because a multi-byte UTF-8 character (byte-level BPE) may be split over tokens. A trailing
run of SentencePiece byte-fallback tokens (<0xE6>) is held back whole until a normal token follows:
the ByteFallback decoder turns an invalid run into one U+FFFD per token, which depends on the whole
run. Joining all pieces plus flush() equals tokenizer.decode(output_ids, ...).

StopStringMatcher then scans the output text (never the prompt) for stop strings, holding back any
tail that might still grow into one, so a streamed client never sees text that is later trimmed.
"""
from __future__ import annotations

import functools
import re
import weakref
from typing import Any, Callable, Optional, Sequence

from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


_BYTE_IDS: "weakref.WeakKeyDictionary[Any, frozenset[int]]" = weakref.WeakKeyDictionary()


def byte_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's SentencePiece byte-fallback tokens (``<0xE6>``), read from its vocabulary
    once per tokenizer (every request's detokenizer shares the set)."""
    try:
        return _BYTE_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids = frozenset(i for name, i in vocab.items() if isinstance(name, str) and _BYTE_TOKEN.fullmatch(name))
    try:
        _BYTE_IDS[tokenizer] = ids
    except TypeError:                   # not weak-referenceable: computed again per detokenizer
        pass
    return ids


def backend_decode(tokenizer: Any, skip_special_tokens: bool) -> Optional[Callable[[list[int]], str]]:
    """The Rust tokenizer's own ``decode`` where ``tokenizer.decode(ids, skip_special_tokens=...)`` is
    exactly that call: transformers' fast tokenizer class (decode not overridden) without the clean-up
    of spaces. It skips ~7 us of Python checks per call, twice a chunk. None otherwise."""
    cls = type(tokenizer)
    if (getattr(cls, "decode", None) is not PreTrainedTokenizerBase.decode
            or getattr(cls, "_decode", None) is not PreTrainedTokenizerFast._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Per-request streaming decoder over the request's output ids."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        # prompt_ids are not used as decode context on purpose: the contract is that the text
        # equals decode(output_ids), and prompt context would keep a SentencePiece leading space.
        self.tokenizer = tokenizer
        self.num_prompt_tokens = len(prompt_ids)
        self.skip_special_tokens = skip_special_tokens
        self._kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            # only slow tokenizers honour it; fast ones accept and ignore extra kwargs
            self._kwargs["spaces_between_special_tokens"] = False
        self.ids: list[int] = []        # all output ids so far
        self.prefix_offset = 0          # start of the decode window (a character boundary)
        self.read_offset = 0            # ids[:read_offset] have been emitted as text
        self.text_len = 0               # characters emitted so far
        self.run_start = 0              # start of the trailing run of byte-fallback tokens
        self._byte_ids = byte_token_ids(tokenizer)
        self._fast = backend_decode(tokenizer, skip_special_tokens)
        # skipped special tokens vanish before the decoder runs, so they do not end a byte run
        self._transparent = set(getattr(tokenizer, "all_special_ids", [])) if skip_special_tokens else set()

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._fast is not None:
            return self._fast(ids)
        try:
            return self.tokenizer.decode(ids, **self._kwargs)
        except TypeError:               # a tokenizer without spaces_between_special_tokens
            self._kwargs.pop("spaces_between_special_tokens", None)
            return self.tokenizer.decode(ids, **self._kwargs)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new output ids; return the text they complete (may be "" while bytes are pending)."""
        if not self._byte_ids:          # byte-level BPE and most tokenizers: no byte-fallback runs
            self.ids.extend(int(t) for t in token_ids)
            self.run_start = len(self.ids)
            return self._advance(final=False)
        for t in token_ids:
            self.ids.append(int(t))
            if not (int(t) in self._byte_ids or int(t) in self._transparent):
                self.run_start = len(self.ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Release whatever is held back (e.g. an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        end = len(self.ids) if final else self.run_start
        if self.read_offset >= end:
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:end])
        if not final and new_text.endswith(_REPLACEMENT):
            return ""                   # an unfinished multi-byte character: wait for more bytes
        if len(new_text) <= len(prefix_text) and not final:
            return ""                   # nothing visible yet (e.g. only skipped special tokens)
        piece = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = end
        self.text_len += len(piece)
        return piece


class StopStringMatcher:
    """Finds the first stop string in streamed text; holds back possible stop-string prefixes."""

    def __init__(self, stops: Sequence[str], no_stop_trim: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.no_stop_trim = no_stop_trim
        self.held = ""                  # text not yet emitted (a possible start of a stop string)
        self.matched: Optional[str] = None
        self.max_len = max((len(s) for s in self.stops), default=0)

    @property
    def done(self) -> bool:
        return self.matched is not None

    def feed(self, new_text: str) -> tuple[str, Optional[str]]:
        """Add text; return (text safe to emit now, the stop string if one just matched).

        On a match, the emitted text ends right before the stop string (or includes it with
        no_stop_trim); any text after it is dropped and later feeds return ("", None).
        """
        if self.done:
            return "", None
        if not self.stops:
            return new_text, None
        buf = self.held + new_text
        hit = self._first_match(buf)
        if hit is not None:
            start, stop = hit
            self.matched, self.held = stop, ""
            return buf[:start] + (stop if self.no_stop_trim else ""), stop
        keep = self._partial_suffix_len(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """At the end of generation without a match, the held text is final output."""
        out, self.held = self.held, ""
        return out

    def _first_match(self, buf: str) -> Optional[tuple[int, str]]:
        # The stop that completes first wins (as if text arrived one character at a time):
        # smallest end index, then the longest (earliest-starting) one at that end.
        best: Optional[tuple[int, int, str]] = None
        for s in self.stops:
            i = buf.find(s)
            if i < 0:
                continue
            key = (i + len(s), i, s)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self.max_len - 1), 0, -1):
            tail = buf[len(buf) - k:]
            if any(s.startswith(tail) for s in self.stops if len(s) > k):
                return k
        return 0
