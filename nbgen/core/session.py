"""SessionParams: where a generate() request sits in an engine session (SGLang's ``session_params``).

A request in a session continues an earlier request of that session: its prompt is that request's
prompt and output (``offset`` trims it, ``drop_previous_output`` leaves the output out), then its
own ids. ``runtime/sessions.py`` builds that prompt on the loop thread; this module only checks
the caller's dict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

SESSION_KEYS = ("id", "rid", "offset", "replace", "drop_previous_output")


@dataclass(frozen=True)
class SessionParams:
    """One request's session arguments.

    ``id``: the open session; ``rid``: the earlier request to continue (None: a new root of the
    session, or the latest request of a streaming session); ``offset``: keep only
    ``context[:offset]`` of that request's prompt + output (Python slicing, so -1 drops the last
    token; None or 0 keeps it all); ``replace``: drop the other continuations of ``rid`` (with
    ``rid`` None: every request of the session); ``drop_previous_output``: continue from that
    request's prompt only.
    """

    id: str
    rid: Optional[str] = None
    offset: Optional[int] = None
    replace: bool = False
    drop_previous_output: bool = False

    @classmethod
    def from_dict(cls, d: Any) -> Optional["SessionParams"]:
        """Check a ``session_params`` dict; None when it names no session (``id`` None, as SGLang)."""
        if isinstance(d, SessionParams):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"session_params must be a dict or None, got {type(d).__name__}")
        for k in d:
            if k not in SESSION_KEYS:
                raise ValueError(f"session_params has an unknown key {k!r} (valid: {', '.join(SESSION_KEYS)})")
        sid = d.get("id")
        if sid is None:
            return None
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"session_params['id'] must be a non-empty str, got {sid!r:.60}")
        rid = d.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"session_params['rid'] must be a str or None, got {rid!r:.60}")
        offset = d.get("offset")
        if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool)):
            raise ValueError(f"session_params['offset'] must be an int or None, got {offset!r:.60}")
        flags = {}
        for k in ("replace", "drop_previous_output"):
            v = d.get(k)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"session_params[{k!r}] must be a bool or None, got {v!r:.60}")
            flags[k] = bool(v)
        return cls(id=sid, rid=rid, offset=offset or None, **flags)
