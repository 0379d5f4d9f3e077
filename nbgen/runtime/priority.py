"""Priority scheduling (SGLang's ``enable_priority_scheduling``): levels, preemption, the starvation guard.

Torch-free; the Scheduler uses it when ``PriorityConfig.enable_priority_scheduling`` is on.

- **Importance**: a request's ``priority`` int; larger is more important, smaller with
  ``schedule_low_priority_values_first``. A request without one gets ``default_priority_value``, else
  the least important value there is (SGLang: ``-sys.maxsize - 1``, or ``sys.maxsize``).
- **Order** (``PriorityWaitingQueue``): the most important level first; inside a level the
  ``WaitingQueue`` order (preempted requests first, then fcfs / lpm / lof).
- **Preemption** (``pick_victims``, SGLang's ``preempt_to_schedule``): when a waiting request finds
  the running slots or the KV pages full, running requests less important than it by more than
  ``priority_scheduling_preemption_threshold`` are preempted, least important first (the most recently
  admitted first among equals), until it fits; if even all of them would not make room, none is.
- **Starvation guard** (nbgen; SGLang has none): the oldest waiting request (by arrival at the
  scheduler; a preempted request keeps its arrival) may be passed over by at most
  ``max_priority_bypass`` admissions; then it is admitted before everything else, and once admitted
  this way it is never preempted for priority.
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Iterator, Optional

from nbgen.core.scheduler_config import PriorityConfig
from nbgen.core.request import Request, Status
from nbgen.runtime.pages import PagePool
from nbgen.runtime.prefix_cache import PrefixCache
from nbgen.runtime.waiting import WaitingQueue

DISABLED_MESSAGE = "Using priority is disabled for this server. Please send a new request without a priority."


def default_priority(cfg: PriorityConfig) -> int:
    """The priority of a request that gives none: ``default_priority_value``, else the least important."""
    if cfg.default_priority_value is not None:
        return cfg.default_priority_value
    return sys.maxsize if cfg.schedule_low_priority_values_first else -sys.maxsize - 1


def resolve_priority(req: Request, cfg: PriorityConfig) -> Optional[str]:
    """At arrival: give ``req`` its scheduling priority; an abort message when it is refused."""
    if not cfg.enable_priority_scheduling:
        if req.priority is not None and cfg.abort_on_priority_when_disabled:
            return DISABLED_MESSAGE
        return None
    if req.priority is None:
        req.priority = default_priority(cfg)
    return None


def importance(req: Request, cfg: PriorityConfig) -> int:
    """Larger = scheduled first (the sign of ``schedule_low_priority_values_first`` applied)."""
    p = req.priority if req.priority is not None else default_priority(cfg)
    return -p if cfg.schedule_low_priority_values_first else p


class PriorityWaitingQueue:
    """One ``WaitingQueue`` per priority level, most important first, and the starvation guard.

    The WaitingQueue interface (``append``, ``push_front``, ``remove``, ``in_order``, ``admitted``);
    a request's priority must not change while it waits.
    """

    def __init__(self, policy: str, cfg: PriorityConfig) -> None:
        self.policy = policy
        self.cfg = cfg
        self._levels: dict[int, WaitingQueue] = {}   # importance -> that level's queue
        self._n = 0
        self._target: Optional[Request] = None       # the oldest waiting request (the guard's)
        self._passed = 0                             # admissions that passed over the target

    def __len__(self) -> int:
        return self._n

    def _level(self, req: Request) -> WaitingQueue:
        imp = importance(req, self.cfg)
        q = self._levels.get(imp)
        if q is None:
            q = self._levels[imp] = WaitingQueue(self.policy)
        return q

    def append(self, req: Request) -> None:
        """A new arrival joins the back of its level."""
        self._level(req).append(req)
        self._n += 1

    def least_preferred(self) -> Optional[Request]:
        """The newest request of the least important level: what a more important arrival displaces
        when the queue is full (SGLang's ``max_queued_requests`` with priorities)."""
        for imp in sorted(self._levels):
            r = self._levels[imp].newest()
            if r is not None:
                return r
        return None

    def push_front(self, req: Request) -> None:
        """A preempted request goes before the arrivals of its level."""
        self._level(req).push_front(req)
        self._n += 1

    def remove(self, req: Request) -> None:
        imp = importance(req, self.cfg)
        q = self._levels.get(imp)
        if q is not None:
            before = len(q)
            q.remove(req)
            self._n -= before - len(q)
            if not q:
                del self._levels[imp]
        if req is self._target:
            self._target, self._passed = None, 0

    def _overdue(self) -> bool:
        limit = self.cfg.max_priority_bypass
        return self._target is not None and limit is not None and self._passed >= limit

    def in_order(self, cache: PrefixCache) -> Iterator[Request]:
        """The overdue oldest request (if any), then level by level. Do not add or remove while iterating."""
        oldest = None
        for q in self._levels.values():
            r = q.oldest()
            if r is not None and (oldest is None or r.arrival_seq < oldest.arrival_seq):
                oldest = r
        if oldest is not self._target:
            self._target, self._passed = oldest, 0
        first = oldest if self._overdue() else None
        if first is not None:
            yield first
        for imp in sorted(self._levels, reverse=True):
            q = self._levels.get(imp)
            for r in q.in_order(cache) if q is not None else ():
                if r is not first:
                    yield r

    def admitted(self, req: Request) -> None:
        """Count an admission that passed over the oldest waiting request; protect an overdue one."""
        if req is self._target:
            req.priority_promoted = self._overdue()
            self._target, self._passed = None, 0
        elif self._target is not None:
            self._passed += 1

    def counts(self) -> dict[int, int]:
        """Waiting requests per priority value."""
        sign = -1 if self.cfg.schedule_low_priority_values_first else 1
        return {sign * imp: len(q) for imp, q in self._levels.items()}


def pick_victims(req: Request, running: list[Request], cfg: PriorityConfig, pool: PagePool,
                 cache: PrefixCache, need_slot: bool, short_pages: int,
                 admitted_from: int) -> Optional[list[Request]]:
    """Running requests to preempt so that ``req`` fits: a running slot when ``need_slot``, and
    ``short_pages`` more free pages; None when the eligible ones would not make room (all or none).

    Eligible: running, admitted before this admission pass (``admit_seq < admitted_from``), not
    admitted by the starvation guard, and less important than ``req`` by more than the threshold.
    A victim's page counts as freed when nothing but the victims (and the prefix cache, which can
    then evict it) references it.
    """
    imp, th = importance(req, cfg), cfg.priority_scheduling_preemption_threshold
    cands = [r for r in running if r.status is Status.RUNNING and r.admit_seq < admitted_from
             and not r.priority_promoted and imp - importance(r, cfg) > th]
    cands.sort(key=lambda r: (importance(r, cfg), -r.admit_seq))
    chosen: list[Request] = []
    refs: Counter[int] = Counter()
    freed, rc = 0, pool.refcount
    for r in cands:
        chosen.append(r)
        for p in r.pages:
            refs[p] += 1
            if rc[p] - refs[p] - cache.holds(p) == 0:
                freed += 1
        if freed >= short_pages:
            return chosen
    return None


def grow_victim(running: list[Request], cfg: PriorityConfig) -> Request:
    """The running request preempted when the KV pages run dry: the least important, the most
    recently admitted among equals; requests admitted by the starvation guard last."""
    return min(running, key=lambda r: (r.priority_promoted, importance(r, cfg), -r.admit_seq))


def priority_stats(running: list[Request], waiting: PriorityWaitingQueue) -> dict[Any, dict[str, int]]:
    """``{priority: {"running": n, "waiting": m}}``, most important first; requests that gave no
    priority (and got no ``default_priority_value``) under ``None``."""
    cfg = waiting.cfg
    wait = waiting.counts()
    run = Counter(default_priority(cfg) if r.priority is None else r.priority for r in running)
    sign = -1 if cfg.schedule_low_priority_values_first else 1
    default = default_priority(cfg) if cfg.default_priority_value is None else None
    out: dict[Any, dict[str, int]] = {}
    for p in sorted(set(wait) | set(run), key=lambda v: -sign * v):
        out[None if p == default else p] = {"running": run.get(p, 0), "waiting": wait.get(p, 0)}
    return out


QUEUE_FULL = "The request queue is full."               # SGLang's messages (max_queued_requests)
DISPLACED = "The request is aborted by a higher priority request."


def queue_full_victim(waiting: Any, req: Request, cap: Optional[int], cfg: PriorityConfig
                      ) -> Optional[tuple[Request, str]]:
    """SGLang's ``max_queued_requests`` for an arrival ``req``: None while fewer than ``cap`` wait;
    else (the request to abort, its message): the arrival, or with priority scheduling the newest
    request of the least important level when the arrival is strictly more important."""
    if cap is None or len(waiting) < cap:
        return None
    if cfg.enable_priority_scheduling and isinstance(waiting, PriorityWaitingQueue):
        cand = waiting.least_preferred()
        if cand is not None and importance(req, cfg) > importance(cand, cfg):
            return cand, DISPLACED
    return req, QUEUE_FULL
