"""Batched sampler: logit processors, greedy / seeded stochastic sampling, logprobs.

Per step, over a [B, V] float32 logits tensor (row i belongs to seqs[i]), in this order:
  1. logit_bias                        (added to the logits)
  2. repetition_penalty                (HF: over prompt+output ids; positive / p, negative * p)
  3. frequency / presence penalties    (OpenAI: over output ids; - f * count - p * [count > 0])
  4. min_new_tokens                    (stop ids masked to -inf while too few tokens exist)
     then custom logit processors and grammar bitmasks (runtime/constraints.py, only their rows)
  5. greedy rows (temperature 0 or top_k 1): argmax
  6. other rows: / temperature, top_k, top_p (on the top-k-renormalised distribution),
     min_p (relative to the most likely token), then a Gumbel-max draw.
Everything is vectorised over the batch; Python only builds small per-batch parameter
tensors, and work no row needs (sorting, penalties, hashing) is skipped.

Seeded randomness: the Gumbel noise of (row, token v) is a pure function of
(req.seed, index of the output token, v) through a 32-bit integer mix hash evaluated with torch
int64 ops that never overflow. So a request draws the same tokens whatever else is in
the batch, in any row order, on CPU and CUDA, without a torch.Generator per request.

Logprobs (SGLang's rule) are the log_softmax of the logits the draw sees: after steps 1-4, custom
processors and the grammar mask, divided by the temperature (greedy rows: not divided), before
top-k/top-p/min-p; ``original_logprobs`` (SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB) leaves the
temperature out. See nbgen.runtime.logprobs.
"""
from __future__ import annotations

import logging
import math
from array import array
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Optional

import torch
from torch import Tensor

from nbgen.core.batch import SeqWork, TokenLogprobs
from nbgen.runtime.constraints import Constraints
from nbgen.runtime.logprobs import RowLogprobs, queue_token_logprobs
from nbgen.runtime.sampler_rows import MAX_TEMPERATURE, fully_masked, host_tensor, raw_kinds, stop_ids_banned
from nbgen.runtime.sampling_ops import greedy_argmax, mix32, noisy_argmax, row_keys, tempered_draw

logger = logging.getLogger(__name__)
# noise is generated in row blocks so the int64 [rows, V] temporaries stay ~<= 128 MB each
_NOISE_BLOCK_ELEMS = 1 << 24
def _flat_index(ids_by_row: dict[int, list[int]], vocab: int, device: torch.device) -> Tensor:
    """Flat indices row * vocab + id into a [B, V] tensor, built without per-element Python work.

    The ids go through array('q') (C-speed conversion) and the row offsets are expanded on the
    device with repeat_interleave, so penalties over long prompts stay cheap to set up.
    """
    lens = [len(v) for v in ids_by_row.values()]
    total = sum(lens)
    if total == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    ids = array("q", chain.from_iterable(ids_by_row.values()))
    cols = host_tensor(torch.frombuffer(ids, dtype=torch.int64).clone(), torch.int64, device)
    offs = host_tensor([r * vocab for r in ids_by_row], torch.int64, device)
    lens_t = host_tensor(lens, torch.int64, device)
    # on the device: no host sync thanks to output_size
    return torch.repeat_interleave(offs, lens_t, output_size=total) + cols


@dataclass
class SamplerOutput:
    """token_ids: [B] long on the logits device; logprobs[i] set where seqs[i] asked for them."""

    token_ids: Tensor
    logprobs: list[Optional[TokenLogprobs]]
    errors: dict[int, str] = field(default_factory=dict)   # row -> message: abort that request only
    pending_logprobs: Optional[RowLogprobs] = None          # defer_logprobs: the rows' logprobs, not read yet


