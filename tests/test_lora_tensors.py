"""``Engine.load_lora_adapter_from_tensors`` (SGLang's): an adapter given as tensors and a config dict serves
exactly as the same adapter loaded from its directory (and as peft), keeps its own copy of the tensors, loads
again after an unload, and refuses bad arguments with a ValueError naming them."""
from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.test_lora import GREEDY, PROMPTS, _engine, hf_greedy, make_adapter

pytest.importorskip("peft")


def _in_memory(adapter_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        return tensors, json.load(f)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tensors")
    return {"a": make_adapter(tiny_llama_dir, str(root / "a"), 1),
            "b": make_adapter(tiny_llama_dir, str(root / "b"), 2, r=8, alpha=16, use_rslora=True)}


@pytest.fixture(scope="module")
def eng(tiny_llama_dir, adapters):
    e = _engine(tiny_llama_dir, enable_lora=True, max_lora_rank=8, max_loras_per_batch=4)
    yield e
    e.shutdown()


def test_tensors_serve_as_the_directory_and_peft(eng, adapters, tiny_llama_dir):
    tensors, config = _in_memory(adapters["b"])
    res = eng.load_lora_adapter_from_tensors("mem", tensors, config)
    assert res.success, res.error_message
    assert res.loaded_adapters["mem"].startswith("<tensors ")
    assert eng.load_lora_adapter("dir", adapters["b"]).success
    try:
        ids = eng.tokenizer.encode(PROMPTS[0])
        got = eng.generate(PROMPTS[0], GREEDY, lora_path="mem")["output_ids"]
        assert got == eng.generate(PROMPTS[0], GREEDY, lora_path="dir")["output_ids"]
        assert got == hf_greedy(tiny_llama_dir, adapters["b"], ids, GREEDY["max_new_tokens"])
        assert got != eng.generate(PROMPTS[0], GREEDY)["output_ids"]        # the adapter changes the output
        for t in tensors.values():       # the caller's tensors change: the engine's copy does not
            t.zero_()
        assert eng.generate(PROMPTS[0], GREEDY, lora_path="mem")["output_ids"] == got
        # unloaded, then named by a request: loaded again from the engine's copy, as a directory would be
        assert eng.unload_lora_adapter("mem").success and "mem" not in eng.list_lora_adapters()
        again = eng.generate(PROMPTS[0], GREEDY, lora_path="mem")
        assert again["output_ids"] == got and "mem" in eng.list_lora_adapters()
    finally:
        for name in ("mem", "dir"):
            if name in eng.list_lora_adapters():
                eng.unload_lora_adapter(name)


def test_pairs_and_the_async_twin(eng, adapters):
    tensors, config = _in_memory(adapters["a"])
    want = None
    assert eng.load_lora_adapter("a_dir", adapters["a"]).success
    try:
        want = eng.generate(PROMPTS[1], GREEDY, lora_path="a_dir")["output_ids"]
        assert eng.load_lora_adapter_from_tensors("pairs", list(tensors.items()), config).success
        res = asyncio.run(eng.async_load_lora_adapter_from_tensors("async", tensors, config))
        assert res.success, res.error_message
        for name in ("pairs", "async"):
            assert eng.generate(PROMPTS[1], GREEDY, lora_path=name)["output_ids"] == want
    finally:
        for name in ("a_dir", "pairs", "async"):
            if name in eng.list_lora_adapters():
                eng.unload_lora_adapter(name)


@pytest.mark.parametrize("kwargs, match", [
    ({"load_format": "flattened_bucket"}, "load_format"),
    ({"config_dict": "adapter_config.json"}, "config_dict"),
    ({"tensors": {}}, "tensors"),
    ({"tensors": {"w": [1.0, 2.0]}}, "tensors"),
    ({"tensors": 3}, "tensors"),
    ({"pinned": "yes"}, "pinned"),
    ({"lora_name": ""}, "lora_name"),
])
def test_bad_arguments_raise_naming_them(eng, adapters, kwargs, match):
    tensors, config = _in_memory(adapters["a"])
    args = {"lora_name": "bad", "tensors": tensors, "config_dict": config, **kwargs}
    with pytest.raises(ValueError, match=match):
        eng.load_lora_adapter_from_tensors(**args)
    assert "bad" not in eng.list_lora_adapters()


def test_refused_adapters_answer_why_and_the_engine_goes_on(eng, adapters):
    tensors, config = _in_memory(adapters["a"])
    no_rank = {k: v for k, v in config.items() if k != "r"}
    res = eng.load_lora_adapter_from_tensors("x", tensors, no_rank)
    assert not res.success and "r >= 1" in res.error_message
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    wrong = {**tensors, key: torch.zeros(4, 3)}
    res = eng.load_lora_adapter_from_tensors("x", wrong, config)
    assert not res.success and "another base model" in res.error_message
    res = eng.load_lora_adapter_from_tensors("x", {"model.embed_tokens.lora_A.weight": torch.zeros(4, 4)}, config)
    assert not res.success and "not supported" in res.error_message
    assert "x" not in eng.list_lora_adapters()
    assert eng.generate(PROMPTS[2], {**GREEDY, "ignore_eos": True})["meta_info"]["completion_tokens"] == 10
