"""The lean CPU decode layer (nbgen.models.cpu_decode): on a bf16 model with packed linears (int4 copies for
steps of a few rows), decode steps of any row count give the module path's hidden states bit for bit, and so
does the one-call C driver of all layers (kernels/cpu_q4.py) where it applies (4-bit linears without
biases, a few rows); prefill steps and fp32 models use the modules."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.torch_backend import TorchAttentionBackend
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.config import EngineConfig
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.kernels import cpu_q4
from nbgen.models import cpu_int4
from nbgen.models.linear import cpu_packed_matmul_available
from nbgen.models.loader import load_model
from tests.tiny_models import gguf_round_trip

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="torch without the CPU int4 kernels")
PAGE = 4


def _q4_model(tmp_path: Path, cls_name: str, **extra) -> Path:
    torch.manual_seed(0)
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, **extra)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.copy_(gguf_round_trip(p * 3, "Q4_1"))                  # the projections on a 4-bit grid, as a GGUF Q4_1
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
                                            ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
                                            ("LlamaForCausalLM", {})])
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
    prompts = [[5, 17, 42, 9, 100, 3, 77], [8, 1, 250, 64, 2], [7, 7, 7], [90, 91], [4, 30, 200, 6], [1]]
    pages = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(len(prompts))]
    _step(model, backend, prompts, [0] * len(prompts), pages)      # prefill (22 rows: the modules)
    lens = [len(p) for p in prompts]
    for n in (2, 1, 6, 2):              # decode rows: int4 copies up to cpu_int4.MAX_ROWS, packed bf16 above
        ids = [[11 + n + i] for i in range(n)]
        starts = lens[:len(ids)]
        inner.cpu_decode = None
        ref = _step(model, backend, ids, starts, pages)
        inner.cpu_decode = plan
        hits = []
        orig = plan.layer
        plan.layer = lambda *a, **k: hits.append(1) or orig(*a, **k)
        out = _step(model, backend, ids, starts, pages)
        del plan.layer
        # without biases, at up to MAX_ROWS rows, on a VNNI CPU: all layers in one C call (no per-layer calls)
        fused = not extra and n <= cpu_int4.MAX_ROWS and cpu_q4.q4_vnni()
        assert len(hits) == (0 if fused else 2) and torch.equal(out, ref), n
        for t in backend.k_cache + backend.v_cache:     # the pool at new addresses (as after a memory resume)
            t.data = t.data.clone()
        lens = [n + 1 for n in starts] + lens[len(ids):]


def test_plans_for_packed_bf16_models_only(tmp_path: Path) -> None:
    """A bf16 model off the 4-bit grid gets a plan (its packed weights), an fp32 one does not."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    got = {}
    for dtype in ("bfloat16", "float32"):
        loaded = load_model(EngineConfig(model_path=str(tmp_path), dtype=dtype, device="cpu"), torch.device("cpu"))
        got[dtype] = loaded.model.model.cpu_decode is not None
    assert got == {"bfloat16": cpu_packed_matmul_available(), "float32": False}
