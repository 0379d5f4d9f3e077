"""encode / async_encode arguments as SGLang's Engine takes them: its signature, tracing headers,
lists of None for the multimodal and LoRA arguments, numpy integers for ``dimensions``."""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil

import numpy as np
import pytest

import nbgen

# SGLang's Engine.encode(prompt, image_data, audio_data, video_data, dimensions, lora_path,
# external_trace_header, rid) (python/sglang/srt/entrypoints/engine.py)
SGLANG_ENCODE = ["prompt", "image_data", "audio_data", "video_data", "dimensions", "lora_path",
                 "external_trace_header", "rid"]


@pytest.fixture(scope="module")
def emb(tiny_llama_dir):
    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", is_embedding=True)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("name", ["encode", "async_encode"])
def test_encode_signature_starts_with_sglangs(name):
    params = list(inspect.signature(getattr(nbgen.Engine, name)).parameters)[1:]
    assert params[:len(SGLANG_ENCODE)] == SGLANG_ENCODE


def test_external_trace_header_is_accepted(emb):
    header = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    ref = emb.encode(["a b", "c"])
    got = emb.encode(["a b", "c"], external_trace_header=header, rid=["t0", "t1"])
    assert [o["meta_info"]["id"] for o in got] == ["t0", "t1"]
    for r, g in zip(ref, got):
        assert g["embedding"] == pytest.approx(r["embedding"], abs=1e-5)
    one = asyncio.run(emb.async_encode("a b", external_trace_header=header))
    assert one["embedding"] == pytest.approx(ref[0]["embedding"], abs=1e-5)


@pytest.mark.parametrize("name", ["image_data", "audio_data", "video_data", "lora_path"])
def test_lists_of_none_mean_not_given(emb, name):
    """SGLang reads ``lora_path=[None, None]`` as the base model for both prompts and a list of None
    as no media (``has_valid_data``); one real entry still raises, naming the argument."""
    ref = emb.encode(["a b", "c"])
    got = emb.encode(["a b", "c"], **{name: [None, None]})
    for r, g in zip(ref, got):
        assert g["embedding"] == pytest.approx(r["embedding"], abs=1e-5)
    assert len(asyncio.run(emb.async_encode(["a b", "c"], **{name: [None, [None]]}))) == 2
    with pytest.raises(ValueError, match=name):
        emb.encode(["a b", "c"], **{name: [None, "x"]})


def test_numpy_integer_dimensions(tiny_llama_dir, tmp_path):
    d = str(tmp_path / "mat")
    shutil.copytree(tiny_llama_dir, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "matryoshka_dimensions": [8, 16, 64]}, f)
    with nbgen.Engine(d, dtype="float32", device="cpu", is_embedding=True) as eng:
        ref = eng.encode("hello there", dimensions=16)["embedding"]
        got = eng.encode("hello there", dimensions=np.int64(16))["embedding"]
        assert len(got) == 16 and got == pytest.approx(ref, abs=1e-6)
        with pytest.raises(ValueError, match=r"dimensions=32.*\[8, 16, 64\]"):
            eng.encode("hello there", dimensions=np.int32(32))
        for bad in (np.float64(16.0), True):
            with pytest.raises(ValueError, match="dimensions must be an int"):
                eng.encode("hello there", dimensions=bad)
