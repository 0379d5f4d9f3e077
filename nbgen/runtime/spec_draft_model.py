"""STANDALONE drafts: a small draft model with the target's tokenizer proposes tokens autoregressively.

The draft model has its own ModelRunner (weights, attention backend, KV pool; on CUDA its own decode
graphs and, beside them, verify graphs for the catch-up: runtime/spec_draft_graphs.py) whose KV pool
has as many pages as the target's, so a request's page table from the scheduler indexes both
caches: page p holds the target's KV and the draft's KV of the same tokens. Pages the prefix cache
shares were computed by both models.

Per speculative step, over the batch's seqs:

1. catch-up + first draft: one draft forward runs each seq's tokens the draft has no KV for yet —
   a prefill chunk as the target runs it, or a decode seq's tokens since its last draft step (the
   tokens the previous verify accepted, and its bonus) — and samples d1 where drafts are wanted;
2. ``speculative_num_steps - 1`` more one-token forwards sample d2 .. dk.

Drafts are sampled like the target samples (the request's temperature / top-k / top-p and its seeded
noise at the same output index), which keeps acceptance high for sampled requests; any draft is
lossless (runtime/spec_verify.py). The draft's KV at positions past the last verified token is
never trusted: the next step recomputes from there.

On CUDA with graphs, a step whose seqs are all decodes with a catch-up of at most
``speculative_num_draft_tokens`` tokens drafts through the graphs, the drafts staying on the device
(``draft_on_device``; runtime/spec_draft_graphs.py); other steps (prefill chunks, a long catch-up) draft
eagerly here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.config import EngineConfig
from nbgen.core.request import Request
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.spec_draft_graphs import DraftGraphs, PendingDrafts
from nbgen.runtime.step_inputs import flatten
from nbgen.runtime.verify_graphs import make_verify_graphs


def draft_config(cfg: EngineConfig, num_pages: int) -> EngineConfig:
    """The draft runner's config: the target's, with the draft model, a KV pool of the target's
    page count, the target's decode graphs (no piecewise prefill graphs), no LoRA and no speculation
    of its own."""
    assert cfg.speculative_draft_model_path is not None
    max_bs = 0 if cfg.disable_cuda_graph else cfg.cuda_graph_max_bs
    out = dataclasses.replace(
        cfg, model_path=cfg.speculative_draft_model_path, tokenizer_path=None, skip_tokenizer_init=True,
        max_total_tokens=(num_pages - 1) * cfg.page_size, cuda_graph_max_bs=max_bs or None,
        disable_piecewise_cuda_graph=True, speculative_algorithm=None, speculative_draft_model_path=None,
        enable_lora=False, lora_paths=None)
    out.cuda_graph_max_bs = max_bs     # 0: a resolved config's "no decode graphs" (as EngineConfig.resolved)
    return out


class DraftModelDrafter:
    """A ``spec_step.Drafter`` running a draft model (loop thread)."""

    pages_first = True     # the draft writes KV at the draft positions

    def __init__(self, runner: ModelRunner, target_vocab: int, steps: int,
                 graphs: Optional[DraftGraphs] = None) -> None:
        """``graphs``: the draft runner's graph steps (CUDA), for ``draft_on_device``."""
        if runner.vocab_size > target_vocab:
            raise ValueError(f"speculative_draft_model_path: the draft's vocabulary ({runner.vocab_size}) is "
                             f"larger than the target's ({target_vocab}); it must share the target's tokenizer")
        self.runner = runner
        self.steps = steps
        self.graphs = graphs
        self._kv: dict[str, tuple[Request, int]] = {}   # rid -> (request, leading tokens with draft KV)

    def _known(self, s: SeqWork) -> int:
        """Tokens of s's request whose draft KV is valid (a request seen first in a chunk starting
        past 0 hit the prefix cache: those pages hold draft KV too)."""
        got = self._kv.get(s.req.rid)
        if got is not None and got[0] is s.req:
            return min(got[1], s.start_pos)
        return s.start_pos if s.start_pos < len(s.req.prompt_ids) else 0

    def _catch_up(self, batch: ScheduledBatch, limits: list[int]) -> list[SeqWork]:
        """Per seq of ``batch``, the draft forward's seq: its tokens without draft KV yet (sampling
        where drafts are wanted)."""
        work: list[SeqWork] = []
        for s, k in zip(batch.seqs, limits):
            lo = self._known(s)
            ids = s.token_ids if lo == s.start_pos else s.req.all_ids[lo:s.kv_len]
            work.append(SeqWork(s.req, ids, lo, s.pages, k > 0))
        return work

    def _commit(self, work: list[SeqWork]) -> None:
        """The draft KV of ``work``'s tokens is written (queued)."""
        for w in work:
            self._kv[w.req.rid] = (w.req, w.kv_len)

    @torch.inference_mode()
    def draft_on_device(self, batch: ScheduledBatch, limits: list[int]) -> Optional[PendingDrafts]:
        """Exactly ``limits[i]`` drafts per seq through the draft's CUDA graphs, left on the device;
        None when the step cannot run there (no graphs, a prefill chunk, a long catch-up): ``draft``."""
        if self.graphs is None or not batch.is_decode_only:
            return None
        work = self._catch_up(batch, limits)
        if not self.graphs.can_run(work):
            return None
        self._commit(work)
        return self.graphs.draft(work, limits, batch.page_size)

    @torch.inference_mode()
    def draft(self, batch: ScheduledBatch, limits: list[int]) -> list[list[int]]:
        """Per seq, up to ``limits[i]`` draft tokens (KV caught up for every seq of the batch)."""
        work = self._catch_up(batch, limits)
        self._commit(work)
        out: list[list[int]] = [[] for _ in batch.seqs]
        toks = self._forward(work, batch.page_size)
        live = [(w, i) for i, w in enumerate(work) if w.sample]        # seqs drafting, in row order
        while live:
            nxt: list[tuple[SeqWork, int]] = []
            for (w, i), t in zip(live, toks):
                out[i].append(t)
                if len(out[i]) < limits[i]:
                    nxt.append((SeqWork(w.req, [t], w.kv_len, w.pages, True), i))
            live = nxt
            if live:
                toks = self._forward([w for w, _ in live], batch.page_size)
        return out

    def _forward(self, seqs: list[SeqWork], page_size: int) -> list[int]:
        """One draft forward over ``seqs``; the sampled token of each sampling seq, in order."""
        batch = ScheduledBatch(seqs, page_size)
        flat = flatten(batch)
        hidden = self.runner.hidden_states(batch, flat)                        # [T, H]
        if not flat.sample_rows:
            return []
        rows = hidden.index_select(0, self.runner.to_device(flat.sample_rows))
        logits = self.runner.model.compute_logits(rows)                         # [S, V_draft]
        return self.runner.sampler(logits, flat.sample_seqs).token_ids.tolist()

    def prune(self) -> None:
        """Forget finished requests."""
        for rid in [r for r, (req, _) in self._kv.items() if req.finished]:
            del self._kv[rid]


def make_draft_runner(cfg: EngineConfig, device: torch.device, num_pages: int) -> ModelRunner:
    """Load the draft model (its KV pool sized to ``num_pages`` pages of ``cfg.page_size``)."""
    return ModelRunner(draft_config(cfg, num_pages), device)


def make_draft_graphs(runner: ModelRunner, q: int) -> Optional[DraftGraphs]:
    """The draft runner's graph steps (catch-up rows of ``q`` tokens), or None where the runner has no
    decode graphs or its verify graphs cannot be captured."""
    vg = make_verify_graphs(runner, q)
    return DraftGraphs(runner, vg) if vg is not None else None
