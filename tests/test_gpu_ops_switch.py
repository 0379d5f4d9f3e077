"""The fused GPU ops' switch (kernels/gpu_ops.py) is the process's: a bf16 engine turns it on while an fp32 engine
of the same process keeps running, so the fused kernels (bf16 / fp16 only) must serve half-precision tensors only."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import nbgen
from nbgen.kernels import gpu_ops
from tests.tiny_models import GREEDY_SP, gpu_prompts


def test_the_switch_serves_half_precision_cuda_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_ops, "_ENABLED", True)
    # stand-ins for CUDA tensors: fused_enabled reads only where a tensor lives and its dtype
    assert gpu_ops.fused_enabled(SimpleNamespace(is_cuda=True, dtype=torch.bfloat16))
    assert gpu_ops.fused_enabled(SimpleNamespace(is_cuda=True, dtype=torch.float16))
    assert not gpu_ops.fused_enabled(SimpleNamespace(is_cuda=True, dtype=torch.float32))
    assert not gpu_ops.fused_enabled(torch.zeros(2, dtype=torch.bfloat16))          # a CPU tensor
    monkeypatch.setattr(gpu_ops, "_ENABLED", False)
    assert not gpu_ops.fused_enabled(SimpleNamespace(is_cuda=True, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_gpu_an_fp32_engine_keeps_serving_beside_a_bf16_engine(gpu_model_dir: str) -> None:
    """An fp32 CUDA engine (torch attention) created first, then a bf16 one (flashinfer, the fused ops on):
    the fp32 engine's next outputs equal its first ones (its norms did not move to the bf16-only kernels)."""
    prompts = gpu_prompts(4)
    with nbgen.Engine(gpu_model_dir, dtype="float32", device="cuda") as fp32:
        before = [o["output_ids"] for o in fp32.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False)]
        with nbgen.Engine(gpu_model_dir, dtype="bfloat16", device="cuda", cuda_graph_max_bs=16) as bf16:
            assert bf16.get_server_info()["attention_backend"] == "FlashInferBackend"
            bf16.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False)
            after = [o["output_ids"] for o in fp32.generate(input_ids=prompts, sampling_params=GREEDY_SP,
                                                            use_tqdm=False)]
    assert after == before
