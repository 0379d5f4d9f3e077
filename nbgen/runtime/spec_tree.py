"""Draft trees (EAGLE with ``speculative_eagle_topk > 1``): the tree's shape, choosing its nodes from
the drafter's candidates, and verifying it against the target's tokens.

A tree hangs below the root, the request's last sampled token; node j has a token and a parent
(-1: the root), parents before children. The verify chunk is ``[root, node 0, node 1, ..]`` with
``SeqWork.tree_parents`` (attention: each token sees the prefix and its ancestors; position =
depth), so chunk row j + 1 holds the target's distribution after the path root .. node j.

Acceptance: every row is sampled exactly as plain decoding samples that position after that path
(penalties over the path, ``min_new_tokens``, the seeded noise of its output index:
runtime/sampler.py), giving the target token t(row). From the root, the walk moves to the child
whose token equals t(current row), while there is one; t(last row of the walk) is the bonus token.
Every emitted token is then the token plain decoding draws at that position from the same prefix,
so the output is distribution-identical to plain decoding (and, with a seed, the same tokens).
For point-mass drafts this is the multi-candidate rejection rule: trying children c1, c2, .. in
turn, accepting c with probability p(c) / m (m: mass left) and else removing it, accepts child c
with total probability p(c) and otherwise draws from p without the children; drawing t ~ p and
descending into the child equal to t makes the same choices with the same probabilities. Greedy
(temperature 0) is the argmax walk: the longest root-to-leaf path agreeing with the target.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from nbgen.core.batch import SeqWork
from nbgen.runtime.sampler import Sampler
from nbgen.runtime.spec_verify import Verified, uses_output


@dataclass
class DraftTree:
    """A request's draft tree: node tokens (target vocabulary) and parents (-1: the root), parents first."""

    tokens: list[int]
    parents: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> "DraftTree":
        """The first ``n`` nodes (still a tree: parents come before their children)."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def chunk_parents(self) -> list[int]:
        """``SeqWork.tree_parents`` of the verify chunk ``[root, nodes ..]``."""
        return [-1] + [p + 1 for p in self.parents]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (-1: the root itself, an empty path)."""
        out: list[int] = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def chain(tokens: list[int]) -> DraftTree:
    """A chain as a tree (each node the child of the one before)."""
    return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)))


def select_nodes(scores: list[float], tokens: list[int], parents: list[int], n: int) -> DraftTree:
    """The ``n`` best candidates by score as a tree (SGLang's ``organize_draft_results``).

    Candidates are in creation order, a candidate's parent (an index into them, -1: the root) before
    it; a child's score is its parent's times a probability, so it is never above its parent's and
    ties go to the earlier candidate: the chosen set holds every chosen node's parent.
    """
    keep = sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n])
    where: dict[int, int] = {}
    out_tok, out_par = [], []
    for c in keep:
        p = parents[c]
        if p >= 0 and p not in where:       # unreachable by the argument above; kept safe
            continue
        where[c] = len(out_tok)
        out_tok.append(tokens[c])
        out_par.append(where[p] if p >= 0 else -1)
    return DraftTree(out_tok, out_par)


def row_seqs(seq: SeqWork, tree: DraftTree) -> list[SeqWork]:
    """The ``len(tree) + 1`` row views of a tree verify seq ``[.., root, nodes ..]`` (an empty tree:
    the seq itself): row 0 samples after the root, row j + 1 after the path to node j (its output index and, for penalties, its tokens)."""
    if not len(tree):
        return [seq]
    req, pre = seq.req, seq.token_ids[: seq.q_len - len(tree)]
    out = [SeqWork(req, pre, seq.start_pos, seq.pages, True)]
    for j in range(len(tree)):
        path = [tree.tokens[x] for x in tree.path(j)]
        r = dataclasses.replace(req, output_ids=req.output_ids + path) if uses_output(req) else req
        out.append(SeqWork(r, pre + path, seq.start_pos, seq.pages, True))
    return out


def walk(tree: DraftTree, targets: list[int]) -> list[int]:
    """The accepted nodes: from the root, the child whose token is the target's token at the current
    row (``targets[0]`` after the root, ``targets[j + 1]`` after node j), while there is one."""
    children: dict[int, list[int]] = {}
    for j, p in enumerate(tree.parents):
        children.setdefault(p, []).append(j)
    path, node = [], -1
    while True:
        t = targets[node + 1]
        nxt = next((c for c in children.get(node, ()) if tree.tokens[c] == t), None)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


# (tree, target tokens per row) -> the accepted nodes, a root-to-node path
TreeRule = Callable[[DraftTree, list[int]], list[int]]


def verify_trees(sampler: Sampler, logits: torch.Tensor, seqs: list[SeqWork], trees: list[DraftTree],
                 rule: TreeRule = walk) -> list[tuple[Verified, list[int]]]:
    """Sample every row of ``logits`` [R, V] (seq i owns ``len(trees[i]) + 1`` consecutive rows) and
    walk each tree by ``rule`` (tests swap in wrong ones): (the result, the accepted node indices)."""
    rows: list[SeqWork] = []
    for s, t in zip(seqs, trees):
        rows.extend(row_seqs(s, t))
    res = sampler(logits, rows)
    toks = res.token_ids.tolist()
    out: list[tuple[Verified, list[int]]] = []
    r0 = 0
    for t in trees:
        tt = toks[r0: r0 + len(t) + 1]
        path = rule(t, tt)
        used = [r0] + [r0 + j + 1 for j in path]             # the rows of the root and the accepted nodes
        err = next((res.errors[r] for r in used if r in res.errors), None)
        lps = [res.logprobs[r] for r in used]
        last = path[-1] + 1 if path else 0
        out.append((Verified([t.tokens[j] for j in path], lps[:-1], tt[last], lps[-1], err), path))
        r0 += len(t) + 1
    return out
