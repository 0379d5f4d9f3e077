"""EAGLE / EAGLE3 chain drafts batched across requests: the head over one flat step of every drafting
request's rows, its KV in a paged pool of its own indexed by the target's page tables, its one-row draft
steps replayed in CUDA graphs on CUDA, the drafts kept on the device (``speculative_eagle_topk=1``;
trees: runtime/spec_eagle_tree.py, per request).

The head's KV pool has the target's page count and page size with the head's layers (one for EAGLE3), so
a request's page table indexes it too: the head's row at position j (feature of token j, token j + 1)
lives at the slot of target position j. Per speculative step:

1. catch-up and d1: one eager head forward over every drafting request's waiting rows (the features the
   target handed over since its last draft: ``EagleDrafter.observe``) through the head's attention
   backend (paged prefill: each row sees the head's earlier rows of its request); d1 is the argmax at each
   request's last row;
2. d2 .. dk: one-row steps of the drafting requests, the feature being the head's own previous output.
   On CUDA with graphs they replay the head's decode graphs (runtime/cuda_graphs.py over ``HeadRows``:
   the input ids are placeholders resolved in the graph from the previous draft step's argmax, the
   features a static buffer); elsewhere they run eagerly;
3. the drafts [n, K] go to the host once (``PendingDrafts``), after the target's verify forward is queued
   where it replays a verify graph.

Draft rows past the last verified token are overwritten by the next catch-up (same positions), so no
KV is ever dropped. A request whose features have a gap (a plain step, a prefix-cache hit) drafts from
the rows it has; the head's KV at the missing positions is stale, which costs acceptance only.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from nbgen.attention.base import KVCacheSpec
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.kernels.batch_sizes import padded_batch_size
from nbgen.models.eagle import EagleDraft
from nbgen.runtime.cuda_graphs import CudaGraphRunner
from nbgen.runtime.model_setup import graphs_enabled, make_backend
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.spec_draft_graphs import PendingDrafts, pending_drafts, stack_drafts
from nbgen.runtime.spec_eagle import EagleDrafter
from nbgen.runtime.step_inputs import flatten, placeholder, placeholder_row

logger = logging.getLogger("nbgen")


class HeadRows(nn.Module):
    """The head as a model over flat one-row steps: ``forward(ids, positions, meta)`` with each row's feature
    from ``features`` (a static [max rows, H] buffer: what the decode graphs read)."""

    def __init__(self, head: EagleDraft, rows: int) -> None:
        super().__init__()
        self.head = head
        p = next(head.parameters())
        self.features = torch.zeros(rows, head.cfg.hidden_size, dtype=p.dtype, device=p.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: object) -> torch.Tensor:
        return self.head.step_paged(ids, self.features[: ids.shape[0]], positions, meta)


class EagleChainDrafter(EagleDrafter):
    """A ``spec_step.Drafter`` running an EAGLE / EAGLE3 head's chains for all requests at once."""

    pages_first = True      # draft rows write the head's KV at the draft positions

    def __init__(self, target: ModelRunner, head: EagleDraft, steps: int) -> None:
        super().__init__(target, head, steps)
        cfg, tspec = target.cfg, target.kv_spec
        hc = head.cfg
        hd = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
        layers = 1 if head.eagle3 else hc.num_hidden_layers
        spec = KVCacheSpec(layers, tspec.num_pages, tspec.page_size, hc.num_attention_heads, hc.num_key_value_heads,
                           hd, tspec.dtype, tspec.device)
        self.backend = make_backend(cfg, spec)      # the pool in the model dtype (no fp8 scales)
        self.graphs: Optional[CudaGraphRunner] = None
        self.rows: Optional[HeadRows] = None
        if target.graphs is not None and graphs_enabled(cfg, self.backend):
            self.rows = HeadRows(head, target.graphs.max_bs)
            try:
                self.graphs = CudaGraphRunner(self.rows, self.backend, cfg.cuda_graph_max_bs,
                                              target.loaded.context_length)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                logger.warning("EAGLE head CUDA graphs unavailable (%s); its draft steps run eagerly", e)
                torch.cuda.empty_cache()
        self.graph_steps = 0     # engine steps whose draft steps replayed the head's graphs
        self._replays = 0

    def _tokens(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """Greedy drafts [n] of the first n rows of ``out`` [>= n, H] (rows padded to a graph batch size
        on CUDA: cuBLAS picks its kernel on the host at each new row count, see ModelRunner)."""
        if self.target.on_gpu and out.shape[0] != padded_batch_size(n):
            out = torch.cat([out[:n], out[n - 1:n].expand(padded_batch_size(n) - n, -1)])
        return self.head.logits_to_tokens(out, self.target.model.compute_logits)[:n]

    @torch.inference_mode()
    def draft_on_device(self, batch: ScheduledBatch, limits: list[int]) -> Optional[PendingDrafts]:
        """Up to ``limits[i]`` drafts per seq (0 where the request has no features to draft from), on the
        device; None when no seq can draft."""
        work: list[SeqWork] = []
        owner: list[int] = []
        feats: list[torch.Tensor] = []
        for i, (s, k) in enumerate(zip(batch.seqs, limits)):
            st = self._st.get(s.req.rid)
            if not k or st is None or st.req is not s.req or not st.rows:
                continue
            m, p, ids = sum(r.shape[0] for r in st.rows), st.first, s.req.all_ids
            if p + m >= len(ids):
                continue                     # the token after the last row is not known yet
            work.append(SeqWork(s.req, ids[p + 1: p + m + 1], p, s.pages, True))
            owner.append(i)
            feats.extend(st.rows)
            st.rows, st.base = [], p + m     # consumed: the head's KV now holds them (``end`` = p + m)
        if not work:
            return None
        counts = [0] * len(batch.seqs)
        for w, i in zip(work, owner):
            counts[i] = min(limits[i], self.steps)
        page_size = batch.page_size
        cb = ScheduledBatch(work, page_size)
        flat = flatten(cb)
        to = self.target.to_device
        out = self.head.step_paged(to(flat.ids), torch.cat(feats), to(flat.positions), self.backend.prepare(cb))
        h = out.index_select(0, to(flat.sample_rows))                                    # [n, H]
        toks = self._tokens(h, len(work))                                                # d1
        live = list(range(len(work)))
        replays = self._replays
        cols = [([owner[r] for r in live], toks)]
        for j in range(1, max(counts)):      # feed d_j at position kv_len + j - 1 (kv_len: after the catch-up)
            keep = [r for r, w in enumerate(live) if counts[owner[w]] > j]
            live = [live[r] for r in keep]
            if len(keep) != h.shape[0]:
                h = h.index_select(0, to(keep))
            seqs = [SeqWork(work[w].req, [placeholder(r)], work[w].kv_len + j - 1, work[w].pages, True)
                    for r, w in zip(keep, live)]
            h = self._draft_step(ScheduledBatch(seqs, page_size), h, toks)
            toks = self._tokens(h, len(seqs))
            h = h[: len(seqs)]
            cols.append(([owner[w] for w in live], toks))
        self.graph_steps += self._replays > replays
        return pending_drafts(stack_drafts(cols, len(batch.seqs), max(counts)), counts, self.graph_steps)

    def _draft_step(self, batch: ScheduledBatch, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """One row per seq of ``batch`` (ids: placeholders naming rows of ``prev``, the previous draft ids
        [S]; features ``h`` [n, H]) -> the head's outputs [>= n, H]."""
        n = len(batch.seqs)
        if self.graphs is not None and self.rows is not None and n <= self.graphs.max_bs:
            self.rows.features[:n].copy_(h)
            staged = self.graphs.stage(batch, [s.token_ids[0] for s in batch.seqs])
            self.graphs.replay(staged, prev)
            self._replays += 1
            return self.graphs.padded_output(staged)
        ids = prev.index_select(0, self.target.to_device([placeholder_row(s.token_ids[0]) for s in batch.seqs]))
        pos = self.target.to_device([s.start_pos for s in batch.seqs])
        return self.head.step_paged(ids, h, pos, self.backend.prepare(batch))

    @torch.inference_mode()
    def draft(self, batch: ScheduledBatch, limits: list[int]) -> list[list[int]]:
        """Per seq, up to ``limits[i]`` draft tokens, read on the host."""
        got = self.draft_on_device(batch, limits)
        return got.lists() if got is not None else [[] for _ in batch.seqs]
