"""Engine(is_embedding=True).encode / async_encode against HF transformers (fp32, tiny random models).

The reference is ``AutoModel`` (the base model: final-normed last hidden states) with the pooling
the model directory declares, computed here: last token / mean / first token, Matryoshka truncation,
then L2 normalisation.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
import torch

import nbgen

TEXTS = ["Hello, my name is nbgen and I generate text in notebooks.",
         "The capital of France is Paris.",
         "def add(a, b):\n    return a + b\n",
         "x"]
LONG = " ".join(["The capital of France is Paris. The capital of Japan is Tokyo."] * 6)   # > 64 tokens


def _engine(model_dir: str, **kw) -> nbgen.Engine:
    return nbgen.Engine(model_dir, dtype="float32", device="cpu", is_embedding=True, **kw)


def hf_embed(model_dir: str, ids: list[int], mode: str = "last", normalize: bool = True,
             dims: int | None = None) -> torch.Tensor:
    """The reference vector: AutoModel's last_hidden_state pooled as declared."""
    from transformers import AutoModel

    hf = _hf_cache.get(model_dir)
    if hf is None:
        hf = _hf_cache[model_dir] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0]                 # [L, H]
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[mode]
    if dims is not None:
        v = v[:dims]
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


_hf_cache: dict[str, object] = {}


def assert_close(got: list[float], ref: torch.Tensor) -> None:
    g = torch.tensor(got, dtype=torch.float32)
    assert g.shape == ref.shape
    assert (g - ref).abs().max().item() <= 1e-4
    assert torch.nn.functional.cosine_similarity(g, ref, dim=0).item() >= 0.99999


