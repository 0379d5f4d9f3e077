"""Scheduler.update: a step's results applied to its requests (the Scheduler's base class; no torch).

Each row of the step: its computed tokens counted, the sampled token appended (a placeholder under
overlap scheduling, runtime/overlap.py), logprobs, hidden states and pooling states recorded, a
completed prompt put in the prefix cache, verified drafts accepted (runtime/spec_pages.py), and the
stop check (``Request.end_after``) asked where it may end the request: at a stop id or from its
length limit (``Request.end_len``) on. A decode row of a step without errors, drafts, pooling or
hidden states takes a short path; constrained rows' tokens are accepted together after the walk.
Rows of requests aborted, preempted or jumped forward meanwhile are skipped.
"""
from __future__ import annotations

from nbgen.core.batch import ScheduledBatch, StepOutput
from nbgen.core.finish import FinishReason
from nbgen.core.request import Request, Status
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.runtime.admission import Admission
from nbgen.runtime.grammar_batch import StepGrammar
from nbgen.runtime.pages import PagePool
from nbgen.runtime.prefix_cache import PrefixCache
from nbgen.runtime.spec_pages import accept_drafts, release_tail


class StepUpdate:
    """``update`` for the Scheduler, over its state (declared here, set by the Scheduler)."""

    cfg: SchedulerConfig
    pool: PagePool
    cache: PrefixCache
    admission: Admission
    running: list[Request]

    def _finish(self, req: Request, reason: FinishReason, cache: bool = True, unlist: bool = True) -> None:
        """End a running request: pages freed (full ones cached unless ``cache`` is False), listed
        as finished; ``unlist``: also take it out of ``running`` (the Scheduler's)."""
        raise NotImplementedError

    def update(self, batch: ScheduledBatch, out: StepOutput) -> list[Request]:
        """Apply a step's results; returns requests that got a new token or finished this step."""
        changed: list[Request] = []
        done, errors, ctx = False, out.errors, self.cfg.context_length
        grammar = StepGrammar()          # constrained rows' tokens (runtime/grammar_batch.py)
        # a step without errors, drafts, pooling or hidden states: its decode rows take the short path
        plain = not errors and out.accepted is None and out.pool_states is None and out.hidden_states is None
        toks, lps, RUNNING = out.next_token_ids, out.output_logprobs, Status.RUNNING
        with_lps = lps.count(None) != len(lps)       # output logprobs in this step (none under overlap's apply)
        for i, seq in enumerate(batch.seqs):
            req, start = seq.req, seq.start_pos
            if req.status is not RUNNING or req.num_computed != start:
                continue                                     # aborted or preempted meanwhile
            n_prompt = len(req.prompt_ids)
            if plain and seq.sample and start >= n_prompt and len(seq.token_ids) == 1:   # a decode row (hot)
                out_ids = req.output_ids
                if start != n_prompt + len(out_ids) - 1:
                    continue                                 # jumped forward meanwhile
                req.num_computed = start + 1
                tok = toks[i]
                out_ids.append(tok)
                if with_lps and lps[i] is not None:
                    req.add_output_logprob(lps[i])
                changed.append(req)
                n_out = len(out_ids)          # end_after is asked only where it may end the request
                reason = req.end_after(tok, n_out, ctx) if n_out >= req.end_len or tok in req.stop_ids else None
                if req.grammar is not None and tok >= 0:
                    grammar.add(req, tok, reason)            # accepted after the walk, all in one call
                elif reason is not None:
                    self._finish(req, reason, unlist=False)
                    done = True
                continue
            if plain and start >= n_prompt and len(seq.token_ids) == 1 and not seq.sample:
                req.num_computed = start + 1                 # a jump-forward's forced token (runtime/forced_rows.py)
                continue
            if out.accepted is None and seq.sample and start + len(seq.token_ids) != req.num_tokens:
                continue            # jumped forward meanwhile (runtime/jump_forward.py); verify rows carry drafts
            if errors and i in errors:
                self._finish(req, FinishReason.abort(errors[i]), cache=False, unlist=False)
                changed.append(req)
                done = True
                continue
            kv = start + len(seq.token_ids)
            if out.pool_states is not None:                  # embedding requests (runtime/embed_step.py)
                req.set_pooled(out.pool_states[i], out.embeddings[i] if out.embeddings is not None else None)
            if seq.start_pos < n_prompt and req.wants_prompt_logprobs:
                req.add_prompt_logprobs(out.prompt_logprobs[i] if seq.prompt_logprob_start >= 0 else None,
                                        kv >= n_prompt)
            req.num_computed = kv
            if out.hidden_states is not None and out.hidden_states[i] is not None:
                hs = out.hidden_states[i]                    # prompt positions of a chunk, a sampled position's
                req.add_hidden_states(hs.first, hs.rows)
            drafted = out.accepted is not None and bool(out.accepted[i])   # verified drafts (spec_step.py)
            if seq.start_pos < n_prompt <= kv or (seq.sample and len(seq.token_ids) > 1 and not drafted):
                self.cache.insert_request(req, swap=True)            # share the prompt with later arrivals
                self.admission.drop_leader(req)
            reason = None
            if drafted:
                reason = accept_drafts(req, out.accepted[i], out.accepted_logprobs[i], self.cfg.context_length)
                if reason is not None:
                    changed.append(req)
            if seq.sample and reason is None:
                tok = out.next_token_ids[i]
                req.output_ids.append(tok)
                lp = out.output_logprobs[i]
                if lp is not None:
                    req.add_output_logprob(lp)
                reason = req.end_after(tok, len(req.output_ids), ctx)
                changed.append(req)
                if req.grammar is not None and tok >= 0:     # accepted after the walk, all in one call
                    grammar.add(req, tok, reason)
                    continue
            elif req.params.max_new_tokens == 0 and kv >= req.num_tokens:
                reason = FinishReason.length()
                changed.append(req)
            if reason is not None:
                self._finish(req, reason, unlist=False)
                done = True
            elif out.accepted is not None:
                release_tail(self.pool, req)
        for req, reason in grammar.settle(self.cfg.context_length):
            self._finish(req, reason, unlist=False)
            done = True
        if done:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return changed
