"""CPU weight offloading (``cpu_offload_gb``, nbgen.models.cpu_offload).

CPU tests move layers of a loaded model onto shared staging tensors with host copies (unpinned: the
mechanism is the same) and check the logits against the model before the move and against HF; a
control run without the stage-in hook shows the staging really carries each layer's weights. The
GPU test runs an engine with offloaded layers (decode and prefill CUDA graphs capture the copies)
against the same model without offloading.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import nbgen
from nbgen.core.config import EngineConfig
from nbgen.models import cpu_offload
from nbgen.models.loader import load_model
from tests.test_models import _hf_model, _run
from tests.tiny_models import GREEDY_SP, assert_close_runs, gpu_generate, gpu_prompts, make_gpu_model, make_tiny_model

gpu = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(300) for _ in range(n)] for n in (11, 4, 23)]


@pytest.mark.parametrize("cls_name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_offloaded_layers_match_before_and_hf(tmp_path: Path, cls_name: str) -> None:
    hf = _hf_model(cls_name, num_hidden_layers=4)
    hf.save_pretrained(tmp_path)
    loaded = load_model(EngineConfig(model_path=str(tmp_path), dtype="float32", device="cpu"), torch.device("cpu"))
    layers = loaded.model.model.layers
    before = _run(loaded, _prompts())
    plan = cpu_offload.move_layers(layers, [1, 3], pin_memory=False)
    assert plan.layers == [1, 3] and plan.host_bytes == 2 * plan.staging_bytes > 0
    # both offloaded layers now read one set of device tensors; the others keep their own
    q1, q3 = (layers[i].self_attn.qkv_proj.weight for i in (1, 3))
    assert q1.data_ptr() == q3.data_ptr() != layers[0].self_attn.qkv_proj.weight.data_ptr()
    got = _run(loaded, _prompts())
    assert torch.equal(got, before)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in _prompts()])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # control: without the hook the staging keeps the last layer staged, and layer 1 runs layer 3's weights
    hook, layers[1].stage_in = layers[1].stage_in, None
    assert not torch.allclose(_run(loaded, _prompts()), before, atol=1e-3)
    layers[1].stage_in = hook
    assert torch.equal(_run(loaded, _prompts()), before)


def test_plan_takes_whole_last_layers(tmp_path: Path) -> None:
    hf = _hf_model("LlamaForCausalLM", num_hidden_layers=4)
    hf.save_pretrained(tmp_path)
    layers = load_model(EngineConfig(model_path=str(tmp_path), dtype="float32", device="cpu"),
                        torch.device("cpu")).model.model.layers
    per = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    assert cpu_offload.plan_layers(layers, per - 1) == []
    assert cpu_offload.plan_layers(layers, 2 * per + per // 2) == [2, 3]
    assert cpu_offload.plan_layers(layers, 100 * per) == [0, 1, 2, 3]


def test_arguments(tmp_path: Path) -> None:
    for bad in (-1, "1", True):
        with pytest.raises(ValueError, match="cpu_offload_gb"):
            EngineConfig(cpu_offload_gb=bad).validate()
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        EngineConfig(cpu_offload_gb=1, enable_lora=True).validate()
    path = make_tiny_model("llama", str(tmp_path / "m"))
    with nbgen.Engine(path, device="cpu", cpu_offload_gb=1) as eng:      # weights live on the host already
        out = eng.generate("hello", {"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 4
        assert eng.get_server_info()["cpu_offload"] == {}
        with pytest.raises(ValueError, match="cpu_offload_gb"):
            eng.update_weights_from_disk(path)
        with pytest.raises(ValueError, match="cpu_offload_gb"):
            eng.get_weights_by_name("model.norm.weight")
        assert eng.generate("hello", {"max_new_tokens": 4, "temperature": 0})["output_ids"] == out["output_ids"]


@gpu
def test_gpu_engine_with_offloaded_layers(tmp_path: Path) -> None:
    path = make_gpu_model("llama", str(tmp_path / "m"))
    prompts = gpu_prompts()
    base = gpu_generate(path, prompts, logprobs=True)
    with nbgen.Engine(path, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, cpu_offload_gb=100,
                      mem_fraction_static=0.3) as eng:
        info = eng.get_server_info()
        off = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, use_tqdm=False)
    assert info["cuda_graph_batch_sizes"] and info["piecewise_cuda_graph_tokens"]
    n_layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
    assert info["cpu_offload"]["layers"] == list(range(n_layers))
    assert info["cpu_offload"]["host_gb"] == pytest.approx(
        n_layers * info["cpu_offload"]["staging_gb"], rel=1e-2)
    assert_close_runs(base, off)
