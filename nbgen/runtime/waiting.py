"""WaitingQueue: requests that hold no pages yet, and the order admission considers them in.

Order: preempted requests first (the oldest preempted first: they already produced output and
hold a place in line), then new arrivals in one of three orders:

- ``fcfs``: arrival order.
- ``lpm``: longest prefix-cache match first (ties keep arrival order). lpm matches every waiting
  request each step, so with more than ``LPM_MAX_WAITING`` waiting it falls back to fcfs, as SGLang does.
- ``lof``: longest output first, by ``max_new_tokens`` (None counts as unbounded; ties keep arrival
  order). With a small per-step token budget this spreads prefill over decode steps whose matmuls
  read the weights anyway, while the requests that will decode longest start first: a large model's
  offline batch then spends less time on prefill-only steps (docs/benchmarks.md). The
  sorted order is rebuilt only after arrivals, not every step.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Iterator, Optional

from nbgen.runtime.prefix_cache import PrefixCache
from nbgen.core.request import Request

LPM_MAX_WAITING = 128


def next_prompt_logprob(req: Request) -> int:
    """First prompt position whose logprob is not recorded yet (recorded ones are contiguous)."""
    return max(req.logprobs.logprob_start_len, 1) + len(req.input_token_logprobs)


def matchable_ids(req: Request) -> list[int]:
    """The leading part of all_ids the prefix cache may serve.

    Never all of it (the last token must be computed to get logits), and for prompt logprobs
    only up to the position before the first missing logprob (its logits predict that token).
    Nothing for embedding requests pooled over every position (mean, CLS): their states are needed;
    for hidden states, only positions whose states were collected (a preempted request's).
    """
    if req.embed is not None and not req.embed.reuses_prefix:
        return []
    cap = req.num_tokens - 1
    if req.wants_prompt_logprobs:
        cap = min(cap, next_prompt_logprob(req) - 1)
    if req.return_hidden_states:
        cap = min(cap, req.next_hidden_position())
    return req.prompt_ids[:cap] if cap <= len(req.prompt_ids) else req.all_ids[:cap]


class WaitingQueue:
    """Preempted requests (a short deque) in front of arrivals (an insertion-ordered dict: O(1) removal)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._front: deque[Request] = deque()
        self._arrivals: dict[str, Request] = {}
        self._by_output: deque[Request] = deque()   # lof: arrivals by max_new_tokens, may hold removed ones
        self._sorted = True

    def __len__(self) -> int:
        return len(self._front) + len(self._arrivals)

    def append(self, req: Request) -> None:
        """A new arrival joins the back."""
        self._arrivals[req.rid] = req
        self._sorted = False

    def push_front(self, req: Request) -> None:
        """A preempted request goes before everything else."""
        self._front.appendleft(req)

    def remove(self, req: Request) -> None:
        if self._arrivals.pop(req.rid, None) is None:
            try:
                self._front.remove(req)
            except ValueError:
                pass

    def oldest(self) -> Optional[Request]:
        """The waiting request that arrived first (``arrival_seq``; preempted ones keep theirs)."""
        first = next(iter(self._arrivals.values()), None)
        for r in self._front:
            if first is None or r.arrival_seq < first.arrival_seq:
                first = r
        return first

    def newest(self) -> Optional[Request]:
        """The waiting request that arrived last (preempted ones keep their arrival order)."""
        last = next(reversed(self._arrivals.values()), None)
        for r in self._front:
            if last is None or r.arrival_seq > last.arrival_seq:
                last = r
        return last

    def admitted(self, req: Request) -> None:
        """Admission hook (the priority queue's starvation guard counts there); nothing to do here."""

    def in_order(self, cache: PrefixCache) -> Iterator[Request]:
        """Requests in admission order; lazy for fcfs. Do not add or remove while iterating."""
        yield from list(self._front)
        if self.policy == "lpm" and len(self._arrivals) <= LPM_MAX_WAITING and not cache.disabled:
            queue = list(self._arrivals.values())
            keys = {r.rid: cache.match(matchable_ids(r), touch=False, ns=r.lora_id)[1] for r in queue}
            yield from sorted(queue, key=lambda r: -keys[r.rid])   # stable: ties keep arrival order
        elif self.policy == "lof":
            yield from self._longest_output_first()
        else:
            yield from self._arrivals.values()

    def _longest_output_first(self) -> Iterator[Request]:
        if not self._sorted:
            self._by_output = deque(sorted(self._arrivals.values(), key=_output_budget))  # stable
            self._sorted = True
        while self._by_output and self._by_output[0].rid not in self._arrivals:
            self._by_output.popleft()            # admitted or aborted since the sort (admission takes the head)
        yield from (r for r in self._by_output if r.rid in self._arrivals)


def _output_budget(req: Request) -> float:
    """Sort key of lof: minus the tokens a request may still generate."""
    n = req.params.max_new_tokens
    return -math.inf if n is None else -(n - len(req.output_ids))