def st_dir(src: str, dst: str, mode: str, normalize: bool, **config_keys) -> str:
    """A copy of ``src`` laid out as a sentence-transformers model with ``mode`` pooling."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(dst, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(dst, "1_Pooling"))
    with open(os.path.join(dst, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": mode == "cls",
                   "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
                   "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                   "pooling_mode_lasttoken": mode == "last", "include_prompt": True}, f)
    if config_keys:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(config_keys)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


@pytest.fixture(scope="module")
def emb_llama(tiny_llama_dir):
    eng = _engine(tiny_llama_dir, chunked_prefill_size=32)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_encode_matches_hf_default_last_token_pooling(family, request):
    """No modules.json: the causal-LM default (last token, normalised); a batch mixing lengths,
    one prompt longer than the chunk budget (32 tokens)."""
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    with _engine(model_dir, chunked_prefill_size=32) as eng:
        texts = TEXTS + [LONG]
        outs = eng.encode(texts)
        assert eng.pooling.mode == "last" and eng.pooling.normalize and eng.pooling.source == "default"
    assert isinstance(outs, list) and len(outs) == len(texts)
    for text, out in zip(texts, outs):
        ids = eng.tokenizer.encode(text)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert_close(out["embedding"], hf_embed(model_dir, ids))
    assert len(eng.tokenizer.encode(LONG)) > 32


def test_str_rid_of_a_batch_gets_an_index_suffix(emb_llama):
    outs = emb_llama.encode(["a b", "c"], rid="emb")
    assert [o["meta_info"]["id"] for o in outs] == ["emb_0", "emb_1"]
    with pytest.raises(ValueError, match="rid 'x' appears more than once in the call"):
        emb_llama.encode(["a", "b"], rid=["x", "x"])
    for bad in (5, ["x", 7]):                              # SGLang: ValueError for a rid of another type
        with pytest.raises(ValueError, match="rid must be a str or a list of str"):
            emb_llama.encode(["a", "b"], rid=bad)


def test_output_shape_single_and_meta(emb_llama):
    out = emb_llama.encode("Hello, my name is", rid="r-1")
    assert set(out) == {"embedding", "meta_info"}
    assert isinstance(out["embedding"], list) and len(out["embedding"]) == 64
    meta = out["meta_info"]
    assert meta["id"] == "r-1" and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["prompt_tokens"] == len(emb_llama.tokenizer.encode("Hello, my name is"))
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    one = emb_llama.encode(input_ids=[5, 6, 7])
    assert isinstance(one, dict) and one["meta_info"]["prompt_tokens"] == 3
    two = emb_llama.encode(input_ids=[[5, 6, 7], [8, 9]])
    assert [o["meta_info"]["prompt_tokens"] for o in two] == [3, 2]
    assert two[0]["embedding"] == pytest.approx(one["embedding"], abs=1e-5)
    assert emb_llama.get_tokenizer() is emb_llama.tokenizer
    assert emb_llama.get_model_info()["is_generation"] is False


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_modes_from_sentence_transformers_config(mode, normalize, tiny_llama_dir, tmp_path):
    d = st_dir(tiny_llama_dir, str(tmp_path / "st"), mode, normalize)
    texts = TEXTS + [LONG]
    with _engine(d, chunked_prefill_size=32) as eng:
        assert (eng.pooling.mode, eng.pooling.normalize, eng.pooling.source) == (mode, normalize, "modules.json")
        outs = eng.encode(texts)
    for text, out in zip(texts, outs):
        assert_close(out["embedding"], hf_embed(d, eng.tokenizer.encode(text), mode, normalize))
    if not normalize:
        assert abs(sum(x * x for x in outs[0]["embedding"]) - 1.0) > 1e-3


def test_prefix_cache_last_token_pooling(emb_llama, tiny_llama_dir):
    """The same 100+-token text twice: the second request reuses cached pages, same vector."""
    text = "Prefix cache check. " + LONG
    first = emb_llama.encode(text)
    second = emb_llama.encode(text)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["embedding"] == pytest.approx(first["embedding"], abs=1e-5)
    assert_close(second["embedding"], hf_embed(tiny_llama_dir, emb_llama.tokenizer.encode(text)))


def test_mean_pooling_never_reuses_cached_pages(tiny_llama_dir, tmp_path):
    d = st_dir(tiny_llama_dir, str(tmp_path / "st"), "mean", True)
    with _engine(d) as eng:
        a, b = eng.encode(LONG), eng.encode(LONG)
    assert a["meta_info"]["cached_tokens"] == b["meta_info"]["cached_tokens"] == 0
    assert b["embedding"] == pytest.approx(a["embedding"], abs=1e-5)


def test_matryoshka_dimensions_truncate_then_normalise(tiny_llama_dir, tmp_path):
    d = st_dir(tiny_llama_dir, str(tmp_path / "st"), "last", True, matryoshka_dimensions=[16, 32, 64])
    with _engine(d) as eng:
        outs = eng.encode(TEXTS[:2], dimensions=32)
        full = eng.encode(TEXTS[0])
        with pytest.raises(ValueError, match=r"dimensions=48.*\[16, 32, 64\]"):
            eng.encode(TEXTS[0], dimensions=48)
        assert len(eng.encode(TEXTS[0], dimensions=16)["embedding"]) == 16   # still serving
    assert len(full["embedding"]) == 64
    for text, out in zip(TEXTS[:2], outs):
        assert len(out["embedding"]) == 32
        assert_close(out["embedding"], hf_embed(d, eng.tokenizer.encode(text), dims=32))


def test_dimensions_errors_name_the_parameter(tiny_llama_dir, tmp_path, emb_llama):
    with pytest.raises(ValueError, match="dimensions=8.*matryoshka"):
        emb_llama.encode("hi", dimensions=8)
    d = st_dir(tiny_llama_dir, str(tmp_path / "st"), "last", True, is_matryoshka=True)
    with _engine(d) as eng:
        for bad in (0, -3):
            with pytest.raises(ValueError, match="dimensions must be >= 1"):
                eng.encode("hi", dimensions=bad)
        with pytest.raises(ValueError, match="dimensions=65 is larger than the model's hidden size 64"):
            eng.encode("hi", dimensions=65)
        with pytest.raises(ValueError, match="dimensions must be an int"):
            eng.encode("hi", dimensions=8.0)
        out = eng.encode("hi", dimensions=8)                  # any size up to hidden with is_matryoshka
        assert len(out["embedding"]) == 8
        assert_close(out["embedding"], hf_embed(d, eng.tokenizer.encode("hi"), dims=8))


@pytest.mark.parametrize("name", ["image_data", "audio_data", "video_data", "lora_path"])
def test_unsupported_arguments_raise_and_engine_keeps_serving(emb_llama, name):
    with pytest.raises(ValueError, match=name):
        emb_llama.encode("hi", **{name: "x"})
    with pytest.raises(ValueError, match=name):
        asyncio.run(emb_llama.async_encode("hi", **{name: "x"}))
    assert len(emb_llama.encode("hi")["embedding"]) == 64


def test_generate_on_embedding_engine_and_encode_on_generative_engine(emb_llama, tiny_engine):
    for call in (lambda: emb_llama.generate("hi"), lambda: emb_llama.score("q", ["a"], [1, 2]),
                 lambda: asyncio.run(emb_llama.async_generate("hi"))):
        with pytest.raises(ValueError, match="is_embedding=True"):
            call()
    with pytest.raises(ValueError, match=r"is_embedding=True.*tokenizer\.encode"):
        tiny_engine.encode("hi")
    assert len(tiny_engine.generate("hi", {"max_new_tokens": 2, "ignore_eos": True})["output_ids"]) == 2
    assert len(emb_llama.encode("hi")["embedding"]) == 64


def test_bad_inputs_raise_value_errors(emb_llama):
    with pytest.raises(ValueError, match="exactly one of prompt or input_ids"):
        emb_llama.encode()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        emb_llama.encode(input_ids=[1, 10**6])
    with pytest.raises(ValueError, match="over the context length"):
        emb_llama.encode(input_ids=[1] * 1024)
    with pytest.raises(TypeError, match=r"prompt\[1\]"):
        emb_llama.encode(["ok", {"role": "user"}])
    assert len(emb_llama.encode(["a", "b"])) == 2


def test_async_encode_equals_encode(emb_llama):
    sync = emb_llama.encode(TEXTS)
    got = asyncio.run(emb_llama.async_encode(TEXTS))
    for s, a in zip(sync, got):
        assert a["embedding"] == pytest.approx(s["embedding"], abs=1e-5)
    one = asyncio.run(emb_llama.async_encode(TEXTS[0]))
    assert isinstance(one, dict) and one["embedding"] == pytest.approx(sync[0]["embedding"], abs=1e-5)


def test_encode_iter_yields_every_index(emb_llama):
    got = dict(emb_llama.encode_iter(TEXTS))
    assert sorted(got) == list(range(len(TEXTS)))
    ref = emb_llama.encode(TEXTS[2])
    assert got[2]["embedding"] == pytest.approx(ref["embedding"], abs=1e-5)


def test_base_model_checkpoint_loads(tiny_qwen3_dir, tmp_path):
    """An embedding model saved as the base model (no ``model.`` prefix, no lm_head), like
    Qwen3-Embedding: the same vectors as the full checkpoint; generation refuses it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = str(tmp_path / "base")
    AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).model.save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_qwen3_dir).save_pretrained(base)
    with open(os.path.join(base, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3Model"]
    with _engine(base) as eng:
        got = eng.encode(TEXTS)
    for text, out in zip(TEXTS, got):
        assert_close(out["embedding"], hf_embed(tiny_qwen3_dir, eng.tokenizer.encode(text)))
    with pytest.raises(ValueError, match="is_embedding=True"):
        nbgen.Engine(base, dtype="float32", device="cpu")


def test_unsupported_sentence_transformers_modules_fail_at_start(tiny_llama_dir, tmp_path):
    d = st_dir(tiny_llama_dir, str(tmp_path / "st"), "last", False)
    with open(os.path.join(d, "modules.json")) as f:
        modules = json.load(f)
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    with open(os.path.join(d, "modules.json"), "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match="Dense"):
        _engine(d)


# ---- SGLang's test/srt/test_srt_engine.py, rewritten in import and model path only ------------------
def test_2_engine_runtime_encode_consistency(tiny_qwen2_dir):
    """SGLang compares Engine with its HTTP Runtime; nbgen has no Runtime, so the second engine is a
    fresh Engine (same model and seed)."""
    import nbgen as sgl

    prompt = "Today is a sunny day and I like"
    model_path = tiny_qwen2_dir

    engine = sgl.Engine(model_path=model_path, is_embedding=True, random_seed=42)
    out1 = torch.tensor(engine.encode(prompt)["embedding"])
    engine.shutdown()

    runtime = sgl.Engine(model_path=model_path, is_embedding=True, random_seed=42)
    out2 = torch.tensor(runtime.encode(prompt)["embedding"])
    runtime.shutdown()

    assert torch.allclose(out1, out2, atol=1e-5, rtol=1e-3)


def test_8_engine_async_encode_consistency(tiny_qwen2_dir):
    import nbgen as sgl

    prompt = "Today is a sunny day and I like"
    model_path = tiny_qwen2_dir

    engine = sgl.Engine(
        model_path=model_path,
        is_embedding=True,
        random_seed=42,
        disable_radix_cache=True,
    )

    # Get sync and async embeddings
    out1 = torch.tensor(engine.encode(prompt)["embedding"])
    loop = asyncio.get_event_loop()
    out2 = torch.tensor(
        loop.run_until_complete(engine.async_encode(prompt))["embedding"]
    )

    engine.shutdown()

    assert torch.allclose(out1, out2, atol=1e-5, rtol=1e-3), "Sync and async embeddings are not equal within tolerance"


# ---- SGLang's examples/runtime/engine/embedding.py: the import and the model path changed, a shutdown added ---
def test_sglang_embedding_example(tiny_qwen2_dir, capsys):
    import nbgen as sgl

    def main():
        # Sample prompts.
        prompts = [
            "Hello, my name is",
            "The president of the United States is",
            "The capital of France is",
            "The future of AI is",
        ]
        # Create an LLM.
        llm = sgl.Engine(
            model_path=tiny_qwen2_dir, is_embedding=True
        )

        outputs = llm.encode(prompts)
        # Print the outputs (embedding vectors)
        for prompt, output in zip(prompts, outputs):
            print("===============================")
            print(f"Prompt: {prompt}\nEmbedding vector: {output['embedding']}")
        llm.shutdown()
        return outputs

    outputs = main()
    printed = capsys.readouterr().out
    assert printed.count("Embedding vector: [") == 4 and "Prompt: The capital of France is" in printed
    hidden = json.load(open(os.path.join(tiny_qwen2_dir, "config.json")))["hidden_size"]
    for o in outputs:
        v = torch.tensor(o["embedding"])
        assert v.shape == (hidden,) and abs(v.norm().item() - 1.0) < 1e-4   # last token, normalised (SGLang's default)
