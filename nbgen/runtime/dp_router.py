"""Data-parallel routing (torch-free): which replica serves a request.

Least-loaded by default, the load of a replica being the tokens its unfinished requests hold or will
(prompt + max_new_tokens each; SGLang's ``minimum_tokens`` balancing): requests of mixed lengths split
by their work, not their count (by count, W-nano's outputs split 52.7 / 47.3 over two replicas, and
the run lasts as long as the busier one). Prefix-aware where it wins: a prompt whose first
``PREFIX_TOKENS`` tokens were routed before goes back to that replica, whose prefix cache probably
holds them, unless that replica is busier than the least-loaded one by more than ``slack`` (then the
cache hit would cost more waiting than it saves). Samples of one
prompt (``group``) and requests of one session stay together.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

PREFIX_TOKENS = 64      # tokens keying a prompt's prefix (shorter prompts route by load only)
PREFIX_ENTRIES = 8192   # prefixes remembered (least recently routed forgotten first)


class Router:
    """Routes requests over ``n`` replicas and tracks which one holds each unfinished request
    (thread-safe: the caller's threads route, the replicas' loop threads report finishes)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._lock = threading.Lock()
        self._load = [0] * n                      # tokens of the unfinished requests per replica
        self._where: dict[str, tuple[int, int]] = {}   # rid -> (replica, its tokens)
        self._prefix: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._sessions: dict[str, int] = {}       # session id -> replica
        self.prefix_routed = 0                    # requests sent to their prefix's replica

    @staticmethod
    def slack(least: int, cost: int = 1) -> int:
        """How much busier (tokens) than the least-loaded replica a prefix's replica may be and still win:
        a quarter of the least load, and at least two requests of this one's ``cost``."""
        return max(2 * cost, least // 4)

    def least_loaded(self) -> int:
        """The replica with the fewest tokens of unfinished requests (the lowest index on ties)."""
        with self._lock:
            return min(range(self.n), key=self._load.__getitem__)

    def route(self, rid: str, prompt_ids: list[int], group: Optional[str] = None,
              session: Optional[str] = None, groups: Optional[dict[str, int]] = None, cost: int = 1) -> int:
        """Choose a replica for one request and count its ``cost`` (tokens) there; ``groups``: the
        groups of this submission already routed (group -> replica), updated."""
        with self._lock:
            if rid in self._where:
                raise ValueError(f"rid {rid!r} is already used by a request that has not finished "
                                 f"(request ids must be unique)")
            if session is not None and session in self._sessions:
                i = self._sessions[session]
            elif groups is not None and group is not None and group in groups:
                i = groups[group]
            else:
                i = self._pick(prompt_ids, cost)
            if groups is not None and group is not None:
                groups[group] = i
            self._where[rid] = (i, cost)
            self._load[i] += cost
            return i

    def _pick(self, prompt_ids: list[int], cost: int) -> int:
        least = min(range(self.n), key=self._load.__getitem__)
        if len(prompt_ids) < PREFIX_TOKENS:
            return least
        key = tuple(prompt_ids[:PREFIX_TOKENS])
        owner = self._prefix.get(key)
        if owner is not None and self._load[owner] <= self._load[least] + self.slack(self._load[least], cost):
            self._prefix.move_to_end(key)
            self.prefix_routed += owner != least
            return owner
        self._prefix[key] = least
        self._prefix.move_to_end(key)
        if len(self._prefix) > PREFIX_ENTRIES:
            self._prefix.popitem(last=False)
        return least

    def done(self, rid: str) -> None:
        """A request finished (or was refused): its replica's load drops."""
        with self._lock:
            entry = self._where.pop(rid, None)
            if entry is not None:
                self._load[entry[0]] -= entry[1]

    def where(self, rid: str) -> Optional[int]:
        """The replica serving an unfinished request, or None."""
        with self._lock:
            entry = self._where.get(rid)
            return entry[0] if entry is not None else None

    def bind_session(self, session_id: str, replica: int) -> None:
        """Requests of this session go to ``replica`` (where its KV lives)."""
        with self._lock:
            self._sessions[session_id] = replica

    def unbind_session(self, session_id: str) -> Optional[int]:
        """Forget a session -> the replica it was on (None if unknown)."""
        with self._lock:
            return self._sessions.pop(session_id, None)

    def loads(self) -> list[int]:
        """Tokens of the unfinished requests per replica."""
        with self._lock:
            return list(self._load)
