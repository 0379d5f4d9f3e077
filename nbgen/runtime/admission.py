"""Admission: waiting requests into a step (prefix match, pages, running slots, priority preemption; no torch).

The Scheduler calls ``Admission.admit`` once per step that did not preempt, with the budget the decodes
and prefill continuations left:

- waiting requests go in ``WaitingQueue`` order (preempted first, then fcfs or lpm; by priority first
  when ``enable_priority_scheduling`` is on) while budget, ``max_running_requests`` and pages allow;
- the prefix cache is matched (``waiting.matchable_ids``: never the whole sequence, and not past the
  prompt logprobs still missing); matched pages are shared, ``num_computed`` starts after them, and
  ``cached_tokens`` keeps the match of the first admission;
- requests of one ``group`` (n > 1) share a prompt: one member (the group's leader) is admitted alone
  until its prompt prefill is done and cached, then the others hit the cache;
- with priority preemption, a request blocked by the slots or the pages may preempt running ones less
  important by more than the threshold (``priority.pick_victims``); they rejoin the queue after the scan;
- a request alone that still finds no room is aborted with a message;
- with LoRA, a request whose adapter would take the batch past ``max_loras_per_batch`` waits
  (``lora_batch.LoRABatchLimit``: passed over, or the scan stops at it once it waited long enough).

``refusal`` is the check at ``Scheduler.add`` (a request that can never run); ``seq_work`` builds the
SeqWork computing a span of a request's tokens.
"""
from __future__ import annotations

from typing import Callable, Optional

from nbgen.core.batch import SeqWork
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.core.finish import FinishReason
from nbgen.core.request import Request, Status
from nbgen.runtime.lora_batch import LoRABatchLimit
from nbgen.runtime.pages import PagePool
from nbgen.runtime.prefix_cache import PrefixCache
from nbgen.runtime.priority import PriorityWaitingQueue, pick_victims, resolve_priority
from nbgen.runtime.waiting import WaitingQueue, matchable_ids, next_prompt_logprob


def refusal(req: Request, cfg: SchedulerConfig, pool: PagePool) -> Optional[str]:
    """Why a request can never run (empty, over the context length or the KV cache, a bad priority), or None."""
    n, ctx, cap = len(req.prompt_ids), cfg.context_length, pool.num_total * cfg.page_size
    if n == 0:
        return "empty prompt: at least one input token is needed"
    if ctx is not None and (n > ctx or (n == ctx and req.params.max_new_tokens != 0)):
        return f"prompt of {n} tokens leaves no room in the context length {ctx}"
    if n > cap:
        return (f"prompt of {n} tokens does not fit in the KV cache ({cap} tokens); "
                "raise max_total_tokens or mem_fraction_static")
    return resolve_priority(req, cfg.priority)


def seq_work(req: Request, start: int, end: int) -> SeqWork:
    """The SeqWork computing tokens [start, end) of req.all_ids (pages already allocated)."""
    n_prompt = len(req.prompt_ids)
    if end - start == 1:                                 # decode: O(1), no all_ids rebuild
        toks = [req.prompt_ids[start] if start < n_prompt else req.output_ids[start - n_prompt]]
    elif end <= n_prompt:
        toks = req.prompt_ids[start:end]
    else:
        toks = req.all_ids[start:end]
    sample = end == req.num_tokens and req.params.max_new_tokens != 0
    pls = next_prompt_logprob(req) if req.wants_prompt_logprobs and start < n_prompt else -1
    return SeqWork(req=req, token_ids=toks, start_pos=start, pages=req.pages, sample=sample,
                   prompt_logprob_start=pls)


