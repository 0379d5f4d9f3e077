"""The lean CPU decode layer (nbgen.models.cpu_decode): on a model whose linears have int4 copies, decode
steps of a few rows give the module path's hidden states bit for bit; other steps and models use the modules."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, quants

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.torch_backend import TorchAttentionBackend
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.config import EngineConfig
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.models import cpu_int4
from nbgen.models.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="torch without the CPU int4 kernels")
PAGE = 4


def _q4_1(w: torch.Tensor) -> torch.Tensor:
    q = quants.quantize(w.float().numpy(), GGMLQuantizationType.Q4_1)
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(q, GGMLQuantizationType.Q4_1)))


def _q4_model(tmp_path: Path, cls_name: str, **extra) -> Path:
    torch.manual_seed(0)
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, **extra)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.copy_(_q4_1(p * 3))                  # the projections on a 4-bit grid, as a GGUF Q4_1
            elif "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return tmp_path


def _step(model, backend, ids: list[list[int]], starts: list[int], pages: list[list[int]]) -> torch.Tensor:
    seqs = [SeqWork(req=Request(str(i), t, SamplingParams()), token_ids=t, start_pos=s, pages=p, sample=True)
            for i, (t, s, p) in enumerate(zip(ids, starts, pages))]
    meta = backend.prepare(ScheduledBatch(seqs=seqs, page_size=PAGE))
    flat = torch.tensor([t for row in ids for t in row])
    pos = torch.tensor([s + j for row, s in zip(ids, starts) for j in range(len(row))])
    with torch.no_grad():
        return model(flat, pos, meta)


@pytest.mark.parametrize("cls_name,extra", [("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
                                            ("Qwen2ForCausalLM", {"tie_word_embeddings": True})])
def test_decode_steps_equal_the_module_path(tmp_path: Path, cls_name: str, extra: dict) -> None:
    loaded = load_model(EngineConfig(model_path=str(_q4_model(tmp_path, cls_name, **extra)), dtype="bfloat16",
                                     device="cpu"), torch.device("cpu"))
    model, inner = loaded.model, loaded.model.model
    plan = inner.cpu_decode
    assert plan is not None
    spec = KVCacheSpec(num_layers=2, num_pages=32, page_size=PAGE, num_q_heads=4, num_kv_heads=2, head_dim=16,
                       dtype=torch.bfloat16, device=torch.device("cpu"))
    backend = TorchAttentionBackend(spec)
    assert backend.cpu_kernels
    prompts = [[5, 17, 42, 9, 100, 3, 77], [8, 1, 250, 64, 2]]
    pages = [[1, 2, 3], [4, 5, 6]]
    _step(model, backend, prompts, [0, 0], pages)                   # prefill (12 rows: the modules)
    lens = [len(p) for p in prompts]
    for t, rows in enumerate([[11, 12], [13, 14], [15, 16]]):
        ids = [[r] for r in rows] if t != 1 else [[rows[0]]]        # 2 rows, then 1, then 2
        starts = lens[:len(ids)]
        inner.cpu_decode = None
        ref = _step(model, backend, ids, starts, pages)
        inner.cpu_decode = plan
        hits = []
        orig = plan.layer
        plan.layer = lambda *a, **k: hits.append(1) or orig(*a, **k)
        out = _step(model, backend, ids, starts, pages)
        del plan.layer
        assert len(hits) == 2 and torch.equal(out, ref)
        lens = [n + 1 for n in starts] + lens[len(ids):]


def test_models_without_int4_copies_get_no_plan(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    for dtype in ("bfloat16", "float32"):
        loaded = load_model(EngineConfig(model_path=str(tmp_path), dtype=dtype, device="cpu"), torch.device("cpu"))
        assert loaded.model.model.cpu_decode is None
