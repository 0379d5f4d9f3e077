"""EAGLE / EAGLE3 drafts: a draft head reading the target's hidden states (nbgen/models/eagle.py), per
request over its own KV cache. Engines run chains (``speculative_eagle_topk=1``) batched across requests
(runtime/spec_eagle_batch.py, which takes the features from here and whose drafts the tests check against
``EagleDrafter.draft``) and trees per request (runtime/spec_eagle_tree.py, built on this class).

The target hands its features over after every forward (``observe``): the last layer's hidden state
(EAGLE) or the residual stream at three layers' inputs (EAGLE3: SGLang's default ``[2, L // 2, L - 3]``)
for each token whose KV stays valid — a prefill chunk's tokens, a verify seq's ``[last, accepted..]``.
Draft row j reads (feature of token j, token j + 1) at position j; the features wait until token
j + 1 is known. At the next draft, each drafting request's waiting rows run through the head (its own
KV cache of committed rows), the last row's output gives d1, and ``speculative_num_steps - 1`` more
one-row steps (the head's own output as the feature) give d2 .. dk; their KV is dropped afterwards.
Drafts are the head's argmax (point masses): verification (runtime/spec_verify.py) keeps any draft
lossless. A request whose features have a gap (a plain step, a prefix-cache hit) restarts its draft
cache at the first row it has.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.config import EngineConfig
from nbgen.core.request import Request
from nbgen.models.eagle import DraftCache, EagleDraft, load_eagle
from nbgen.runtime.runner import ModelRunner


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """SGLang's default EAGLE3 capture layers (the stream at the input of these target layers)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class _State:
    req: Request
    cache: DraftCache = field(default_factory=DraftCache)
    base: int = 0                                   # position of the cache's first row
    rows: list[torch.Tensor] = field(default_factory=list)   # waiting features, consecutive
    first: int = -1                                 # position of rows[0]

    @property
    def end(self) -> int:
        """The position after the last committed or waiting row."""
        return self.first + sum(r.shape[0] for r in self.rows) if self.rows else self.base + self.cache.length


