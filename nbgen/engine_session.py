"""Engine sessions (SGLang): ``open_session`` / ``close_session`` and generate()'s ``session_params``.

The caller's side checks the arguments; the session's request tree, the prompts it builds and the KV
pin of its latest sequence live on the loop thread (``runtime/sessions.py``).
"""
from __future__ import annotations

import math
import uuid
from typing import Any, Optional

from nbgen.core.request import Request
from nbgen.core.session import SessionParams


class SessionMixin:
    """open_session / close_session for Engine (uses its _loop and _check_alive)."""

    def open_session(self, capacity_of_str_len: int, session_id: Optional[str] = None, streaming: bool = False,
                     timeout: Optional[float] = None) -> Optional[str]:
        """Open a session for multi-turn generation that reuses each turn's KV cache.

        Returns the session id (``session_id``, or a new uuid hex), or None when a session with
        that id is open already (as SGLang). Requests join it with
        ``generate(..., session_params={"id": sid, "rid": ...})``. While open, the session pins up
        to ``capacity_of_str_len`` tokens of its latest sequence in the KV cache. ``streaming=True``:
        each request continues the previous one (one at a time, appends only). ``timeout``: closed
        after that many seconds without a new request.
        """
        if not isinstance(capacity_of_str_len, int) or isinstance(capacity_of_str_len, bool) \
                or capacity_of_str_len < 0:
            raise ValueError(f"capacity_of_str_len must be an int >= 0, got {capacity_of_str_len!r:.60}")
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise ValueError(f"session_id must be a non-empty str or None, got {session_id!r:.60}")
        if not isinstance(streaming, bool):
            raise ValueError(f"streaming must be a bool, got {streaming!r:.60}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r:.60}")
        self._check_alive()
        sid = session_id if session_id is not None else uuid.uuid4().hex
        return self._loop.open_session(capacity_of_str_len, sid, streaming,
                                       float(timeout) if timeout is not None else None)

    def close_session(self, session_id: str) -> None:
        """Close a session: its KV pin is dropped (the pages stay in the prefix cache, evictable);
        requests of it still running finish normally. An unknown id is ignored (with a warning)."""
        if not isinstance(session_id, str):
            raise ValueError(f"session_id must be a str, got {session_id!r:.60}")
        self._check_alive()
        self._loop.close_session(session_id)

    @staticmethod
    def _bind_session(reqs: list[Request], session_params: Any, session_id: Any) -> None:
        """Check generate()'s session arguments and mark its request as a session request.

        ``session_id`` (SGLang: a stable id shared by a session's requests that leaves the prompt
        as it is) is accepted and changes nothing here; with ``session_params`` it is an error.
        """
        if session_id is not None and not isinstance(session_id, str):
            raise ValueError(f"session_id must be a str or None, got {session_id!r:.60}")
        if session_params is None:
            return
        if session_id is not None:
            raise ValueError("session_id and session_params cannot both be set")
        sp = SessionParams.from_dict(session_params)
        if sp is None:
            return
        if len(reqs) != 1:
            raise ValueError("session_params takes a single prompt with n=1 "
                             f"(got {len(reqs)} requests: a list of prompts or n > 1)")
        reqs[0].session = sp
