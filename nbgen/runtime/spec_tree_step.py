"""TreeSpecStepper: the speculative step with draft trees (EAGLE / EAGLE3, ``speculative_eagle_topk > 1``).

As SpecStepper (runtime/spec_step.py), with a tree in place of a chain:

1. every decode seq's budget is a depth (``speculative_num_steps``, cut to what ``max_new_tokens``
   and the context length leave after the bonus token); the drafter grows a tree of at most
   ``speculative_num_draft_tokens - 1`` nodes that deep (runtime/spec_eagle_tree.py); the scheduler
   lends pages for its nodes from free pages only, and a tree without pages for all is cut to the
   first nodes that have them (still a tree);
2. one target forward verifies ``[root, nodes ..]`` written at consecutive slots, each token seeing
   the prefix and its ancestors at position start_pos + depth (``SeqWork.tree_parents``);
3. runtime/spec_tree.py samples every row as plain decoding would and walks the tree;
4. the accepted nodes' KV is copied to the slots right after the root (``copy_slots``), so the kept
   tokens lie in order as after a chain step; the seq is rewritten to ``[root, accepted ..]`` and
   ``Scheduler.update`` appends them and frees the pages past them (runtime/spec_pages.py); the
   drafter gets the kept tokens' features in that order.
"""
from __future__ import annotations

from typing import Optional

import torch

from nbgen.core.batch import ScheduledBatch, SeqWork, StepOutput
from nbgen.core.spec_config import SpecConfig
from nbgen.runtime.loop_stats import LoopStats
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.spec_eagle_tree import EagleTreeDrafter
from nbgen.runtime.spec_step import SpecStepper
from nbgen.runtime.spec_tree import DraftTree, verify_trees
from nbgen.runtime.step_inputs import flatten


def slot(s: SeqWork, pos: int, page_size: int) -> int:
    """The flat cache slot of position ``pos`` of ``s``'s request."""
    return s.pages[pos // page_size] * page_size + pos % page_size


class TreeSpecStepper(SpecStepper):
    """Runs a ScheduledBatch with draft trees and tree verification; rewrites the batch for ``Scheduler.update``."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, spec: SpecConfig, drafter: EagleTreeDrafter,
                 stats: Optional[LoopStats] = None) -> None:
        super().__init__(runner, scheduler, spec, drafter, stats)
        self.trees = drafter

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> StepOutput:
        """Forward, verify and sample the batch; its verify seqs are rewritten to their accepted tokens."""
        dec, plain = self.begin(batch)
        if plain:
            return self.plain(batch, dec)
        depths = self.limits(batch, dec, self.spec.num_steps)
        trees = self.trees.draft_trees(batch, depths) if any(depths) else [DraftTree([], []) for _ in batch.seqs]
        cut = self.reserve_drafts(batch, [len(t) for t in trees])
        return self._verify_trees(batch, [t.cut(k) for t, k in zip(trees, cut)], dec)

    def _verify_trees(self, batch: ScheduledBatch, trees: list[DraftTree], dec: list[bool]) -> StepOutput:
        runner, P = self.runner, batch.page_size
        for i, t in enumerate(trees):
            if len(t):
                s = batch.seqs[i]                  # a decode seq: its one token is the root
                batch.seqs[i] = SeqWork(s.req, s.token_ids + t.tokens, s.start_pos, s.pages, True,
                                        tree_parents=t.chunk_parents())
        flat = flatten(batch)
        rows: list[int] = []
        seqs: list[SeqWork] = []
        sampled: list[DraftTree] = []
        for i, s in enumerate(batch.seqs):
            if s.sample:
                root = flat.starts[i] + s.q_len - 1 - len(trees[i])       # the row of the last sampled token
                rows.extend(range(root, root + len(trees[i]) + 1))
                seqs.append(s)
                sampled.append(trees[i])
        hidden = runner.hidden_states(batch, flat)                                 # [T, H]
        logits = runner.logits(hidden, rows)                                       # [R, V]
        res = iter(verify_trees(runner.sampler, logits, seqs, sampled))
        n = len(batch.seqs)
        out = StepOutput(next_token_ids=[-1] * n, output_logprobs=[None] * n, prompt_logprobs=[None] * n,
                         accepted=[[] for _ in range(n)], accepted_logprobs=[[] for _ in range(n)])
        acc = [0] * n
        src: list[int] = []
        dst: list[int] = []
        order: list[int] = []
        for i, s in enumerate(batch.seqs):
            if not s.sample:
                continue
            v, path = next(res)
            out.next_token_ids[i], out.output_logprobs[i] = v.token, v.logprob
            out.accepted[i], out.accepted_logprobs[i] = v.accepted, v.accepted_logprobs
            acc[i] = len(v.accepted)
            if v.error is not None:
                out.errors[i] = v.error
            if not len(trees[i]):
                continue
            root = 0                                              # the chunk's first token (a decode seq)
            for x, j in enumerate(path):                          # node j's KV and features to chunk row root+1+x
                if j != x:
                    if not order:
                        order = list(range(len(flat.ids)))
                    src.append(slot(s, s.start_pos + root + 1 + j, P))
                    dst.append(slot(s, s.start_pos + root + 1 + x, P))
                    order[flat.starts[i] + root + 1 + x] = flat.starts[i] + root + 1 + j
            # KV stays valid for [.., root, accepted ..]: the rest is released
            batch.seqs[i] = SeqWork(s.req, s.token_ids[: root + 1] + v.accepted, s.start_pos, s.pages, True)
        if src:
            runner.backend.copy_slots(runner.to_device(src), runner.to_device(dst))
        self.trees.observe(batch, flat.starts, hidden, runner.to_device(order) if order else None)
        self.count(batch, dec, [len(t) for t in trees], acc)
        return out
