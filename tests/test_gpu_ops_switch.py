"""The fused GPU ops' switch (kernels/gpu_ops.py) belongs to the calling thread: each engine's loop thread sets its
own, so a bf16 flashinfer engine and an fp32 / torch-backend engine of the same process do not change each other's
kernels; and the fused kernels (bf16 / fp16 only) serve half-precision CUDA tensors only."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import nbgen
from nbgen.kernels import gpu_ops
from tests.tiny_models import GREEDY_SP, gpu_prompts

# stand-ins for CUDA tensors: fused_enabled reads only where a tensor lives and its dtype
CUDA_BF16 = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)


def test_the_switch_serves_half_precision_cuda_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_ops._SWITCH, "on", True)
    assert gpu_ops.fused_enabled(CUDA_BF16)
    assert gpu_ops.fused_enabled(SimpleNamespace(is_cuda=True, dtype=torch.float16))
    assert not gpu_ops.fused_enabled(SimpleNamespace(is_cuda=True, dtype=torch.float32))
    assert not gpu_ops.fused_enabled(torch.zeros(2, dtype=torch.bfloat16))          # a CPU tensor
    monkeypatch.setattr(gpu_ops._SWITCH, "on", False)
    assert not gpu_ops.fused_enabled(CUDA_BF16)


def test_the_switch_is_the_calling_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread turning the switch off (as a torch-backend engine's loop thread does) leaves another thread's
    on; a thread that never set it reads off."""
    monkeypatch.setattr(gpu_ops._SWITCH, "on", True)                 # this thread: a flashinfer engine's
    seen: dict[str, bool] = {}
    other_set = threading.Event()
    main_checked = threading.Event()

    def other() -> None:
        seen["fresh"] = gpu_ops.fused_enabled(CUDA_BF16)
        seen["set_off"] = gpu_ops.enable_fused(False)
        other_set.set()
        main_checked.wait(30)
        seen["after"] = gpu_ops.fused_enabled(CUDA_BF16)

    t = threading.Thread(target=other)
    t.start()
    assert other_set.wait(30)
    assert gpu_ops.fused_enabled(CUDA_BF16)                          # still on here
    main_checked.set()
    t.join(30)
    assert seen == {"fresh": False, "set_off": False, "after": False}
    assert gpu_ops.fused_enabled(CUDA_BF16)


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


@pytest.mark.gpu
def test_gpu_a_bf16_engine_keeps_its_fused_ops_beside_a_torch_backend_engine(gpu_model_dir: str) -> None:
    """A bf16 flashinfer engine, then an fp32 CUDA engine (torch attention, its loop thread's switch off): the
    bf16 engine's loop thread still reads the switch on, and its outputs are unchanged."""
    prompts = gpu_prompts(4)
    probe = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    with nbgen.Engine(gpu_model_dir, dtype="bfloat16", device="cuda", cuda_graph_max_bs=16) as bf16:
        before = [o["output_ids"] for o in bf16.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False)]
        assert bf16.loop.call(lambda: gpu_ops.fused_enabled(probe))
        with nbgen.Engine(gpu_model_dir, dtype="float32", device="cuda") as fp32:
            assert not fp32.loop.call(lambda: gpu_ops.fused_enabled(probe))
            assert bf16.loop.call(lambda: gpu_ops.fused_enabled(probe))
            after = [o["output_ids"] for o in bf16.generate(input_ids=prompts, sampling_params=GREEDY_SP,
                                                            use_tqdm=False)]
    assert after == before
