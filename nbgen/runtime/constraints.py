"""Per-request logit constraints inside the batched sampler: custom logit processors, grammar masks.

Applied after bias / penalties and before temperature and sampling, only to the rows of requests
that have them (a batch without any costs one Python scan). Order: custom processors first, then
the grammar mask, so a grammar is never violated by a processor.

Grammar masks: each constrained row's matcher fills its row of an int32 bitmask [B, ceil(V/32)] on
the host (xgrammar's thread pool for large batches; on CUDA this overlaps the queued forward pass),
the bitmask goes to the logits' device and xgrammar's kernel sets disallowed logits to -inf. When
every row is constrained and the logits are wider than the tokenizer, sampling runs over a view of
the tokenizer's columns.

Under overlap scheduling the fill starts earlier, in a worker thread (``fill_async``): xgrammar's
fill releases the GIL, so it runs while the loop thread delivers the previous step and schedules
the next; the sampler then only waits for it (``FillJob``). The same worker accepts each step's
tokens (``accept_async``) ahead of the next fill (runtime/fill_worker.py). When every row of such
a step is a greedy constrained row with nothing else to apply (the common extraction batch), the
sampler takes the tokens from ``masked_argmax``: on CUDA the argmax kernel reads the bitmask
beside the model-dtype logits (no float32 copy, no separate mask launch, no per-row Python). On a
CUDA decode graph step the runner replays the masked greedy head instead (runtime/greedy_heads.py): the
sampling queues such a fill's copy into the heads' static bitmask (``FillJob.into``).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import Tensor

from nbgen.core.batch import SeqWork
from nbgen.runtime.fill_worker import FillJob, FillWorker, SideCopy
from nbgen.runtime.grammar_batch import AcceptJob, binding_ready, fill_bitmask, live_rows
from nbgen.kernels.envs import grammar_threads
from nbgen.kernels import cpu_ops, gpu_argmax
from nbgen.runtime.sampling_ops import greedy_argmax, masked_greedy_argmax

logger = logging.getLogger("nbgen")

BATCH_FILL_MIN = 32  # constrained rows from which the bitmask is filled by xgrammar's thread pool


class Constraints:
    """Applies custom processors and grammar bitmasks to [B, V] float32 logits (loop thread)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._host: Optional[Tensor] = None      # int32 [rows, ceil(tokenizer vocab/32)] (pinned on CUDA)
        self._batch_matcher: Optional[Any] = None
        self._threads = 0                        # the batch matcher's thread count (``grammar_threads``)
        self._backend = "cpu" if self.device.type == "cpu" else "triton"
        self._worker = FillWorker(self.device)   # fill_async's and accept_async's thread
        self._side = SideCopy()                  # the bitmask's copies to the GPU, beside the forward

    @staticmethod
    def wanted(seqs: list[SeqWork]) -> bool:
        return any(s.req.grammar is not None or s.req.logit_processor is not None for s in seqs)

    def apply(self, x: Tensor, seqs: list[SeqWork],
              fill: Optional[FillJob] = None) -> tuple[Tensor, dict[int, str]]:
        """-> (logits with constraints applied, {row: error message} for failed processors).

        x is changed in place (logprobs are read from the constrained logits, as SGLang's). When
        every row is constrained, the result may be narrowed to the tokenizer's ids (a view).
        """
        if fill is not None:
            # the pipelined path: its rows were collected when the fill started (no matcher can
            # complete in between), and batches with custom processors never pipeline
            return self._mask(x, seqs, fill.rows, fill), {}
        procs: list[int] = []
        gram: list[int] = []
        for i, s in enumerate(seqs):   # one scan: this runs every step of a constrained batch
            req = s.req
            if req.logit_processor is not None:
                procs.append(i)
            # a matcher whose grammar already completed (overlap: the previous token ended it) is
            # skipped; a request only cut by length still gets its mask (its token is kept)
            if _live_grammar(req):
                gram.append(i)
        if not procs and not gram:
            return x, {}
        errors = self._run_processors(x, seqs, procs) if procs else {}
        if gram:
            if errors:
                gram = [i for i in gram if i not in errors]
            x = self._mask(x, seqs, gram, fill)
        return x, errors

    # ------------------------------------------------------------------ custom processors
    @staticmethod
    def _run_processors(x: Tensor, seqs: list[SeqWork], rows: list[int]) -> dict[int, str]:
        """Each request's processor on its own row; an exception fails that request only."""
        errors: dict[int, str] = {}
        for i in rows:
            req = seqs[i].req
            try:
                out = req.logit_processor(x[i:i + 1].clone(), [dict(req.params.custom_params or {})])
                if not isinstance(out, Tensor) or out.numel() != x.shape[1]:
                    raise TypeError(f"must return a [1, {x.shape[1]}] tensor, got "
                                    f"{tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__}")
                x[i] = out.reshape(-1).to(device=x.device, dtype=x.dtype)
            except Exception as e:  # noqa: BLE001 - caller-supplied code: abort its request only
                logger.warning("custom logit processor of %s failed: %s: %s", req.rid, type(e).__name__, e)
                errors[i] = f"custom logit processor failed: {type(e).__name__}: {e}"
        return errors

    # ------------------------------------------------------------------ grammar masks
    def _bitmask(self, rows: int, vocab: int) -> Tensor:
        import xgrammar as xgr

        width = -(-vocab // 32)
        if self._host is None or self._host.shape[0] < rows or self._host.shape[1] != width:
            n = max(rows, 2 * self._host.shape[0] if self._host is not None else 8)
            t = xgr.allocate_token_bitmask(n, vocab)                          # int32 [n, width]
            self._host = t.pin_memory() if self.device.type == "cuda" else t
        return self._host

    def _fill(self, rows: list[int], states: list, bm: Tensor) -> Optional[list[Any]]:
        """Fill the bitmask rows ``rows`` from their GrammarStates (xgrammar's thread pool for large
        batches); -> the states' matcher handles where the batch fill built them, else None."""
        import xgrammar as xgr

        if len(rows) >= BATCH_FILL_MIN:
            threads = grammar_threads()          # read per fill: a changed setting applies at the next one
            if self._batch_matcher is None or threads != self._threads:
                self._batch_matcher, self._threads = xgr.BatchGrammarMatcher(threads), threads
            return fill_bitmask(self._batch_matcher, states, bm, rows)
        for i, g in zip(rows, states):
            g.fill(bm, i)
        return None

    def fill_async(self, seqs: list[SeqWork], skip: frozenset[int] = frozenset(), queued: bool = False,
                   live: Optional[tuple[list[int], list[Any], bool]] = None) -> Optional[FillJob]:
        """Start filling the bitmask rows of seqs' live grammar requests in the worker thread.

        Call after the matchers accepted every earlier token, or once their accepts are queued in the
        worker (``accept_async``: the fill runs after them); ``skip``: ids of GrammarStates left
        out (their grammar completes with the token being accepted); ``queued``: only in the worker
        (None where the rows are too few for it: they would be filled here, beside the accepts). The
        matchers must not be touched until the job is waited for (the sampler does). ``live``: seqs'
        ``live_rows`` gathered earlier (no grammar completed since), ``skip`` still to leave out.
        """
        # the states are collected here, so the worker goes straight into xgrammar (which drops the GIL)
        if live is None:
            rows, states, greedy = live_rows(seqs, skip)
        else:
            rows, states, greedy = live
            if skip:
                keep = [k for k, g in enumerate(states) if id(g) not in skip]
                if len(keep) != len(states):
                    rows, states = [rows[k] for k in keep], [states[k] for k in keep]
        if not rows:
            return None
        vocab = states[0].vocab
        bm = self._bitmask(len(seqs), vocab)
        if len(rows) < BATCH_FILL_MIN:      # small: a thread hand-off costs more than it hides
            if queued:
                return None
            self._fill(rows, states, bm)
            return FillJob(rows, bm, None, vocab, greedy)
        job = FillJob(rows, bm, None, vocab, greedy, states=states)

        def work() -> None:
            job.handles = self._fill(rows, states, bm)

        job.future = self._worker.submit(work)
        return job

    def accept_async(self, fill: FillJob, tokens: list[int]) -> Optional[AcceptJob]:
        """Start accepting a sampled step's tokens (one per sampling row) in the worker thread by the
        matchers of ``fill``'s rows; None (the caller accepts) unless the fill ran in the worker.
        Rows of requests that jumped forward after the step was scheduled are not among them: the
        fill left them out (the overlap stepper's ``_stale``; the walk skips their token, and their
        matchers stay as the jump left them). The matchers must not be touched until
        ``StepGrammar.settle`` read the job."""
        states, rows, handles = fill.states, fill.rows, fill.handles
        if fill.future is None or states is None or not self._worker.started or not binding_ready():
            return None
        if handles is None:                     # the fill's list (the common step) is reused as it is
            handles = [s.handle for s in states]
            if None in handles:
                return None
        # rows: increasing sampling rows, so as many as tokens means every row in order
        toks = tokens if len(rows) == len(tokens) else [tokens[i] for i in rows]
        return AcceptJob(states, self._worker.accept(handles, toks), self._worker.drain)

    def masked_argmax(self, logits: Tensor, fill: FillJob, out: Optional[Tensor] = None) -> Tensor:
        """Greedy tokens [B] of a step whose rows are all constrained and greedy (``fill.greedy``):
        each row's argmax over the ids its grammar allows, from logits [B, V'] in the model dtype
        (into ``out`` when given). Equal to masking then ``greedy_argmax``."""
        width = min(fill.vocab, logits.shape[1])   # ids past the tokenizer are never allowed
        x = logits[:, :width]
        fill.wait()
        bm = fill.on_device(logits.shape[0], logits.device, self._side)
        if gpu_argmax.usable(x):
            return masked_greedy_argmax(x, bm, out)
        x = x.float()                                  # fp32 logits: masked in place, as _mask does
        self._apply_bits(x, bm, width, None)
        return greedy_argmax(x, out)

    def _mask(self, x: Tensor, seqs: list[SeqWork], rows: list[int], fill: Optional[FillJob] = None) -> Tensor:
        if not rows:
            return x
        vocab = seqs[rows[0]].req.grammar.vocab          # the tokenizer's size (same for all grammars)
        # the previous step's copy out of the pinned bitmask buffer is complete: constrained steps
        # resolve (synchronise) before the next one is built
        if fill is not None:
            fill.wait()
            dev_bm = fill.on_device(x.shape[0], x.device, self._side)
        else:
            bm = self._bitmask(x.shape[0], vocab)
            self._fill(rows, [seqs[i].req.grammar for i in rows], bm)
            dev_bm = self._side.to_device(bm[: x.shape[0]], x.device)
        every = len(rows) == x.shape[0]
        if x.shape[1] > vocab:  # logits of ids the tokenizer does not have (padded embedding rows)
            if every:           # no row can pick them: sample over the tokenizer's ids only (a view)
                x = x[:, :vocab]
            else:
                rows_t = torch.tensor(rows, dtype=torch.long).to(x.device, non_blocking=True)
                x[:, vocab:].index_fill_(0, rows_t, float("-inf"))
        width = min(vocab, x.shape[1])
        self._apply_bits(x, dev_bm, width, None if every else rows)   # indices cost the kernel a copy
        return x

    def _apply_bits(self, x: Tensor, dev_bm: Tensor, width: int, idx: Optional[list[int]]) -> None:
        """-inf into x's ids in [0, width) that dev_bm's rows (all rows, or ``idx``) do not allow."""
        import xgrammar as xgr

        if x.device.type == "cpu" and cpu_ops.apply_token_bitmask(x, dev_bm, width, idx):
            return              # nbgen's C kernel: threaded, whole allowed words skipped
        try:
            xgr.apply_token_bitmask_inplace(x, dev_bm, vocab_size=width, indices=idx, backend=self._backend)
        except Exception as e:  # noqa: BLE001 - e.g. no triton on this GPU host: torch fallback
            if self._backend in ("cpu", "torch_native"):
                raise
            logger.warning("xgrammar %s bitmask kernel failed (%s); using torch ops", self._backend, e)
            self._backend = "torch_native"
            xgr.apply_token_bitmask_inplace(x, dev_bm, vocab_size=width, indices=idx, backend=self._backend)


def _live_grammar(req: Any) -> bool:
    """The request has a matcher whose grammar is not complete yet (it gets a mask row)."""
    return req.grammar is not None and not req.grammar.done
