"""FinishReason: why a request stopped, typed; ``to_dict()`` gives SGLang's ``meta_info["finish_reason"]``.

The three shapes callers receive, exactly as SGLang writes them:

- ``FinishReason.stop(matched)`` -> ``{"type": "stop", "matched": matched}`` (a stop token id, or
  the stop string / stop_regex pattern that matched);
- ``FinishReason.length()`` -> ``{"type": "length", "length": n}`` (max_new_tokens or the context
  length; ``n``: the output tokens, which ``finish_dict`` is given);
- ``FinishReason.abort(message)`` -> ``{"type": "abort", "message": message, "status_code": None,
  "err_type": None}`` (SGLang's HTTP fields, unused in-process).

``reason["type"]`` and ``reason.get("matched")`` read it like the dict it becomes.
"""
from __future__ import annotations

from typing import Any, Optional, Union

STOP, LENGTH, ABORT = "stop", "length", "abort"


class FinishReason:
    """One finish reason; built through ``stop`` / ``length`` / ``abort``, compared by value."""

    __slots__ = ("type", "matched", "message")

    def __init__(self, type: str, matched: Union[int, str, None] = None, message: Optional[str] = None) -> None:
        self.type = type          # "stop" | "length" | "abort"
        self.matched = matched    # stop only: the token id, stop string or pattern that matched
        self.message = message    # abort only: why (shown to the caller)

    @classmethod
    def stop(cls, matched: Union[int, str]) -> "FinishReason":
        return cls(STOP, matched=matched)

    @classmethod
    def length(cls) -> "FinishReason":
        return _LENGTH

    @classmethod
    def abort(cls, message: str) -> "FinishReason":
        return cls(ABORT, message=message)

    @property
    def is_stop(self) -> bool:
        return self.type == STOP

    def to_dict(self, length: Optional[int] = None) -> dict[str, Any]:
        """SGLang's dict: ``{"type": "stop", "matched": m}``, ``{"type": "length", "length": n}``
        (without ``length`` when none is given) or ``{"type": "abort", "message": m, "status_code":
        None, "err_type": None}``."""
        if self.type == STOP:
            return {"type": STOP, "matched": self.matched}
        if self.type == ABORT:
            return {"type": ABORT, "message": self.message, "status_code": None, "err_type": None}
        return {"type": self.type} if length is None else {"type": self.type, "length": length}

    # dict-style reads (``reason["type"]``, ``reason.get("matched")``) for code written against the dict
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FinishReason):
            return (self.type, self.matched, self.message) == (other.type, other.matched, other.message)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.type, self.matched, self.message))

    def __repr__(self) -> str:
        return f"FinishReason({self.to_dict()!r})"


_LENGTH = FinishReason(LENGTH)


def finish_dict(reason: Union[FinishReason, dict[str, Any], None],
                length: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The caller-facing dict of a reason (a plain dict passes through unchanged); ``length``: the
    request's output tokens, SGLang's ``"length"`` of a length finish."""
    return reason.to_dict(length) if isinstance(reason, FinishReason) else reason
