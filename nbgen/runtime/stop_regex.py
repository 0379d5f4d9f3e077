"""stop_regex: finish a request when its output text matches a regular expression.

``StopRegexMatcher`` has the interface of detokenizer.StopStringMatcher (feed / flush / done /
matched), so the tracker drives either. The output text so far is searched for the leftmost
complete match of any pattern (stop strings, when given too, join as escaped patterns). Text that
a match could still start in is held back, found with the ``regex`` module's partial matching
(a partial match is one that reaches the end of the text and could complete with more), so a
streamed client never sees text that is later trimmed.

A match finishes the request with ``FinishReason.stop(pattern)``: ``matched`` is the pattern that matched (the stop string itself for stop strings).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import regex

from nbgen.runtime.detokenizer import StopStringMatcher


def compile_stop_regex(patterns: Sequence[str]) -> list[Any]:
    """Compile patterns; ValueError naming the bad one (called at submit time too)."""
    out = []
    for p in patterns:
        try:
            pat = regex.compile(p)
        except regex.error as e:
            raise ValueError(f"invalid stop_regex {p!r}: {e}") from None
        if pat.fullmatch(""):
            raise ValueError(f"stop_regex {p!r} matches the empty string (it would stop at once)")
        out.append(pat)
    return out


class StopRegexMatcher:
    """Finds the first stop-regex (or stop-string) match in streamed text."""

    def __init__(self, patterns: Sequence[str], stop_strs: Sequence[str] = (), no_stop_trim: bool = False) -> None:
        self.sources = list(patterns) + [s for s in stop_strs if s]
        self.compiled = compile_stop_regex(patterns) + [regex.compile(regex.escape(s)) for s in stop_strs if s]
        self.no_stop_trim = no_stop_trim
        self.text = ""                  # all output text fed so far
        self.sent = 0                   # text[:sent] has been emitted
        self.matched: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.matched is not None

    def feed(self, new_text: str) -> tuple[str, Optional[str]]:
        """Add text; return (text safe to emit now, the pattern if one just matched)."""
        if self.done:
            return "", None
        self.text += new_text
        best: Optional[tuple[int, int, int]] = None   # (end, start, pattern index): first to complete
        for k, pat in enumerate(self.compiled):
            m = pat.search(self.text, self.sent)
            if m is not None and (best is None or (m.end(), m.start()) < best[:2]):
                best = (m.end(), m.start(), k)
        if best is not None:
            end, start, k = best
            self.matched = self.sources[k]
            out = self.text[self.sent:end if self.no_stop_trim else start]
            self.sent = len(self.text)
            return out, self.matched
        hold = len(self.text)
        for pat in self.compiled:
            m = pat.search(self.text, self.sent, partial=True)
            if m is not None and m.partial:
                hold = min(hold, m.start())
        out, self.sent = self.text[self.sent:hold], max(self.sent, hold)
        return out, None

    def flush(self) -> str:
        """At the end of generation without a match, the held text is final output."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def make_stop_matcher(stop_strs: Sequence[str], stop_regex: Any, no_stop_trim: bool) -> Optional[Any]:
    """The matcher a request needs: None, a StopStringMatcher, or a StopRegexMatcher."""
    patterns = [stop_regex] if isinstance(stop_regex, str) else list(stop_regex or [])
    if patterns:
        return StopRegexMatcher(patterns, stop_strs, no_stop_trim)
    if stop_strs:
        return StopStringMatcher(stop_strs, no_stop_trim)
    return None