class Admission:
    """Admits waiting requests for the Scheduler (loop thread only); owns the n > 1 groups' leaders.

    ``live`` is the Scheduler's rid -> request table (a request aborted here leaves it); ``preempt``
    preempts a running request without requeueing it (priority victims rejoin after the scan)."""

    def __init__(self, cfg: SchedulerConfig, pool: PagePool, cache: PrefixCache,
                 waiting: WaitingQueue | PriorityWaitingQueue, live: dict[str, Request],
                 preempt: Callable[[Request, bool], None], finished_outside: list[Request],
                 lora_limit: Optional[LoRABatchLimit] = None) -> None:
        self.cfg = cfg
        self.lora_limit = lora_limit              # max_loras_per_batch (None without LoRA)
        self.P = cfg.page_size
        self.prio = cfg.priority
        self.pool, self.cache, self.waiting, self.live = pool, cache, waiting, live
        self.preempt = preempt
        self.finished_outside = finished_outside  # the scheduler's: requests refused here are answered from it
        self.leaders: dict[str, Request] = {}     # group -> member prefilling the shared prompt
        self.admit_counter = 0

    def drop_leader(self, req: Request) -> None:
        """req no longer prefills its group's shared prompt (cached, preempted or finished)."""
        if req.group is not None and self.leaders.get(req.group) is req:
            del self.leaders[req.group]

    def admit(self, running: list[Request], budget: int) -> list[SeqWork]:
        """Admit waiting requests into ``running`` within ``budget`` tokens; their SeqWorks."""
        seqs: list[SeqWork] = []
        taken: list[Request] = []                            # leave the waiting queue after the scan
        preempted: list[Request] = []                        # priority victims: join it after the scan
        first_admit = self.admit_counter
        lora_ids = {r.lora_id for r in running} if self.lora_limit is not None else set()
        for req in self.waiting.in_order(self.cache):
            full = len(running) >= self.cfg.max_running_requests
            if budget <= 0 or (full and not self._may_preempt(req, running, first_admit)):
                break
            g = req.group
            if g is not None and not self.cache.disabled and self.leaders.get(g, req) is not req:
                continue                                     # wait for the group's shared prompt
            if self.lora_limit is not None:
                verdict = self.lora_limit.check(req, lora_ids, self.admit_counter)
                if verdict == "stop":
                    break
                if verdict == "skip":
                    continue
            ids = matchable_ids(req)
            pages, m = self.cache.match(ids, ns=req.lora_id)
            self.pool.ref(pages)                             # before alloc: eviction must spare them
            end = min(req.num_tokens, m + budget)
            need = self.pool.pages_for(end) - len(pages)
            new = self.pool.alloc(need)
            if full or (new is None and self.prio.preempts):
                new = self._make_room(req, running, full, need, new, first_admit, preempted)
            if new is None:
                self.pool.unref(pages)
                if running:
                    break                                    # wait for running requests to free pages
                taken.append(req)                            # alone and still no room: never fits
                self.live.pop(req.rid, None)
                req.finish_reason = FinishReason.abort(f"request needs KV cache for {end} tokens but the "
                                                       f"cache holds {self.pool.num_total * self.P}")
                req.status = Status.FINISHED
                self.finished_outside.append(req)
                continue
            taken.append(req)
            req.pages, req.num_computed, req.num_cached_pages = pages + new, m, len(pages)
            if req.admit_seq < 0:                            # first admission only
                req.cached_tokens = m
            req.admit_seq = self.admit_counter
            self.admit_counter += 1
            req.status = Status.RUNNING
            running.append(req)
            lora_ids.add(req.lora_id)
            self.waiting.admitted(req)
            if g is not None and m < (min(len(ids), len(req.prompt_ids)) // self.P) * self.P:
                self.leaders[g] = req                        # its prompt is not cached yet
            seqs.append(seq_work(req, m, end))
            budget -= end - m
        if self.lora_limit is not None:
            self.lora_limit.prune(self.live)
        for req in taken:
            self.waiting.remove(req)
        for req in preempted:
            self.waiting.push_front(req)
        return seqs

    def _may_preempt(self, req: Request, running: list[Request], first_admit: int) -> bool:
        """Whether req may preempt some running request for priority (it is more important)."""
        return self.prio.preempts and pick_victims(req, running, self.prio, self.pool, self.cache,
                                                   True, 0, first_admit) is not None

    def _make_room(self, req: Request, running: list[Request], need_slot: bool, need: int,
                   new: Optional[list[int]], first_admit: int, preempted: list[Request]) -> Optional[list[int]]:
        """Priority preemption for req (a slot when need_slot; ``need`` pages, ``new`` if allocated):
        the pages it gets, or None with nothing preempted. Victims rejoin the queue after the scan."""
        short = 0 if new is not None else need - self.pool.num_free
        victims = pick_victims(req, running, self.prio, self.pool, self.cache, need_slot, short, first_admit)
        if victims is None:
            if new is not None:
                self.pool.unref(new)
            return None
        for v in victims:
            self.preempt(v, False)
            preempted.append(v)
        return new if new is not None else self.pool.alloc(need)
