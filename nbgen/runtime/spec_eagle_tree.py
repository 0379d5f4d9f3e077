"""EAGLE / EAGLE3 tree drafts (``speculative_eagle_topk = k > 1``), as SGLang's EAGLE worker grows them.

From the head's output for the last sampled token (runtime/spec_eagle.py ``catch_up``), its k most
likely tokens are the root's children, scored by their draft probability. Each further step (up
to ``speculative_num_steps`` levels) runs the k leaves of the previous level through the head in one
call — each row attending to the committed draft rows and its own ancestors — and of their k * k
children (score: the parent's score times the child's probability) keeps the k best as the next
leaves (SGLang's ``select_top_k_tokens``). Every child made is a candidate; the
``speculative_num_draft_tokens - 1`` best candidates form the tree that is verified
(runtime/spec_tree.py ``select_nodes``, SGLang's ``organize_draft_results``). The rows the tree adds
to the head's cache are dropped afterwards (recomputed from the target's features).
"""
from __future__ import annotations

import torch

from nbgen.core.batch import ScheduledBatch
from nbgen.models.eagle import DraftCache, EagleDraft
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.spec_eagle import EagleDrafter
from nbgen.runtime.spec_tree import DraftTree, select_nodes


class EagleTreeDrafter(EagleDrafter):
    """An EagleDrafter proposing draft trees (``draft_trees``) for runtime/spec_tree_step.py."""

    def __init__(self, target: ModelRunner, head: EagleDraft, steps: int, topk: int, num_nodes: int) -> None:
        super().__init__(target, head, steps)
        self.topk, self.num_nodes = topk, num_nodes

    @torch.inference_mode()
    def draft_trees(self, batch: ScheduledBatch, depths: list[int]) -> list[DraftTree]:
        """Per seq, a draft tree at most ``depths[i]`` levels deep (empty: no draft)."""
        out = [DraftTree([], []) for _ in batch.seqs]
        for i, (s, d) in enumerate(zip(batch.seqs, depths)):
            got = self.catch_up(s) if d else None
            if got is None:
                continue
            cache, h, q = got
            committed = cache.length
            out[i] = self._grow(cache, h, q, min(d, self.steps))
            cache.truncate(committed)
        return out

    def _grow(self, cache: DraftCache, h0: torch.Tensor, q: int, levels: int) -> DraftTree:
        """The tree below the root from the head's root output ``h0`` [1, H]; level-1 rows sit at position q."""
        k, dev, lm = self.topk, self.target.device, self.target.model.compute_logits
        p, t = self.head.topk(h0, lm, k)                                   # [1, k]
        scores = p[0]                                                      # [k] fp32 scores of the leaves
        cand_scores, cand_tokens, cand_parents = p[0].tolist(), t[0].tolist(), [-1] * k
        leaves = list(range(k))                                            # candidate index of each leaf
        hid = h0.expand(k, -1)                                             # [k, H] the leaves' hidden inputs
        row: dict[int, int] = {}                                           # candidate -> its head cache row
        committed = cache.length
        for level in range(1, levels):
            n0 = cache.length
            mask = torch.zeros(k, n0 + k, dtype=torch.bool)
            mask[:, :committed] = True
            for a, c in enumerate(leaves):
                x = cand_parents[c]
                while x >= 0:
                    mask[a, row[x]] = True
                    x = cand_parents[x]
                mask[a, n0 + a] = True
            ids = torch.tensor([cand_tokens[c] for c in leaves], device=dev)
            pos = torch.full((k,), q + level - 1, device=dev)
            out = self.head.step(ids, hid, pos, cache, mask.to(dev))       # [k, H]
            for a, c in enumerate(leaves):
                row[c] = n0 + a
            p, t = self.head.topk(out, lm, k)                              # [k, k] per leaf
            expand = (scores[:, None] * p).reshape(-1)                     # [k * k] children's scores
            base = len(cand_scores)
            cand_scores += expand.tolist()
            cand_tokens += t.reshape(-1).tolist()
            cand_parents += [c for c in leaves for _ in range(k)]
            vals = expand.tolist()
            best = sorted(range(k * k), key=lambda j: (-vals[j], j))[:k]  # the next leaves
            leaves = [base + j for j in best]
            scores = expand[best]
            hid = out[[j // k for j in best]]
        return select_nodes(cand_scores, cand_tokens, cand_parents, self.num_nodes)
