"""Data-parallel routing (torch-free): which replica serves a request.

Least-loaded by default, the load of a replica being the work its unfinished requests hold or will
(``cost`` each; the DPLoop passes the KV tokens a request's decode steps read plus its prompt):
requests of mixed lengths split by their work, not their count (by count, W-nano's outputs split
52.7 / 47.3 over two replicas, and the run lasts as long as the busier one). A call's requests are
planned together (``plan``): a decode step also costs a fixed part (the weights read, ``step_cost``
in the same units) whatever its rows, and a replica steps as long as its longest request, so the
longest requests go together to one replica and the others split the rest: fewer steps in all than
every replica running as long as the longest one. Prefix-aware where it wins: a prompt whose first
``PREFIX_TOKENS`` tokens were routed before goes back to that replica, whose prefix cache probably
holds them, unless that replica is busier than the least-loaded one by more than ``slack`` (then the
cache hit would cost more waiting than it saves). Samples of one
prompt (``group``) and requests of one session stay together.
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Optional

PREFIX_TOKENS = 64      # tokens keying a prompt's prefix (shorter prompts route by load only)
PREFIX_ENTRIES = 8192   # prefixes remembered (least recently routed forgotten first)


def request_cost(prompt_tokens: int, max_new_tokens: int) -> int:
    """A request's work in KV tokens read: its decode steps' attention reads (each step reads the
    prompt and the tokens decoded so far) plus its prompt's prefill."""
    n = max(max_new_tokens, 1)
    return n * prompt_tokens + n * (n + 1) // 2 + prompt_tokens


@dataclass
class PlanItem:
    """One request of a call to plan: its ``cost`` (``request_cost``) and decode ``steps``."""
    cost: int
    steps: int


class Router:
    """Routes requests over ``n`` replicas and tracks which one holds each unfinished request
    (thread-safe: the caller's threads route, the replicas' loop threads report finishes).
    ``step_cost``: what one decode step costs beyond its rows' work, in the units of ``cost``."""

    def __init__(self, n: int, step_cost: int = 0) -> None:
        self.n = n
        self.step_cost = step_cost
        self._lock = threading.Lock()
        self._load = [0] * n                      # cost of the unfinished requests per replica
        self._steps = [Counter() for _ in range(n)]   # per replica: decode steps -> unfinished requests
        self._where: dict[str, tuple[int, int, int]] = {}   # rid -> (replica, its cost, its steps)
        self._prefix: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._sessions: dict[str, int] = {}       # session id -> replica
        self.prefix_routed = 0                    # requests sent to their prefix's replica

    @staticmethod
    def slack(least: int, cost: int = 1) -> int:
        """How much busier (cost) than the least-loaded replica a prefix's replica may be and still win:
        a quarter of the least load, and at least two requests of this one's ``cost``."""
        return max(2 * cost, least // 4)

    def least_loaded(self) -> int:
        """The replica with the least cost of unfinished requests (the lowest index on ties)."""
        with self._lock:
            return min(range(self.n), key=self._load.__getitem__)

    def plan(self, items: list[PlanItem]) -> list[int]:
        """A replica for each of one call's requests: the longest (most steps) first, to the replica
        already stepping longest while its time (load plus ``step_cost`` per step) stays under the
        others' share of the rest, then on to the next replica; the last takes what is left.
        Without a ``step_cost`` (or on one replica) each request goes to the least loaded in turn."""
        with self._lock:
            load = list(self._load)
            steps = [max(c, default=0) for c in self._steps]
        out = [0] * len(items)
        if self.step_cost <= 0 or self.n == 1:
            for j, it in enumerate(items):
                i = min(range(self.n), key=load.__getitem__)
                out[j] = i
                load[i] += it.cost
            return out
        left = sorted(range(len(items)), key=lambda j: -items[j].steps)    # longest first
        reps = sorted(range(self.n), key=lambda i: (-steps[i], load[i]))
        rest = sum(it.cost for it in items)
        S = self.step_cost
        for k, i in enumerate(reps[:-1]):
            others = reps[k + 1:]
            base, m = sum(load[o] for o in others), len(others)
            stepped: dict[int, int] = {}      # longest -> the others' steps in all if they step that long

            def share(cost: int, longest: int) -> float:
                if longest not in stepped:
                    stepped[longest] = sum(max(steps[o], longest) for o in others)
                return (base + cost + S * stepped[longest]) / m
            skipped: list[int] = []
            for pos, j in enumerate(left):
                it = items[j]
                # the others step at least as long as the longest request they get: the first one this
                # replica skipped, else this one (skipped now) or the next (taken now)
                if skipped:
                    long_take = long_skip = items[skipped[0]].steps
                else:
                    long_take = items[left[pos + 1]].steps if pos + 1 < len(left) else 0
                    long_skip = it.steps
                take = max(load[i] + it.cost + S * max(steps[i], it.steps), share(rest - it.cost, long_take))
                skip = max(load[i] + S * steps[i], share(rest, long_skip))
                if take <= skip:
                    out[j] = i
                    load[i] += it.cost
                    steps[i] = max(steps[i], it.steps)
                    rest -= it.cost
                else:
                    skipped.append(j)
            left = skipped
        for j in left:
            out[j] = reps[-1]
        return out

    def route(self, rid: str, prompt_ids: list[int], group: Optional[str] = None,
              session: Optional[str] = None, groups: Optional[dict[str, int]] = None, cost: int = 1,
              steps: int = 0, planned: Optional[int] = None) -> int:
        """Choose a replica for one request and count its ``cost`` and decode ``steps`` there;
        ``groups``: the groups of this submission already routed (group -> replica), updated;
        ``planned``: the replica ``plan`` chose (else the least loaded), which a known prompt prefix
        may override."""
        with self._lock:
            if rid in self._where:
                raise ValueError(f"rid {rid!r} is already used by a request that has not finished "
                                 f"(request ids must be unique)")
            if session is not None and session in self._sessions:
                i = self._sessions[session]
            elif groups is not None and group is not None and group in groups:
                i = groups[group]
            else:
                i = self._pick(prompt_ids, cost, planned)
            if groups is not None and group is not None:
                groups[group] = i
            self._where[rid] = (i, cost, steps)
            self._load[i] += cost
            self._steps[i][steps] += 1
            return i

    def _pick(self, prompt_ids: list[int], cost: int, planned: Optional[int]) -> int:
        least = planned if planned is not None else min(range(self.n), key=self._load.__getitem__)
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
                i, cost, steps = entry
                self._load[i] -= cost
                left = self._steps[i]
                left[steps] -= 1
                if not left[steps]:
                    del left[steps]

    def where(self, rid: str) -> Optional[int]:
        """The replica serving an unfinished request, or None."""
        with self._lock:
            entry = self._where.get(rid)
            return entry[0] if entry is not None else None

    def bind_session(self, session_id: str, replica: int) -> None:
        """Requests of this session go to ``replica`` (where its KV lives)."""
        with self._lock:
            self._sessions[session_id] = replica

    def session_replica(self, session_id: str) -> Optional[int]:
        """The replica a session was opened on (None if unknown)."""
        with self._lock:
            return self._sessions.get(session_id)

    def unbind_session(self, session_id: str) -> Optional[int]:
        """Forget a session -> the replica it was on (None if unknown)."""
        with self._lock:
            return self._sessions.pop(session_id, None)

    def loads(self) -> list[int]:
        """Cost of the unfinished requests per replica."""
        with self._lock:
            return list(self._load)
