"""Embeddings on the GPU fast path (CUDA only): flashinfer prefill, piecewise prefill graphs, decode
graphs for one-token chunks after a cache hit, bf16 against HF fp32 on the same device."""
from __future__ import annotations

import random

import pytest
import torch

import nbgen

gpu = pytest.mark.gpu


def _hf_last_token(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = hf(torch.tensor([ids], device="cuda")).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(h, dim=-1).cpu())
    del hf
    torch.cuda.empty_cache()
    return out


def _encode(model_dir: str, prompts: list[list[int]], twice: bool = False, **cfg) -> tuple[list[dict], dict]:
    with nbgen.Engine(model_dir, device="cuda", dtype="bfloat16", is_embedding=True, cuda_graph_max_bs=16,
                      chunked_prefill_size=512, **cfg) as eng:
        outs = eng.encode(input_ids=prompts)
        if twice:   # the same prompts again: prefix-cache hits leave one-token chunks (decode graphs)
            outs = eng.encode(input_ids=prompts)
        info = eng.get_server_info()
    return outs, info


def _cos(a: list[float], b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0).item()


@gpu
def test_bf16_embeddings_match_hf_fp32_through_graphs_and_cache_hits(gpu_model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (1, 17, 33, 100, 257, 600, 1000)]
    ref = _hf_last_token(gpu_model_dir, prompts)
    outs, info = _encode(gpu_model_dir, prompts)
    assert info["attention_backend"] == "FlashInferBackend" and info["piecewise_cuda_graph_tokens"]
    cos = [_cos(o["embedding"], r) for o, r in zip(outs, ref)]
    assert min(cos) >= 0.999, cos
    again, _ = _encode(gpu_model_dir, prompts, twice=True)
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
    assert min(_cos(o["embedding"], r) for o, r in zip(again, ref)) >= 0.999
    eager, _ = _encode(gpu_model_dir, prompts, disable_cuda_graph=True)
    assert min(_cos(a["embedding"], torch.tensor(b["embedding"])) for a, b in zip(outs, eager)) >= 0.9999
