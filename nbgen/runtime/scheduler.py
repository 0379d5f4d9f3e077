"""Scheduler: continuous batching with chunked prefill, a paged KV cache and prefix sharing (no torch).

Each step ``schedule()`` builds one ScheduledBatch; ``update()`` applies the runner's StepOutput;
requests join and leave at every step. A step is built in this order:

1. **Decodes**: each running request with one token left to compute gets it (oldest first). They
   count against the token budget (``chunked_prefill_size``) but are never held back by it.
2. **Prefill continuation**: requests mid-prefill get the next chunk of what the budget leaves.
3. **Admission** (not in a step that preempted; runtime/admission.py): waiting requests in queue
   order while budget, ``max_running_requests`` and pages allow, prefix-cache hits shared.
4. **Pages**: a request gets the pages its new tokens need before the step. When the pool (after
   evicting unreferenced cached pages) runs dry, the most recently admitted running request is
   preempted: its computed full pages go into the prefix cache, its pages are released, and it
   returns to the front of the queue to recompute prompt + output later. A request that cannot
   fit even alone is aborted with a message: never a spin, never a silent drop.
5. **n > 1**: requests of one ``group`` share a prompt: one member is admitted alone until its
   prompt prefill is done and cached, then the others hit the cache.
6. **Embedding requests** (``max_new_tokens=0``, ``req.embed``): prefill only; the chunk completing
   the prompt stores the vector and finishes them (mean / CLS pooling take no cached pages).
7. **Priority** (``enable_priority_scheduling``, runtime/priority.py): the queue is ordered by
   priority, then as above; a request blocked by the slots or the pages may preempt running ones
   less important by more than the threshold (they rejoin the queue after the scan), and running dry
   at step 4 preempts the least important request instead of the newest.

Full pages enter the prefix cache when a prefill (or recompute) completes, at finish, at
preemption and at abort (runner errors excepted); ``on_finish`` then hears the finished request
(an engine session pins its sequence). Decodes cost O(1) Python each per step.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.finish import FinishReason
from nbgen.runtime.admission import Admission, refusal, seq_work
from nbgen.runtime.forced_rows import RowWaits, forced_rows
from nbgen.runtime.lora_batch import LoRABatchLimit
from nbgen.runtime.pages import PagePool
from nbgen.runtime.prefill_pacing import PrefillPacer
from nbgen.runtime.prefix_cache import PrefixCache
from nbgen.runtime.step_update import StepUpdate
from nbgen.runtime.priority import PriorityWaitingQueue, grow_victim, priority_stats, queue_full_victim
from nbgen.core.request import Request, Status
from nbgen.runtime.waiting import WaitingQueue


class Scheduler(StepUpdate):
    """Owns waiting/running requests, the PagePool and the PrefixCache (loop thread only); ``update``
    (runtime/step_update.py) applies a step's results."""

    def __init__(self, cfg: SchedulerConfig, lora_limit: Optional[LoRABatchLimit] = None) -> None:
        self.cfg = cfg
        self.P = cfg.page_size
        self.pool = PagePool(cfg.num_pages, cfg.page_size)
        self.cache = PrefixCache(self.pool, disabled=cfg.disable_radix_cache)
        cps = cfg.chunked_prefill_size
        self.budget = cps if cps is not None and cps > 0 else sys.maxsize
        self.pacer = PrefillPacer(cfg.prefill_pacing_min_tokens) if cfg.prefill_pacing_min_tokens else None
        self.running: list[Request] = []              # admission order (last = newest)
        self.prio = cfg.priority                      # priority scheduling (runtime/priority.py)
        self.waiting: WaitingQueue | PriorityWaitingQueue = (
            PriorityWaitingQueue(cfg.schedule_policy, cfg.priority) if cfg.priority.enable_priority_scheduling
            else WaitingQueue(cfg.schedule_policy))
        self._arrival_counter = 0
        self._live: dict[str, Request] = {}           # rid -> waiting or running request
        # requests finished since the loop last looked (refused, aborted, stopped by a stop string,
        # never fitting; those of update() too): the loop answers the ones a step's changed list did
        # not carry from here instead of scanning every tracked request
        self._finished_outside: list[Request] = []
        self.admission = Admission(cfg, self.pool, self.cache, self.waiting, self._live, self._preempt,
                                   self._finished_outside, lora_limit)
        self.num_preemptions = 0
        self.row_waits = RowWaits()                   # jump-forward tokens waiting a step for rows
        # called with each request finished after it ran (its full pages are in the prefix cache);
        # engine sessions pin them there (runtime/sessions.py), and drop the pins at a flush
        self.on_finish: Optional[Callable[[Request], None]] = None
        self.on_flush: Optional[Callable[[], None]] = None

    # ---- requests in and out --------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request; one that can never run is finished at once with an abort reason."""
        if req.rid in self._live:
            raise ValueError(f"request id {req.rid!r} is already queued or running")
        msg = refusal(req, self.cfg, self.pool)
        if msg is not None:
            req.finish_reason, req.status = FinishReason.abort(msg), Status.FINISHED
            self._finished_outside.append(req)
            return
        if self._refused_by_full_queue(req):
            return
        req.status = Status.WAITING
        req.end_len = req.length_limit(self.cfg.context_length)
        req.arrival_seq, self._arrival_counter = self._arrival_counter, self._arrival_counter + 1
        self._live[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str, message: str = "aborted") -> Optional[Request]:
        """Abort a waiting or running request (its pages are freed); None if unknown or finished."""
        req = self._live.get(rid)
        if req is None:
            return None
        self.finish(req, FinishReason.abort(message))
        return req

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Finish a request from outside (e.g. a stop string matched): free pages, keep KV cached."""
        if req.finished:
            req.finish_reason = reason
        elif req.status is Status.RUNNING:
            self._finish(req, reason)
        else:
            self.waiting.remove(req)
            self._live.pop(req.rid, None)
            req.finish_reason, req.status = reason, Status.FINISHED
            self._finished_outside.append(req)

    def _refused_by_full_queue(self, req: Request) -> bool:
        """SGLang's ``max_queued_requests`` (``priority.queue_full_victim``); True when ``req`` was aborted."""
        hit = queue_full_victim(self.waiting, req, self.cfg.max_queued_requests, self.prio)
        if hit is None:
            return False
        victim, msg = hit
        if victim is not req:
            self.finish(victim, FinishReason.abort(msg))
            return False
        req.finish_reason, req.status = FinishReason.abort(msg), Status.FINISHED
        self._finished_outside.append(req)
        return True

    def take_finished_outside(self) -> list[Request]:
        """The requests finished since the last call (see ``__init__``)."""
        done, self._finished_outside[:] = list(self._finished_outside), []
        return done

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def flush_cache(self) -> bool:
        """Drop the prefix cache (sessions' pins too: ``on_flush``); refused (False) while requests
        run, as SGLang."""
        if self.running:
            return False
        if self.on_flush is not None:
            self.on_flush()
        return self.cache.flush()

    def stats(self) -> dict[str, Any]:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "pages_used": self.pool.num_used, "pages_total": self.pool.num_total,
                "pages_free": self.pool.num_free, "page_size": self.P,
                "prefix_cache_pages": self.cache.num_cached_pages,
                "num_preemptions": self.num_preemptions,
                "priorities": (priority_stats(self.running, self.waiting)
                               if isinstance(self.waiting, PriorityWaitingQueue) else {})}

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduledBatch]:
        """Pick this step's work (decodes, prefill chunks, admissions); None when nothing can run."""
        budget = self.pacer.budget(self.running, self.waiting.in_order(self.cache), self.budget) \
            if self.pacer is not None and self.waiting else self.budget      # runtime/prefill_pacing.py
        seqs: list[SeqWork] = []
        # running requests with tokens left to compute (step 2), each with the decode rows before it
        prefilling: list[tuple[Request, int]] = []
        preempted = self.num_preemptions
        P, RUNNING = self.P, Status.RUNNING
        for req in list(self.running):                       # 1. decodes (hot path: O(1) each)
            if req.status is not RUNNING:
                continue
            out_ids, c = req.output_ids, req.num_computed
            left = len(req.prompt_ids) + len(out_ids) - c
            if left != 1:
                if left > 1:
                    prefilling.append((req, len(seqs)))
                continue
            if c // P >= len(req.pages) and not self._grow(req, c + 1):
                continue
            if out_ids:                                      # only sampling requests have outputs
                seqs.append(SeqWork(req, [out_ids[-1]], c, req.pages, True))
            else:                                            # last prompt token (rare)
                seqs.append(seq_work(req, c, c + 1))
        budget -= len(seqs)
        rows = self.cfg.forced_token_rows - len(seqs)         # jump-forward rows (runtime/forced_rows.py)
        self.row_waits.next_step()
        taken = len(seqs)
        chunks: list[SeqWork] = []
        forced: list[tuple[int, list[SeqWork]]] = []        # a jump's rows and the decode rows before them
        for req, at in prefilling:                           # 2. prefill continuation (running order)
            left = len(req.prompt_ids) + len(req.output_ids) - req.num_computed
            if left <= 1 or req.status is not RUNNING:
                continue
            if budget <= 0:
                break
            end = req.num_computed + min(left, budget)
            if self._grow(req, end):
                split = forced_rows(req, req.num_computed, end, rows) if rows > 0 else None
                if not split and self.row_waits.wait(req, req.num_computed, end, self.cfg.forced_token_rows, taken):
                    continue                                 # rows next step instead of a chunk now
                if split:
                    forced.append((at, split))
                else:
                    chunks.append(seq_work(req, req.num_computed, end))
                taken += len(split) if split else 1
                rows -= len(split) if split else 1
                budget -= end - req.num_computed
        if forced:                       # one-token rows in running order: the sampling rows keep their order
            seqs = _merge_rows(seqs, forced)                # from step to step (runtime/decode_staging.py)
        seqs += chunks
        # 3. admissions; not in a step that preempted (damps admit/preempt thrashing)
        if self.num_preemptions == preempted:
            seqs += self.admission.admit(self.running, budget)
        if self.num_preemptions != preempted:                # drop the seqs of preempted requests
            seqs = [s for s in seqs if s.req.status is RUNNING and s.pages is s.req.pages]
        return ScheduledBatch(seqs=seqs, page_size=self.P) if seqs else None

    # ---- internals --------------------------------------------------------------------------------
    def _grow(self, req: Request, kv_len: int) -> bool:
        """Give req pages for kv_len tokens, preempting newer requests; False if req itself left."""
        need = self.pool.pages_for(kv_len) - len(req.pages)
        while need > 0:
            new = self.pool.alloc(need)
            if new is not None:
                req.pages.extend(new)
                return True
            victim = grow_victim(self.running, self.prio) if self.prio.enable_priority_scheduling else self.running[-1]
            if victim is req and len(self.running) == 1:
                cap = self.pool.num_total * self.P
                self._finish(req, FinishReason.abort(
                    f"request needs KV cache for {kv_len} tokens but the cache "
                    f"holds {cap}; raise max_total_tokens or mem_fraction_static"))
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, requeue: bool = True) -> None:
        self._release(req, cache=True)
        self.running.remove(req)
        req.num_computed = 0
        req.status = Status.WAITING
        if requeue:
            self.waiting.push_front(req)
        self.num_preemptions += 1
        req.num_retractions += 1

    def _release(self, req: Request, cache: bool) -> None:
        if cache:
            self.cache.insert_request(req, swap=False)
        self.pool.unref(req.pages)
        req.pages = []               # a new list: stale SeqWorks keep the old one (see schedule)
        req.num_cached_pages = 0
        self.admission.drop_leader(req)

    def _finish(self, req: Request, reason: FinishReason, cache: bool = True, unlist: bool = True) -> None:
        self._release(req, cache)
        req.finish_reason, req.status = reason, Status.FINISHED
        self._finished_outside.append(req)   # also from update(): its changed list answers them first
        self._live.pop(req.rid, None)
        if unlist:
            self.running.remove(req)
        if self.on_finish is not None:
            self.on_finish(req)


def _merge_rows(decodes: list[SeqWork], forced: list[tuple[int, list[SeqWork]]]) -> list[SeqWork]:
    """The decode rows with each jump's rows put after the ``at`` decode rows before its request."""
    out: list[SeqWork] = []
    prev = 0
    for at, rows in forced:
        out += decodes[prev:at]
        out += rows
        prev = at
    out += decodes[prev:]
    return out
