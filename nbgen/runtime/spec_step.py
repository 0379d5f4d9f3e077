"""SpecStepper: the loop's step when the engine speculates (``speculative_algorithm``; one mode per engine);
chains here, EAGLE trees in runtime/spec_tree_step.py (the same steps with a tree in place of a chain).

Per scheduled batch:

1. every decode seq (one token, past its prompt) gets a draft budget: ``speculative_num_draft_tokens - 1``,
   cut to what ``max_new_tokens`` and the context length leave after the bonus token (``stop``
   strings and ``stop_regex`` are matched token by token on the accepted run, which is cut where
   plain decoding would have stopped: runtime/tracker.py);
2. the drafter (runtime/spec_ngram.py, spec_draft_model.py or spec_eagle.py) proposes up to that many tokens;
   the scheduler lends the pages they need from free pages only (``Scheduler.reserve``: a draft never
   preempts anyone), and drafts without pages are cut;
3. one target forward over the whole batch — prefill chunks, plain decodes and verify seqs
   ``[last, d1 .. dk]`` (chunks starting past their KV: the paged prefill path, causal within the
   chunk) — with logits at every verify position;
4. runtime/spec_verify.py samples each position as plain decoding would and accepts the agreeing
   prefix plus one bonus token;
5. the batch's verify seqs are rewritten to the tokens whose KV stays valid (``[last, accepted..]``),
   and the StepOutput carries the accepted drafts: ``Scheduler.update`` appends them through the
   stop check (a stop inside the run cuts it there) and frees the pages of the rejected tail.

Batches with prompt logprobs, hidden states, grammars or custom
logit processors run as plain steps (no drafts that step). Where the engine has verify CUDA graphs
(runtime/verify_graphs.py), every step whose seqs are all decodes is a verify step of one shape, as
SGLang's: each row padded to ``speculative_num_draft_tokens`` tokens (a row with fewer drafts, or none,
carries padding whose results are ignored), one graph replay. Steps with prefill chunks verify
eagerly; without verify graphs (CPU, graphs off), steps where nothing was drafted run as plain steps on
the decode path. Drafters with ``draft_on_device`` (STANDALONE, EAGLE chains) leave their drafts on the
device (runtime/spec_draft_graphs.py ``PendingDrafts``): a verify graph reads them there, and the host
reads them once, after the verify forward and its logits are queued.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from nbgen.core.batch import ScheduledBatch, SeqWork, StepOutput
from nbgen.core.spec_config import SpecConfig
from nbgen.runtime.embed_step import is_embedding_batch
from nbgen.runtime.loop_stats import LoopStats
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.spec_draft_graphs import PendingDrafts
from nbgen.runtime.spec_pages import reserve_pages
from nbgen.runtime.spec_verify import AcceptRule, longest_agreeing, verify
from nbgen.runtime.step_inputs import flatten
from nbgen.runtime.verify_graphs import VerifyGraphRunner, make_verify_graphs


class Drafter(Protocol):
    """What proposes draft tokens (NGRAM lookup or a draft model)."""

    pages_first: bool     # the drafter writes KV at the draft positions: pages are lent before drafting

    def draft(self, batch: ScheduledBatch, limits: list[int]) -> list[list[int]]:
        """Per seq of ``batch``, up to ``limits[i]`` draft tokens to follow its sequence."""
        ...

    def prune(self) -> None:
        """Forget finished requests."""
        ...


def plain_only(s: SeqWork) -> bool:
    """Seqs whose step must be a plain one: prompt logprobs, hidden states, grammar, custom processors
    (output logprobs come from the verify rows)."""
    req = s.req
    return (s.prompt_logprob_start >= 0 or req.return_hidden_states or req.grammar is not None
            or req.logit_processor is not None)


class SpecStepper:
    """Runs a ScheduledBatch with drafting and verification; rewrites the batch for ``Scheduler.update``."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, spec: SpecConfig, drafter: Drafter,
                 stats: Optional[LoopStats] = None, rule: AcceptRule = longest_agreeing,
                 verify_graphs: Optional[VerifyGraphRunner] = None) -> None:
        """``rule``: the acceptance rule (tests swap in wrong ones to see the statistics catch them);
        ``verify_graphs``: CUDA graphs for steps of verify rows only (runtime/verify_graphs.py)."""
        self.runner, self.scheduler, self.spec, self.drafter = runner, scheduler, spec, drafter
        self.verify_graphs = verify_graphs
        self.stats = stats
        self.rule = rule
        self._steps = 0

    def limits(self, batch: ScheduledBatch, dec: list[bool], most: Optional[int] = None) -> list[int]:
        """Each seq's draft budget, at most ``most`` (default: the drafts per verify; a tree's depth for
        runtime/spec_tree_step.py); 0: not a decode, or no room left for drafts."""
        ctx = self.scheduler.cfg.context_length
        out = []
        for s, d in zip(batch.seqs, dec):
            req = s.req
            if not d:
                out.append(0)
                continue
            k = self.spec.max_drafts if most is None else most
            if req.params.max_new_tokens is not None:
                k = min(k, req.params.max_new_tokens - len(req.output_ids) - 1)
            if ctx is not None:
                k = min(k, ctx - req.num_tokens - 1)
            out.append(max(k, 0))
        return out

    def reserve_drafts(self, batch: ScheduledBatch, want: list[int]) -> list[int]:
        """Pages for each seq's drafts (never preempting): how many drafts each may run."""
        out = []
        for s, k in zip(batch.seqs, want):
            if k:
                k = min(k, reserve_pages(self.scheduler.pool, s.req, s.kv_len + k) - s.kv_len)
            out.append(max(k, 0))
        return out

    def begin(self, batch: ScheduledBatch) -> tuple[list[bool], bool]:
        """Count the step (the drafter forgets finished requests every 64) -> (which seqs are decodes,
        one token past the prompt: the requests' verify steps; whether the step must run plain)."""
        self._steps += 1
        if self._steps % 64 == 0:
            self.drafter.prune()
        dec = [s.sample and s.q_len == 1 and bool(s.req.output_ids) for s in batch.seqs]
        return dec, is_embedding_batch(batch) or any(plain_only(s) for s in batch.seqs)

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> StepOutput:
        """Forward, verify and sample the batch; its verify seqs are rewritten to their accepted tokens."""
        dec, plain = self.begin(batch)
        if plain:
            return self.plain(batch, dec)
        limits = self.limits(batch, dec)
        if self.drafter.pages_first:
            limits = self.reserve_drafts(batch, limits)
        vg = self._current_verify_graphs()
        on_device = getattr(self.drafter, "draft_on_device", None)     # STANDALONE, EAGLE chains
        pending = on_device(batch, limits) if on_device is not None and any(limits) else None
        if pending is not None:
            if self.stats is not None:
                self.stats.publish({"spec_draft_graph_steps": pending.graph_steps})
            if vg is not None and vg.can_run(batch, dec):
                return self._verify(batch, [], dec, vg, pending)     # drafts reach the graph on the device
            drafts = pending.lists()
        else:
            drafts = self.drafter.draft(batch, limits) if any(limits) else [[] for _ in batch.seqs]
        if not self.drafter.pages_first:
            cut = self.reserve_drafts(batch, [len(d) for d in drafts])
            drafts = [d[:k] for d, k in zip(drafts, cut)]
        if vg is not None and vg.can_run(batch, dec):
            return self._verify(batch, drafts, dec, vg)   # a uniform verify step (rows without drafts padded)
        if not any(drafts) and not getattr(self.drafter, "wants_hidden", False):
            return self.plain(batch, dec)
        return self._verify(batch, drafts, dec)

    def plain(self, batch: ScheduledBatch, dec: list[bool]) -> StepOutput:
        """A plain step (no drafts); decode seqs still count as verify steps of their requests."""
        out = self.runner.step(batch)
        if getattr(self.drafter, "wants_hidden", False):
            self.drafter.observe(batch, None, None)     # no features this step (runtime/spec_eagle.py)
        n = len(batch.seqs)
        out.accepted, out.accepted_logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
        self.count(batch, dec, [0] * n, [0] * n)
        return out

    def _verify(self, batch: ScheduledBatch, drafts: list[list[int]], dec: list[bool],
                vg: Optional[VerifyGraphRunner] = None, pending: Optional[PendingDrafts] = None) -> StepOutput:
        """One target forward over the batch with its drafts: the verify graph ``vg`` (every seq a decode row)
        or eagerly. ``pending``: drafts still on the device (with ``vg``), written into its input ids there
        and read on the host once the verify forward is queued."""
        runner = self.runner
        if pending is not None:
            drafts = [[0] * k for k in pending.counts]            # stand-ins until the drafts are read
        for i, d in enumerate(drafts):
            if d:
                s = batch.seqs[i]
                batch.seqs[i] = SeqWork(s.req, s.token_ids + d, s.start_pos, s.pages, True)
        if vg is not None:
            hidden, starts = vg.run(batch, pending.patch(vg.q) if pending is not None else None)  # [bs * q, H]
        else:
            flat = flatten(batch)
            hidden, starts = runner.hidden_states(batch, flat), flat.starts       # [T, H]
        rows: list[int] = []
        seqs: list[SeqWork] = []
        nd: list[int] = []
        for i, s in enumerate(batch.seqs):
            if s.sample:
                end = starts[i] + s.q_len
                rows.extend(range(end - 1 - len(drafts[i]), end))
                seqs.append(s)
                nd.append(len(drafts[i]))
        if vg is not None:
            logits = vg.logits(hidden, rows)                                       # [R, V]
            if self.stats is not None:
                self.stats.publish({"spec_verify_graph_steps": vg.replays})
        else:
            logits = runner.logits(hidden, rows)                                   # [R, V]
        if pending is not None:             # the one host read of the drafts, behind the queued verify
            drafts = pending.lists()
            for i, d in enumerate(drafts):
                if d:
                    s = batch.seqs[i]
                    batch.seqs[i] = SeqWork(s.req, s.token_ids[: s.q_len - len(d)] + d, s.start_pos, s.pages, True)
            seqs = [s for s in batch.seqs if s.sample]
        res = iter(verify(runner.sampler, logits, seqs, nd, self.rule))
        n = len(batch.seqs)
        out = StepOutput(next_token_ids=[-1] * n, output_logprobs=[None] * n, prompt_logprobs=[None] * n,
                         accepted=[[] for _ in range(n)], accepted_logprobs=[[] for _ in range(n)])
        acc = [0] * n
        for i, s in enumerate(batch.seqs):
            if not s.sample:
                continue
            v = next(res)
            out.next_token_ids[i], out.output_logprobs[i] = v.token, v.logprob
            out.accepted[i], out.accepted_logprobs[i] = v.accepted, v.accepted_logprobs
            acc[i] = len(v.accepted)
            if v.error is not None:
                out.errors[i] = v.error
            if drafts[i]:        # KV stays valid for [last, accepted drafts]: the rest is released
                batch.seqs[i] = SeqWork(s.req, s.token_ids[: s.q_len - len(drafts[i]) + acc[i]], s.start_pos,
                                        s.pages, True)
        if getattr(self.drafter, "wants_hidden", False):      # EAGLE: the kept tokens' features
            self.drafter.observe(batch, starts, hidden)
        self.count(batch, dec, [len(d) for d in drafts], acc)
        return out

    def _current_verify_graphs(self) -> Optional[VerifyGraphRunner]:
        """The verify graphs, captured again when the runner recaptured its own (memory release)."""
        vg = self.verify_graphs
        if vg is not None and vg.stale and self.runner.graphs is not None:
            vg.release()
            vg = self.verify_graphs = make_verify_graphs(self.runner, vg.q)
        return vg

    def count(self, batch: ScheduledBatch, dec: list[bool], proposed: list[int], accepted: list[int]) -> None:
        """Per-request counters (meta_info) and the engine's totals (stats, dashboard)."""
        steps = toks = drafted = hits = 0
        for s, d, k, a in zip(batch.seqs, dec, proposed, accepted):
            if not d:
                continue                        # a prefill chunk, not a decode step
            req = s.req
            req.spec_verify_ct += 1
            req.spec_proposed += k
            req.spec_accepted += a
            if len(req.spec_histogram) <= a:
                req.spec_histogram.extend([0] * (a + 1 - len(req.spec_histogram)))
            req.spec_histogram[a] += 1
            steps, toks, drafted, hits = steps + 1, toks + a + 1, drafted + k, hits + a
        if self.stats is not None and steps:
            self.stats.spec_step(steps, toks, drafted, hits)
