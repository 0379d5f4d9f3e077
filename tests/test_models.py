"""Model families and loading: nbgen logits vs HF transformers on tiny random checkpoints (CPU)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.torch_backend import TorchAttentionBackend
from nbgen.config import EngineConfig
from nbgen.models.loader import load_model, resolve_dtype
from nbgen.runtime.batch import ScheduledBatch, SeqWork
from nbgen.runtime.request import Request
from nbgen.sampling import SamplingParams

PAGE = 4
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6)


def _hf_model(cls_name: str, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    model = getattr(transformers, cls_name)(cfg_cls(**{**SMALL, **overrides}))
    with torch.no_grad():   # random norms / biases so a wrong wiring cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval().float()


def _run(loaded, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill all prompts in one flat batch through the real torch backend -> fp32 logits [T, V]."""
    cfg = loaded.hf_config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    spec = KVCacheSpec(num_layers=cfg.num_hidden_layers, num_pages=64, page_size=PAGE,
                       num_q_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                       head_dim=hd, dtype=loaded.dtype, device=torch.device("cpu"))
    backend = TorchAttentionBackend(spec)
    seqs, next_page = [], 1
    for i, ids in enumerate(prompts):
        n_pages = -(-len(ids) // PAGE)
        pages = list(range(next_page, next_page + n_pages))
        next_page += n_pages
        seqs.append(SeqWork(req=Request(str(i), ids, SamplingParams()), token_ids=ids, start_pos=0,
                            pages=pages, sample=True))
    meta = backend.prepare(ScheduledBatch(seqs=seqs, page_size=PAGE))
    input_ids = torch.tensor([t for ids in prompts for t in ids])
    positions = torch.tensor([p for ids in prompts for p in range(len(ids))])
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(input_ids, positions, meta))


def _check_against_hf(tmp_path: Path, cls_name: str, **overrides) -> None:
    hf = _hf_model(cls_name, **overrides)
    hf.save_pretrained(tmp_path)
    loaded = load_model(EngineConfig(model_path=str(tmp_path), dtype="float32", device="cpu"),
                        torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 300, (11,), generator=g).tolist()
    b = torch.randint(0, 300, (6,), generator=g).tolist()
    with torch.no_grad():
        ref_a = hf(torch.tensor([a])).logits[0]
        ref_b = hf(torch.tensor([b])).logits[0]
    torch.testing.assert_close(_run(loaded, [a]), ref_a, atol=1e-4, rtol=0)
    packed = _run(loaded, [a, b])
    torch.testing.assert_close(packed, torch.cat([ref_a, ref_b]), atol=1e-4, rtol=0)


def test_llama_matches_hf(tmp_path: Path) -> None:
    _check_against_hf(tmp_path, "LlamaForCausalLM")


def test_llama3_rope_scaling_and_bias_match_hf(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    _check_against_hf(tmp_path, "LlamaForCausalLM", rope_scaling=scaling, rope_theta=500.0,
                      attention_bias=True, mlp_bias=True, num_hidden_layers=3)


def test_qwen2_tied_matches_hf(tmp_path: Path) -> None:
    _check_against_hf(tmp_path, "Qwen2ForCausalLM", tie_word_embeddings=True)


def test_qwen3_matches_hf(tmp_path: Path) -> None:
    _check_against_hf(tmp_path, "Qwen3ForCausalLM", head_dim=32, tie_word_embeddings=False)
