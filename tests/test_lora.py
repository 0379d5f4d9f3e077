"""LoRA serving (issue #26): peft adapters built here on tiny random models, nbgen's greedy output
token-identical to HF ``PeftModel`` (fp32, CPU); mixed batches; load / unload; errors; prefix-cache
isolation between adapters."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

import nbgen

peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The capital of France", "Hello, my name is", "def add(a, b):"]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0}


def make_adapter(base_dir: str, out_dir: str, seed: int, r: int = 4, alpha: int = 8,
                 targets: list[str] = ALL_TARGETS, use_rslora: bool = False) -> str:
    """A random peft LoRA adapter for ``base_dir`` (lora_B randomised so that it changes outputs)."""
    import transformers as tf

    if os.path.isdir(out_dir):
        return out_dir
    model = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora)
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    pm.save_pretrained(out_dir)
    return out_dir


def hf_greedy(base_dir: str, adapter_dir: str | None, prompt_ids: list[int], n: int, merge: bool = False) -> list[int]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
        if merge:
            model = model.merge_and_unload()
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def _engine(model_dir: str, **kw) -> nbgen.Engine:
    return nbgen.Engine(model_dir, dtype="float32", device="cpu", **kw)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: make_adapter(tiny_llama_dir, str(root / name), seed, r=r, alpha=alpha, use_rslora=rs)
            for name, seed, r, alpha, rs in (("a", 1, 4, 8, False), ("b", 2, 8, 16, True), ("c", 3, 2, 4, False))}


@pytest.fixture(scope="module")
def lora_engine(tiny_llama_dir, adapters):
    e = _engine(tiny_llama_dir, lora_paths=[f"a={adapters['a']}", {"lora_name": "b", "lora_path": adapters["b"]}],
                max_loras_per_batch=4)
    yield e
    e.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_parity_with_peft(family, request, tmp_path):
    base = request.getfixturevalue(f"tiny_{family}_dir")
    ad = make_adapter(base, str(tmp_path / "ad"), seed=5, r=4, alpha=8)
    e = _engine(base, lora_paths=[f"x={ad}"])
    try:
        tok = e.get_tokenizer()
        for prompt in PROMPTS[:2]:
            ids = tok.encode(prompt)
            want = hf_greedy(base, ad, ids, GREEDY["max_new_tokens"])
            got = e.generate(input_ids=ids, sampling_params=GREEDY, lora_path="x")["output_ids"]
            assert got == want, (family, prompt)
            assert got == hf_greedy(base, ad, ids, GREEDY["max_new_tokens"], merge=True)
            base_out = e.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
            assert base_out == hf_greedy(base, None, ids, GREEDY["max_new_tokens"])
            assert base_out != got      # the adapter changes the output
    finally:
        e.shutdown()


def test_rslora_and_partial_targets(tiny_llama_dir, tmp_path):
    ad = make_adapter(tiny_llama_dir, str(tmp_path / "rs"), seed=7, r=8, alpha=4, use_rslora=True,
                      targets=["q_proj", "v_proj", "down_proj"])
    e = _engine(tiny_llama_dir, enable_lora=True)
    try:
        res = e.load_lora_adapter("rs", ad)
        assert res.success and res.loaded_adapters == {"rs": ad}
        ids = e.get_tokenizer().encode(PROMPTS[0])
        got = e.generate(input_ids=ids, sampling_params=GREEDY, lora_path="rs")["output_ids"]
        assert got == hf_greedy(tiny_llama_dir, ad, ids, GREEDY["max_new_tokens"])
    finally:
        e.shutdown()


def test_mixed_batch_equals_alone(lora_engine, adapters):
    assert lora_engine.load_lora_adapter("c", adapters["c"]).success
    try:
        names = ["a", None, "b", "c", "a", None]
        prompts = [PROMPTS[i % 3] for i in range(len(names))]
        together = lora_engine.generate(prompts, GREEDY, lora_path=names)
        for p, name, out in zip(prompts, names, together):
            alone = lora_engine.generate(p, GREEDY, lora_path=name)
            assert out["output_ids"] == alone["output_ids"], name
        assert len({tuple(o["output_ids"]) for o in together[:4]}) == 4   # each adapter differs
        assert lora_engine.stats()["lora_adapters"] == ["a", "b", "c"]
    finally:
        assert lora_engine.unload_lora_adapter("c").success


def test_iter_async_and_n(lora_engine):
    import asyncio

    want = lora_engine.generate(PROMPTS[0], GREEDY, lora_path="b")["output_ids"]
    got = dict(lora_engine.generate_iter([PROMPTS[0], PROMPTS[1]], GREEDY, lora_path=["b", None]))
    assert got[0]["output_ids"] == want
    out = asyncio.run(lora_engine.async_generate(PROMPTS[0], GREEDY, lora_path="b"))
    assert out["output_ids"] == want
    outs = lora_engine.generate(PROMPTS[0], {**GREEDY, "n": 2}, lora_path="b")
    assert [o["output_ids"] for o in outs] == [want, want]


def test_prefix_cache_isolated(lora_engine):
    prompt = " ".join(["The capital of France is Paris."] * 6)   # several full pages
    a1 = lora_engine.generate(prompt, {**GREEDY, "max_new_tokens": 2}, lora_path="a")
    b1 = lora_engine.generate(prompt, {**GREEDY, "max_new_tokens": 2}, lora_path="b")
    base = lora_engine.generate(prompt, {**GREEDY, "max_new_tokens": 2})
    assert b1["meta_info"]["cached_tokens"] == 0
    assert base["meta_info"]["cached_tokens"] == 0
    a2 = lora_engine.generate(prompt, {**GREEDY, "max_new_tokens": 2}, lora_path="a")
    assert a2["meta_info"]["cached_tokens"] > 0 and a2["output_ids"] == a1["output_ids"]


def test_load_unload_reload_while_running(lora_engine, adapters):
    assert lora_engine.load_lora_adapter("c", adapters["c"]).success
    params = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    want = lora_engine.generate(PROMPTS[1], params, lora_path="c")["output_ids"]
    stream = lora_engine.generate(PROMPTS[1], params, lora_path="c", stream=True)
    first = next(stream)                                 # running now
    done: dict = {}

    def unload() -> None:   # what runs when the unload returns: the request it waited for has ended
        done["res"] = lora_engine.unload_lora_adapter("c")
        done["running"] = lora_engine.stats()["running"]

    t = threading.Thread(target=unload)
    t.start()
    deadline = time.monotonic() + 30
    while "c" in lora_engine.list_lora_adapters():      # the name goes at once ...
        assert time.monotonic() < deadline
        time.sleep(0.005)
    chunks = [first] + list(stream)
    t.join(30)
    assert done["running"] == 0                          # ... the unload returns after the running request
    assert done["res"].success and "c" not in done["res"].loaded_adapters
    assert chunks[-1]["output_ids"] == want              # kept its adapter to the end
    with pytest.raises(ValueError, match="never been loaded"):
        lora_engine.generate(PROMPTS[1], GREEDY, lora_path="never")
    try:
        # as SGLang, a request naming an adapter loaded before loads it again (a new id: no old cache)
        again = lora_engine.generate(PROMPTS[1], params, lora_path="c")
        assert again["output_ids"] == want and again["meta_info"]["cached_tokens"] == 0
        assert "c" in lora_engine.list_lora_adapters()
        assert not lora_engine.load_lora_adapter("c", adapters["c"]).success   # loaded again already
    finally:
        lora_engine.unload_lora_adapter("c")


def test_errors_keep_serving(lora_engine, tiny_qwen3_dir, tmp_path, adapters):
    e = lora_engine
    with pytest.raises(ValueError, match="lora_path"):
        e.generate(PROMPTS[0], GREEDY, lora_path="nope")
    with pytest.raises(ValueError, match="lora_path"):
        e.generate(PROMPTS[:2], GREEDY, lora_path=["a"])
    with pytest.raises(ValueError, match="lora_path"):
        e.generate(PROMPTS[0], GREEDY, lora_path=3)
    with pytest.raises(ValueError, match="lora_name"):
        e.load_lora_adapter("", adapters["a"])
    bad = e.load_lora_adapter("x", str(tmp_path / "missing"))
    assert not bad.success and "not a directory" in bad.error_message
    assert not e.load_lora_adapter("a", adapters["a"]).success        # name taken
    other = make_adapter(tiny_qwen3_dir, str(tmp_path / "q3"), seed=1)   # another base model's shapes
    res = e.load_lora_adapter("q3", other)
    assert not res.success and "base model" in res.error_message
    emb = tmp_path / "emb"
    emb.mkdir()
    (emb / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                         "target_modules": ["embed_tokens", "q_proj"]}))
    res = e.load_lora_adapter("emb", str(emb))
    assert not res.success and "embedding" in res.error_message
    res = e.unload_lora_adapter("nope")
    assert not res.success and "not loaded" in res.error_message
    assert e.generate(PROMPTS[0], GREEDY, lora_path="a")["output_ids"]   # still serving


def test_rank_limit_and_config_errors(tiny_llama_dir, adapters):
    e = _engine(tiny_llama_dir, enable_lora=True, max_lora_rank=4)
    try:
        res = e.load_lora_adapter("b", adapters["b"])          # rank 8
        assert not res.success and "max_lora_rank" in res.error_message
        assert e.load_lora_adapter("a", adapters["a"]).success
    finally:
        e.shutdown()
    with pytest.raises(ValueError, match="max_loras_per_batch"):
        _engine(tiny_llama_dir, enable_lora=True, max_loras_per_batch=0)
    with pytest.raises(ValueError, match="lora_paths"):
        _engine(tiny_llama_dir, lora_paths="a")
    with pytest.raises(ValueError, match="lora_target_modules"):
        _engine(tiny_llama_dir, enable_lora=True, lora_target_modules=["embed_tokens"])


def test_without_enable_lora(tiny_engine, adapters):
    with pytest.raises(ValueError, match="enable_lora"):
        tiny_engine.generate(PROMPTS[0], GREEDY, lora_path="a")
    res = tiny_engine.load_lora_adapter("a", adapters["a"])
    assert not res.success and "enable_lora" in res.error_message
    assert "lora_adapters" not in tiny_engine.stats()


def test_generate_df_adapter_column(lora_engine):
    import pandas as pd

    names = ["a", None, "b"]
    df = pd.DataFrame({"prompt": PROMPTS, "adapter": names})
    out = nbgen.generate_df(df, engine=lora_engine, chat=False, sampling_params=GREEDY,
                            param_columns={"adapter": "lora_path"}, progress=False)
    for prompt, name, text in zip(PROMPTS, names, out["text"]):
        assert text == lora_engine.generate(prompt, GREEDY, lora_path=name)["text"]
    bad = nbgen.generate_df(pd.DataFrame({"prompt": PROMPTS[:2], "adapter": ["a", "zzz"]}), engine=lora_engine,
                            chat=False, sampling_params=GREEDY, param_columns={"adapter": "lora_path"},
                            progress=False)
    assert bad["error"].iloc[0] is None and "zzz" in bad["error"].iloc[1]


def test_dashboard_lists_adapters(lora_engine):
    from nbgen.notebook.state import StatsHistory, dashboard_html

    h = StatsHistory()
    h.append(lora_engine.stats())
    assert 'LoRA adapters: a, b' in dashboard_html(h)


@pytest.mark.gpu
def test_gpu_mixed_lora_batch(gpu_model_dir, tmp_path):
    """CUDA, bf16, decode graphs on (the slot kernels captured in them): a batch mixing two adapters
    and the base model matches each group run alone, base rows match an engine without LoRA."""
    from tests.tiny_models import GREEDY_SP, assert_close_runs, gpu_prompts

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ads = [make_adapter(gpu_model_dir, str(tmp_path / f"g{i}"), seed=i, r=8, alpha=16) for i in range(2)]
    prompts = gpu_prompts(9)
    names = [["g0", "g1", None][i % 3] for i in range(len(prompts))]
    kw = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=16)
    with nbgen.Engine(gpu_model_dir, lora_paths=[f"g0={ads[0]}", f"g1={ads[1]}"], **kw) as eng:
        assert eng.get_server_info()["cuda_graph_batch_sizes"]        # graphs captured for base steps
        mixed = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True,
                             lora_path=names, use_tqdm=False)
        for name in ("g0", "g1", None):
            idx = [i for i, n in enumerate(names) if n == name]
            alone = eng.generate(input_ids=[prompts[i] for i in idx], sampling_params=GREEDY_SP,
                                 return_logprob=True, lora_path=name, use_tqdm=False)
            assert_close_runs([mixed[i] for i in idx], alone)
    with nbgen.Engine(gpu_model_dir, **kw) as plain:
        idx = [i for i, n in enumerate(names) if n is None]
        base = plain.generate(input_ids=[prompts[i] for i in idx], sampling_params=GREEDY_SP,
                              return_logprob=True, use_tqdm=False)
    assert_close_runs([mixed[i] for i in idx], base)