class EagleDrafter:
    """A ``spec_step.Drafter`` running an EAGLE / EAGLE3 head on the target's features (loop thread)."""

    pages_first = False     # the head keeps its own KV cache: pages are lent for the drafts it made
    wants_hidden = True     # every target forward hands its features over (``observe``)

    def __init__(self, target: ModelRunner, head: EagleDraft, steps: int) -> None:
        self.target, self.head, self.steps = target, head, steps
        self.model = target.model.model
        self._st: dict[str, _State] = {}

    def observe(self, batch: ScheduledBatch, starts: Optional[list[int]], hidden: Optional[torch.Tensor],
                order: Optional[torch.Tensor] = None) -> None:
        """Take the features of the tokens of ``batch`` (its seqs as kept: rows ``starts[i] ..``) from
        the target forward that produced ``hidden`` [T, H]; None: a step without features. ``order``
        [T]: the forward's row feeding each row (a verified tree's accepted path moved to its front)."""
        aux, self.model.captured = self.model.captured, []
        if hidden is None or starts is None:
            return
        if self.head.eagle3:
            if len(aux) != 3 or aux[0].shape[0] != hidden.shape[0]:
                return                       # no capture (a graph replay): the next forward restarts
            hidden = torch.cat(aux, dim=-1)                                   # [T, 3H]
        if order is not None:
            hidden = hidden.index_select(0, order)
        for s, r0 in zip(batch.seqs, starts):
            st = self._st.get(s.req.rid)
            if st is None or st.req is not s.req:
                st = self._st[s.req.rid] = _State(s.req)
            if s.start_pos != st.end or (not st.rows and not st.cache.length):
                st.cache, st.base, st.rows = DraftCache(), s.start_pos, []   # a gap: restart here
            if not st.rows:
                st.first = s.start_pos
            st.rows.append(hidden[r0: r0 + s.q_len].clone())    # a copy: graph outputs are reused buffers

    def catch_up(self, s: SeqWork) -> Optional[tuple[DraftCache, torch.Tensor, int]]:
        """Run the waiting feature rows of ``s``'s request through the head: its draft cache (the
        committed rows), the last row's output [1, H] (it predicts the token after the last sampled
        one) and the position of the next draft row; None when the request cannot draft now."""
        st = self._st.get(s.req.rid)
        if st is None or st.req is not s.req or not st.rows:
            return None
        ids = s.req.all_ids
        feats = torch.cat(st.rows)                                         # [m, Hin]
        m, p = feats.shape[0], st.first
        if p + m >= len(ids):
            return None                      # the token after the last row is not known yet
        dev = self.target.device
        st.cache.truncate(p - st.base)
        pos = torch.arange(p, p + m, device=dev)
        o = self.head.step(self.target.to_device(ids[p + 1: p + m + 1]), feats, pos, st.cache)
        st.rows = []
        return st.cache, o[-1:], p + m

    @torch.inference_mode()
    def draft(self, batch: ScheduledBatch, limits: list[int]) -> list[list[int]]:
        """Per seq, up to ``limits[i]`` draft tokens (the head's greedy chain). The draft tokens stay on
        the device from one head step to the next; the step's drafts are read on the host once, at the end."""
        out: list[list[int]] = [[] for _ in batch.seqs]
        made: list[tuple[int, list[torch.Tensor]]] = []      # (seq, its drafts [1] each, on the device)
        dev = self.target.device
        for i, (s, k) in enumerate(zip(batch.seqs, limits)):
            got = self.catch_up(s) if k else None
            if got is None:
                continue
            cache, h, q = got
            committed = cache.length
            n = min(k, self.steps)
            pos = torch.arange(q, q + n, device=dev)          # the draft rows' positions
            toks: list[torch.Tensor] = []
            for j in range(n):
                toks.append(self.head.logits_to_tokens(h, self.target.model.compute_logits))     # [1]
                if j + 1 < n:
                    h = self.head.step(toks[-1], h, pos[j: j + 1], cache)
            cache.truncate(committed)        # draft rows are recomputed from the target's features
            made.append((i, toks))
        if made:
            flat = iter(torch.cat([t for _, toks in made for t in toks]).tolist())
            for i, toks in made:
                out[i] = [next(flat) for _ in toks]
        return out

    def prune(self) -> None:
        """Forget finished requests."""
        for rid in [r for r, st in self._st.items() if st.req.finished]:
            del self._st[rid]


def make_eagle_drafter(cfg: EngineConfig, runner: ModelRunner, steps: int, eagle3: bool) -> EagleDrafter:
    """Load the head of ``cfg.speculative_draft_model_path`` for ``runner``'s model (EAGLE3: its
    capture layers switched on)."""
    assert cfg.speculative_draft_model_path is not None
    if cfg.tp_size > 1:
        raise ValueError(f"speculative_algorithm={'EAGLE3' if eagle3 else 'EAGLE'} runs with tp_size=1 in nbgen "
                         f"(the head is not sharded), got tp_size={cfg.tp_size}")
    model = runner.model.model
    H = runner.model.config.hidden_size
    head = load_eagle(cfg.speculative_draft_model_path, H, model.embed_tokens,
                      next(runner.model.parameters()).dtype, runner.device)
    if head.eagle3 != eagle3:
        raise ValueError(f"speculative_draft_model_path holds an {'EAGLE3' if head.eagle3 else 'EAGLE'} head; "
                         f"speculative_algorithm is {'EAGLE3' if eagle3 else 'EAGLE'}")
    if eagle3:
        n = len(model.layers)
        if n < 4:
            raise ValueError(f"speculative_algorithm='EAGLE3' needs a target with >= 4 layers, got {n}")
        model.capture_layers = eagle3_layers(n)
    return EagleDrafter(runner, head, steps)