class Sampler:
    """Turns a step's logits into next tokens (and logprobs) for a batch of SeqWork."""

    def __init__(self, vocab_size: int, device: torch.device, original_logprobs: bool = False) -> None:
        """original_logprobs: report logprobs before the temperature (Engine's return_original_logprob).

        The sampled draw is a Gumbel-max argmax: on CUDA one Triton kernel hashing the noise as it
        reads the logits; on a CPU ~30 int64 tensor passes over [b, V] blocks.
        """
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.original_logprobs = original_logprobs
        self.constraints = Constraints(vocab_size, self.device)  # grammar masks, custom processors
        # hashed vocab ids; token v's noise is mix32(row_key ^ vocab_hash[v])
        self.vocab_hash = mix32(torch.arange(vocab_size, dtype=torch.int64, device=self.device)
                                 ^ 0x27D4EB2F)

    def warm(self, logits: Tensor) -> None:
        """Run the greedy argmax and both sampled draws (tempered, and after top-k / top-p) once over
        ``logits`` [b, V]: their kernels load (or compile) at start-up, not at the first request."""
        b, vocab = logits.shape
        keys = torch.zeros(b, dtype=torch.int64, device=logits.device)
        greedy_argmax(logits)
        tempered_draw(logits, torch.ones(b, dtype=torch.float32, device=logits.device), keys, self.vocab_hash[:vocab])
        noisy_argmax(logits.float(), keys, self.vocab_hash[:vocab])   # _sample draws from processed fp32 logits

    def __call__(self, logits: Tensor, seqs: list[SeqWork], fill: Optional[Any] = None,
                 greedy_out: Optional[Tensor] = None, defer_logprobs: bool = False) -> SamplerOutput:
        """logits [B, V'] in the model dtype (V' >= vocab: padded lm_head columns are dropped).

        ``fill``: a grammar bitmask job already started for these rows (overlap scheduling).
        ``greedy_out``: a [B] long buffer the all-plain-greedy fast path writes its ids into (the
        decode graphs' input of the next step), instead of a new tensor.
        ``defer_logprobs``: leave the logprobs on their way to the host (``pending_logprobs``; the
        overlap stepper reads them when it resolves the step) instead of waiting for them.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        raw = logits[:, : self.vocab_size]
        kinds = raw_kinds(seqs)
        if kinds <= {"argmax"}:
            # argmax of bf16 logits == argmax of their exact fp32 widening (ties too: first index),
            # so the [B, V] fp32 copy is skipped (~0.1 s of a 6 s GPU run, ~1 ms a step on a CPU)
            return SamplerOutput(token_ids=greedy_argmax(raw, greedy_out), logprobs=[None] * len(seqs), errors={})
        if fill is not None and fill.greedy:     # every row constrained greedy: the masked argmax alone
            return SamplerOutput(token_ids=self.constraints.masked_argmax(raw, fill, greedy_out),
                                 logprobs=[None] * len(seqs), errors={})
        if raw.is_cuda and kinds <= {"argmax", "draw"}:
            # temperature-only rows (nano-vllm's sampling): one kernel over the raw logits, no
            # [B, V] float32 copy and no division pass (the same tokens as the path below)
            return SamplerOutput(token_ids=self._draw_raw(raw, seqs), logprobs=[None] * len(seqs), errors={})
        x = self.process(raw.float(), seqs)   # .float(): a no-op on fp32
        errors: dict[int, str] = {}
        if self.constraints.wanted(seqs):
            x, errors = self.constraints.apply(x, seqs, fill)
        errors.update(fully_masked(x, seqs))
        greedy = [s.req.params.greedy for s in seqs]
        if all(greedy):
            tokens = greedy_argmax(x)
        else:
            rows = [i for i, g in enumerate(greedy) if not g]
            if len(rows) == len(seqs):
                tokens = self._sample(x, seqs)
            else:
                tokens = greedy_argmax(x)
                rows_t = host_tensor(rows, torch.long, x.device)
                tokens.index_copy_(0, rows_t, self._sample(x[rows_t], [seqs[i] for i in rows]))
        lps = self._logprobs(x, tokens, seqs)
        if defer_logprobs:
            return SamplerOutput(token_ids=tokens, logprobs=[None] * len(seqs), errors=errors, pending_logprobs=lps)
        return SamplerOutput(token_ids=tokens, logprobs=lps.lists(), errors=errors)

    # ------------------------------------------------------------------ processors
    def process(self, x: Tensor, seqs: list[SeqWork]) -> Tensor:
        """Steps 1-4 on [B, V] logits: x itself when nothing applies, else a modified copy."""
        dev, n = x.device, len(seqs)
        bias: dict[int, list] = {}; ban: dict[int, list[int]] = {}
        rep: dict[int, list[int]] = {}; cnt: dict[int, list[int]] = {}   # row -> token ids
        rep_p = [1.0] * n; freq = [0.0] * n; pres = [0.0] * n
        for i, s in enumerate(seqs):
            req, p = s.req, s.req.params
            if p.logit_bias:
                bias[i] = list(p.logit_bias.items())
            if p.repetition_penalty != 1.0:
                rep[i] = req.prompt_ids + req.output_ids
                if req.images is not None:     # image slots hold hash ids past the vocabulary
                    rep[i] = [t for t in rep[i] if t < self.vocab_size]
                rep_p[i] = p.repetition_penalty
            if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
                cnt[i] = req.output_ids
                freq[i], pres[i] = p.frequency_penalty, p.presence_penalty
            if stop_ids_banned(s):
                ban[i] = sorted(req.stop_ids)
        if not (bias or rep or cnt or ban):
            return x
        x = x.clone()
        vocab = x.shape[1]
        # token ids are checked against the vocabulary at the edge (SamplingParams.verify,
        # prompt validation), so there is no bounds check here
        if bias:
            flat = _flat_index({i: [t for t, _ in kv] for i, kv in bias.items()}, vocab, dev)
            vals = host_tensor([v for kv in bias.values() for _, v in kv], x.dtype, dev)
            x.view(-1).index_add_(0, flat, vals)
        if rep:
            seen = torch.zeros_like(x, dtype=torch.bool)                # [B, V] token occurred
            seen.view(-1).index_fill_(0, _flat_index(rep, vocab, dev), True)  # no scalar H2D copy
            pen = host_tensor(rep_p, x.dtype, dev).view(-1, 1)
            x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
        if cnt:
            flat = _flat_index(cnt, vocab, dev)
            counts = torch.zeros_like(x)                                # [B, V] output counts
            counts.view(-1).index_add_(0, flat, torch.ones(flat.numel(), dtype=x.dtype, device=dev))
            f = host_tensor(freq, x.dtype, dev).view(-1, 1)
            pr = host_tensor(pres, x.dtype, dev).view(-1, 1)
            x = x - f * counts - pr * (counts > 0).to(x.dtype)
        if ban:
            x.view(-1).index_fill_(0, _flat_index(ban, vocab, dev), float("-inf"))
        return x

    # ------------------------------------------------------------------ sampling
    def _sample(self, x: Tensor, seqs: list[SeqWork]) -> Tensor:
        """Step 6 for non-greedy rows. x: [b, V] processed logits -> [b] long."""
        dev, (b, vocab) = x.device, x.shape
        params = [s.req.params for s in seqs]
        # capped: a float32 inf temperature would turn the -inf of masked tokens into NaN
        temp = host_tensor([min(p.temperature, MAX_TEMPERATURE) for p in params], x.dtype, dev)
        x = x / temp.view(-1, 1)
        use_k = any(0 < p.top_k < vocab for p in params)                 # top_k >= vocab: all
        use_p = any(p.top_p < 1.0 for p in params)
        if use_k or use_p:
            sx, order = x.sort(dim=-1, descending=True)                # [b, V] best first
            if use_k:
                k = host_tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long, dev)
                ranks = torch.arange(vocab, device=dev).view(1, -1)
                sx = sx.masked_fill(ranks >= k.view(-1, 1), float("-inf"))
            if use_p:
                # smallest prefix whose mass reaches top_p: drop a token once the mass before it
                # already does; rows with top_p == 1 get threshold 2 (float rounding can't cut)
                top_p = host_tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params],
                                    x.dtype, dev).view(-1, 1)
                probs = torch.softmax(sx, dim=-1)
                before = probs.cumsum(dim=-1) - probs
                drop = before >= top_p
                drop[:, 0] = False                                      # always keep the best
                sx = sx.masked_fill(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, sx)             # back to vocab order
        if any(p.min_p > 0.0 for p in params):
            # p_v < min_p * p_max  <=>  logit_v < logit_max + log(min_p); min_p 0 -> -inf (off)
            logmin = host_tensor([math.log(p.min_p) if p.min_p > 0 else float("-inf")
                                  for p in params], x.dtype, dev)
            thr = x.max(dim=-1).values + logmin                         # [b]
            x = x.masked_fill(x < thr.view(-1, 1), float("-inf"))
        keys, vhash = self._noise_keys(seqs, vocab, dev)
        # the torch path's int64 temporaries are [block, V]: bounded; the CUDA kernel has none
        block = b if x.is_cuda else max(1, _NOISE_BLOCK_ELEMS // max(vocab, 1))
        out = [noisy_argmax(x[s:s + block], keys[s:s + block], vhash) for s in range(0, b, block)]
        return out[0] if len(out) == 1 else torch.cat(out)

    def _draw_raw(self, raw: Tensor, seqs: list[SeqWork]) -> Tensor:
        """Rows that are plain greedy (temperature 0 here) or plain draws, from raw [B, V] -> [B] long."""
        temps = host_tensor([0.0 if s.req.params.greedy else min(s.req.params.temperature, MAX_TEMPERATURE)
                             for s in seqs], torch.float32, raw.device)
        return tempered_draw(raw, temps, *self._noise_keys(seqs, raw.shape[1], raw.device))

    def _noise_keys(self, seqs: list[SeqWork], vocab: int, dev: torch.device) -> tuple[Tensor, Tensor]:
        """The draw's noise inputs on ``dev``: each row's key (its request seed and output index) [b]
        int64, and the hashed ids of the first ``vocab`` tokens [vocab] int64."""
        keys = host_tensor(torch.from_numpy(row_keys([s.req.seed for s in seqs], [s.out_index for s in seqs])),
                           torch.int64, dev)
        return keys, self.vocab_hash[:vocab].to(dev)

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, x: Tensor, tokens: Tensor, seqs: list[SeqWork]) -> RowLogprobs:
        """Logprobs of the rows that want them, from the processed logits x [B, V'] (SGLang's rule:
        divided by the temperature unless the row is greedy or ``original_logprobs``), queued."""
        rows = [i for i, s in enumerate(seqs) if s.req.logprobs.return_logprob]
        if not rows:
            return RowLogprobs(len(seqs), [], None)
        rows_t = host_tensor(rows, torch.long, x.device)
        lx = x[rows_t]                                                  # [r, V'] a copy
        if lx.shape[1] < self.vocab_size:        # narrowed to the tokenizer's ids by a grammar mask
            lx = torch.nn.functional.pad(lx, (0, self.vocab_size - lx.shape[1]), value=float("-inf"))
        if not self.original_logprobs:
            temps = [1.0 if p.greedy else min(p.temperature, MAX_TEMPERATURE)
                     for p in (seqs[i].req.params for i in rows)]
            if any(t != 1.0 for t in temps):
                lx = lx / host_tensor(temps, lx.dtype, lx.device).view(-1, 1)
        res = queue_token_logprobs(lx, tokens[rows_t],
                                   [seqs[i].req.logprobs.top_logprobs_num for i in rows],
                                   [seqs[i].req.logprobs.token_ids_logprob for i in rows])
        return RowLogprobs(len(seqs), rows, res)
