"""Shared fixtures: tiny random HF models saved with save_pretrained, and GPU/slow markers."""
from __future__ import annotations

import os

import pytest

from tests.tiny_models import make_tiny_model  # noqa: F401  (re-exported for tests)


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return make_tiny_model("qwen2", str(tmp_path_factory.mktemp("tiny_qwen2")))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return make_tiny_model("qwen3", str(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir):
    """One fp32 Engine on the tiny Llama shared by the API tests."""
    import nbgen

    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device=os.environ.get("NBGEN_TEST_DEVICE", "cpu"),
                       random_seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def device() -> str:
    return os.environ.get("NBGEN_TEST_DEVICE", "cpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-cases", type=int, default=300,
                     help="number of seeded cases tests/test_fuzz.py runs (default 300)")


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def gpu_model_dir(request, tmp_path_factory) -> str:
    """A random Llama / Qwen2 / Qwen3 with head_dim 128 (tests.tiny_models.make_gpu_model) per family."""
    from tests.tiny_models import make_gpu_model

    return make_gpu_model(request.param, str(tmp_path_factory.mktemp(request.param)))
