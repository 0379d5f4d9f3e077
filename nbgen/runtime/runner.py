"""ModelRunner: owns the model, the KV cache (through an attention backend) and the sampler.

One ``step(ScheduledBatch) -> StepOutput`` per scheduler step; everything here runs on the loop thread.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from nbgen.attention.base import AttentionBackend, KVCacheSpec
from nbgen.config import EngineConfig
from nbgen.runtime.batch import ScheduledBatch, StepOutput, TokenLogprobs

logger = logging.getLogger("nbgen")

# CPU default KV budget when max_total_tokens is not given: enough for a notebook's batches while
# keeping the embedded model's resident memory well under 1.5 GB (its KV is ~23 KB/token in bf16).
CPU_DEFAULT_TOTAL_TOKENS = 16384


def _model_dims(hf) -> tuple[int, int, int, int]:
    """(num_layers, num_q_heads, num_kv_heads, head_dim) of an HF config."""
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return hf.num_hidden_layers, heads, kv, head_dim


class ModelRunner:
    """Runs forward passes for scheduled batches and samples the next tokens."""

    def __init__(self, cfg: EngineConfig, device: torch.device) -> None:
        from nbgen.models.loader import load_model
        from nbgen.runtime.sampler import Sampler

        self.cfg = cfg
        self.device = device
        self.loaded = load_model(cfg, device)
        self.model = self.loaded.model
        self.hf_config = self.loaded.hf_config
        self.vocab_size = int(self.hf_config.vocab_size)
        self.num_pages = self._num_pages()
        layers, hq, hkv, hd = _model_dims(self.hf_config)
        self.kv_spec = KVCacheSpec(layers, self.num_pages, cfg.page_size, hq, hkv, hd,
                                   self.loaded.dtype, device)
        self.backend = self._make_backend()
        self.sampler = Sampler(self.vocab_size, device)

    # ---- sizing -------------------------------------------------------------------------------
    def _bytes_per_page(self) -> int:
        layers, _, hkv, hd = _model_dims(self.hf_config)
        item = torch.empty((), dtype=self.loaded.dtype).element_size()
        return 2 * layers * self.cfg.page_size * hkv * hd * item

    def _num_pages(self) -> int:
        P = self.cfg.page_size
        if self.cfg.max_total_tokens is not None:
            return max(2, -(-self.cfg.max_total_tokens // P) + 1)  # +1: page 0 is the scratch page
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.cfg.mem_fraction_static - used
            if budget <= 0:
                raise RuntimeError(f"no GPU memory left for the KV cache (mem_fraction_static="
                                   f"{self.cfg.mem_fraction_static}, {used / 2**30:.1f} GiB in use)")
            return max(2, int(budget // self._bytes_per_page()))
        return -(-CPU_DEFAULT_TOTAL_TOKENS // P) + 1

    def _make_backend(self) -> AttentionBackend:
        name = self.cfg.attention_backend or ("flashinfer" if self.device.type == "cuda" else "torch")
        if name == "flashinfer":
            try:
                from nbgen.attention.flashinfer_backend import FlashInferBackend
            except ImportError as e:
                if self.cfg.attention_backend == "flashinfer":
                    raise
                logger.warning("flashinfer unavailable (%s); using the torch attention backend", e)
            else:
                return FlashInferBackend(self.kv_spec)
        from nbgen.attention.torch_backend import TorchAttentionBackend

        self.backend_name = "torch"
        return TorchAttentionBackend(self.kv_spec)

    @property
    def attention_backend_name(self) -> str:
        return type(self.backend).__name__

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> StepOutput:
        """Forward the batch's tokens, sample where asked, gather logprobs."""
        from nbgen.runtime.logprobs import prompt_logprobs

        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        sample_seqs = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_owner: list[int] = []  # seq index of each prompt-logprob row
        row = 0
        for i, s in enumerate(batch.seqs):
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.kv_len))
            if s.sample:
                sample_rows.append(row + s.q_len - 1)
                sample_seqs.append(s)
            if s.prompt_logprob_start >= 0:
                # hidden at position p predicts token p+1: targets t in [max(L, 1, start+1), min(kv_len, prompt_len-1)]
                plen = len(s.req.prompt_ids)
                lo = max(s.prompt_logprob_start, 1, s.start_pos + 1)
                hi = min(s.kv_len, plen - 1)
                for t in range(lo, hi + 1):
                    prompt_rows.append(row + (t - 1 - s.start_pos))
                    prompt_targets.append(s.req.prompt_ids[t])
                    prompt_owner.append(i)
            row += s.q_len
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        meta = self.backend.prepare(batch)
        hidden = self.model(input_ids, positions, meta)                     # [T, H]
        rows = torch.tensor(sample_rows + prompt_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, rows))    # [S + Np, V] fp32

        n = len(batch.seqs)
        next_ids = [-1] * n
        out_lps: list[Optional[TokenLogprobs]] = [None] * n
        prm_lps: list[Optional[list[TokenLogprobs]]] = [None] * n
        errors: dict[int, str] = {}
        if sample_seqs:
            res = self.sampler(logits[: len(sample_rows)], sample_seqs)
            toks = res.token_ids.tolist()
            k = 0
            for i, s in enumerate(batch.seqs):
                if s.sample:
                    next_ids[i] = toks[k]
                    out_lps[i] = res.logprobs[k]
                    k += 1
        if prompt_rows:
            top = max(batch.seqs[i].req.logprobs.top_logprobs_num for i in set(prompt_owner))
            id_lists = [batch.seqs[i].req.logprobs.token_ids_logprob for i in prompt_owner]
            lps = prompt_logprobs(logits[len(sample_rows):],
                                  torch.tensor(prompt_targets, device=dev), top, None)
            for j, (owner, lp) in enumerate(zip(prompt_owner, lps)):
                req_lp = batch.seqs[owner].req.logprobs
                lp.top = lp.top[: req_lp.top_logprobs_num]
                if id_lists[j]:
                    lp.ids = self._ids_logprobs(logits[len(sample_rows) + j], id_lists[j])
                prm_lps[owner] = (prm_lps[owner] or []) + [lp]
        for i, s in enumerate(batch.seqs):
            if s.prompt_logprob_start >= 0 and prm_lps[i] is None:
                prm_lps[i] = []
        return StepOutput(next_token_ids=next_ids, output_logprobs=out_lps,
                          prompt_logprobs=prm_lps, errors=errors)

    @staticmethod
    def _ids_logprobs(row_logits: torch.Tensor, ids: list[int]) -> list[tuple[float, int]]:
        lp = torch.log_softmax(row_logits.float(), dim=-1)
        vals = lp[torch.tensor(ids, device=lp.device)].tolist()
        return list(zip(vals, ids))
