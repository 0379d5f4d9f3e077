"""Engine argument values as SGLang code passes them: SGLang's other spellings and None defaults,
wrong kinds refused up front naming the argument, and the keys of get_model_info / get_server_info
that SGLang code reads (tiny Llama, CPU)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import nbgen
from nbgen.core.config import EngineConfig

DEVICE = os.environ.get("NBGEN_TEST_DEVICE", "cpu")


@pytest.mark.parametrize("kw, name, want", [({"dtype": "half"}, "dtype", "float16"),
                                            ({"dtype": "float"}, "dtype", "float32"),
                                            ({"attention_backend": "torch_native"}, "attention_backend", "torch"),
                                            ({"mem_fraction_static": None}, "mem_fraction_static", 0.85)])
def test_sglang_spellings_and_none_defaults(kw: dict[str, Any], name: str, want: Any) -> None:
    assert getattr(EngineConfig.from_kwargs(None, kw), name) == want


def test_random_seed_none_draws_one() -> None:
    seed = EngineConfig.from_kwargs(None, {"random_seed": None}).random_seed
    assert isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= 1 << 30


def test_paths_take_pathlike(tmp_path: Path) -> None:
    cfg = EngineConfig.from_kwargs(tmp_path / "model", {"tokenizer_path": tmp_path / "tok"})
    assert cfg.model_path == str(tmp_path / "model") and cfg.tokenizer_path == str(tmp_path / "tok")


@pytest.mark.parametrize("kw", [{"disable_radix_cache": "false"}, {"trust_remote_code": 1},
                                {"skip_tokenizer_init": "no"}, {"is_embedding": "yes"},
                                {"disable_cuda_graph": None}, {"disable_overlap_schedule": "x"},
                                {"context_length": True}, {"max_total_tokens": True}, {"page_size": True},
                                {"max_running_requests": 2.0}, {"mem_fraction_static": "0.8"},
                                {"mem_fraction_static": True}, {"random_seed": "7"}, {"random_seed": 1.5},
                                {"log_level": "verbose"}, {"log_level": None}, {"tokenizer_path": 5},
                                {"dtype": "fp16"}, {"attention_backend": "triton"}])
def test_wrong_kinds_raise_naming_the_argument(kw: dict[str, Any]) -> None:
    (name,) = kw
    with pytest.raises(ValueError, match=f"^{name} must be"):
        EngineConfig.from_kwargs(None, kw)


def test_model_path_of_another_kind_raises() -> None:
    with pytest.raises(ValueError, match="^model_path must be"):
        EngineConfig.from_kwargs(123, {})   # type: ignore[arg-type]


def test_log_level_takes_any_case() -> None:
    assert EngineConfig.from_kwargs(None, {"log_level": "INFO"}).log_level == "INFO"


def test_server_args_object_is_explained() -> None:
    with pytest.raises(ValueError, match="server_args .*keyword arguments"):
        nbgen.Engine(server_args=object())


@pytest.fixture(scope="module")
def sglang_spelled(tiny_llama_dir: str):
    """An engine built with SGLang's spellings: dtype 'float', attention_backend 'torch_native'."""
    e = nbgen.Engine(tiny_llama_dir, dtype="float", attention_backend="torch_native", device=DEVICE,
                     mem_fraction_static=None, random_seed=None, log_level="WARNING")
    yield e
    e.shutdown()


def test_engine_with_sglang_spellings(sglang_spelled) -> None:
    assert sglang_spelled.dtype == torch.float32
    info = sglang_spelled.get_server_info()
    assert info["dtype"] == "torch.float32" and isinstance(info["random_seed"], int)
    out = sglang_spelled.generate("hi", {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 2


@pytest.mark.filterwarnings("ignore:.*other nbgen Engine")
def test_model_info_keys_sglang_reads(tiny_engine) -> None:
    """SGLang's /model_info: tokenizer_path is the model path when not given, model_type and the
    image / audio flags, preferred_sampling_params."""
    info = tiny_engine.get_model_info()
    assert info["tokenizer_path"] == tiny_engine.config.model_path
    assert info["model_type"] == "llama"
    assert info["has_image_understanding"] is False and info["has_audio_understanding"] is False
    assert "preferred_sampling_params" in info and info["preferred_sampling_params"] is None
    assert tiny_engine.get_server_info()["tokenizer_path"] == tiny_engine.config.model_path
