"""Weights and memory (SGLang's update_weights_from_tensor / _from_disk / _from_distributed,
get_weights_by_name, release / resume_memory_occupation) on tiny random models, against HF in fp32."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch

import nbgen
from nbgen.models.linear import cpu_packed_matmul_available
from tests.tiny_models import broadcast_weights, free_port, make_tiny_model

SP = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 3], [100] * 20]


def _varied(family: str, path: str, seed: int) -> str:
    """A tiny model whose norm weights are not all ones (HF initialises them to 1)."""
    from transformers import AutoModelForCausalLM

    make_tiny_model(family, path, seed=seed)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.mul_(torch.rand(p.shape, generator=g) + 0.5)
    hf.save_pretrained(path)
    return path


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(hf, prompts=PROMPTS, n: int = SP["max_new_tokens"]) -> list[list[int]]:
    """Greedy continuations by HF, EOS included (as ignore_eos=True)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(p):])
    return outs


def _greedy(eng: nbgen.Engine, prompts=PROMPTS) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=SP, use_tqdm=False)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tmp_path_factory) -> tuple[str, str]:
    """Two models of one family and config, different weights (qwen2: tied embeddings)."""
    fam = request.param
    return (_varied(fam, str(tmp_path_factory.mktemp(f"{fam}_a")), 0),
            _varied(fam, str(tmp_path_factory.mktemp(f"{fam}_b")), 1))


def test_update_from_tensor_matches_hf(pair):
    a, b = pair
    hb = _hf(b)
    want_b = _hf_greedy(hb)
    with nbgen.Engine(a, dtype="float32", device="cpu") as eng:
        base = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
        assert base["output_ids"] == _hf_greedy(_hf(a))[0]
        assert base["meta_info"]["weight_version"] == "default" == eng.get_server_info()["weight_version"]
        ok, msg = eng.update_weights_from_tensor(list(hb.named_parameters()), weight_version="step-1")
        assert ok, msg
        assert _greedy(eng) == want_b
        out = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
        assert out["meta_info"]["weight_version"] == "step-1" == eng.weight_version
        assert eng.get_model_info()["weight_version"] == "step-1"
        # a state_dict (tied models carry lm_head.weight too) and a version left as it is
        assert eng.update_weights_from_tensor(_hf(a).state_dict()) == (True, "Success")
        assert eng.weight_version == "step-1"
        assert _greedy(eng) == _hf_greedy(_hf(a))


def test_update_subset_of_weights(pair):
    """One tensor (a shard of a fused parameter, or a norm) changes just that weight."""
    a, b = pair
    ha, hb = _hf(a), _hf(b)
    names = ["model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.0.post_attention_layernorm.weight"]
    with nbgen.Engine(a, dtype="float32", device="cpu") as eng:
        sd = dict(hb.named_parameters())
        assert eng.update_weights_from_tensor([(n, sd[n]) for n in names])[0]
        with torch.no_grad():
            for n in names:
                ha.get_parameter(n).copy_(sd[n])
        assert _greedy(eng) == _hf_greedy(ha)


def test_update_from_disk_matches_hf(pair):
    a, b = pair
    with nbgen.Engine(a, dtype="float32", device="cpu") as eng:
        ok, msg, paused = eng.update_weights_from_disk(b, weight_version="b")
        assert (ok, paused) == (True, 0), msg
        assert _greedy(eng) == _hf_greedy(_hf(b))
        assert eng.get_server_info()["model_path"] == b and eng.weight_version == "b"
        ok, msg, _ = eng.update_weights_from_disk(a + "/missing")
        assert not ok and "Failed to get weights iterator" in msg
        assert eng.get_server_info()["model_path"] == b
        assert _greedy(eng) == _hf_greedy(_hf(b))


def test_get_weights_by_name_equals_hf(pair):
    a, _ = pair
    ha = _hf(a)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.norm.weight", "model.embed_tokens.weight",
             "lm_head.weight"]
    with nbgen.Engine(a, dtype="float32", device="cpu") as eng:
        for name in names:
            want = ha.get_parameter(name).detach().float().numpy().tolist()[:7]
            assert eng.get_weights_by_name(name, truncate_size=7) == want, name
        q = "model.layers.0.self_attn.q_proj.weight"
        assert len(eng.get_weights_by_name(q)) == min(100, ha.get_parameter(q).shape[0])   # 100 rows by default
        assert eng.get_weights_by_name("model.layers.0.self_attn.qkv_proj.weight", 1)[0][:3] == \
            ha.get_parameter("model.layers.0.self_attn.q_proj.weight")[0, :3].tolist()   # nbgen's own name
        assert eng.get_weights_by_name("model.layers.0.self_attn.nope.weight") is None
        with pytest.raises(ValueError, match="truncate_size"):
            eng.get_weights_by_name("model.norm.weight", truncate_size=-1)


def test_bad_updates_change_nothing(tiny_llama_dir):
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu") as eng:
        before = _greedy(eng)
        good = ("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 64))
        for bad, why in [(("model.layers.0.self_attn.q_prj.weight", torch.zeros(64, 64)), "did you mean"),
                         (("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 63)), "shape [64, 63]"),
                         (("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 128, dtype=torch.int32)),
                          "floating-point"),
                         (("lm_head.weight", torch.zeros(10, 64)), "shape")]:
            ok, msg = eng.update_weights_from_tensor([good, bad])    # the good one is not applied either
            assert not ok and why in msg and "nothing was changed" in msg, msg
        ok, msg = eng.update_weights_from_tensor([("qkv_proj", torch.zeros(1))], load_format="direct")
        assert not ok and "no parameter" in msg
        with pytest.raises(ValueError, match="named_tensors"):
            eng.update_weights_from_tensor([("a", [1, 2])])
        with pytest.raises(ValueError, match="load_format"):
            eng.update_weights_from_tensor([], load_format="flattened_bucket")
        with pytest.raises(ValueError, match="flush_cache"):
            eng.update_weights_from_tensor([], flush_cache="yes")
        assert _greedy(eng) == before
        assert eng.update_weights_from_tensor([]) == (True, "Success")


def test_direct_load_format(tiny_llama_dir, tmp_path):
    """load_format="direct": nbgen's own parameter names, whole parameters."""
    b = make_tiny_model("llama", str(tmp_path), seed=3)
    with nbgen.Engine(b, dtype="float32", device="cpu") as eb:
        qkv = eb.get_weights_by_name("model.layers.0.self_attn.qkv_proj.weight", 1000)
    hb = _hf(b)
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu") as eng:
        direct = [("model.layers.0.self_attn.qkv_proj.weight", torch.tensor(qkv))]
        assert eng.update_weights_from_tensor(direct, load_format="direct")[0]
        ha = _hf(tiny_llama_dir)
        with torch.no_grad():
            for part in ("q_proj", "k_proj", "v_proj"):
                n = f"model.layers.0.self_attn.{part}.weight"
                ha.get_parameter(n).copy_(hb.get_parameter(n))
        assert _greedy(eng) == _hf_greedy(ha)


def test_prefix_cache_flushed(tiny_llama_dir):
    prompt = list(range(3, 60))
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu") as eng:
        sd = list(_hf(tiny_llama_dir).named_parameters())
        eng.generate(input_ids=prompt, sampling_params=SP)
        assert eng.generate(input_ids=prompt, sampling_params=SP)["meta_info"]["cached_tokens"] > 0
        assert eng.update_weights_from_tensor(sd, flush_cache=False)[0]
        assert eng.generate(input_ids=prompt, sampling_params=SP)["meta_info"]["cached_tokens"] > 0
        assert eng.update_weights_from_tensor(sd)[0]
        assert eng.generate(input_ids=prompt, sampling_params=SP)["meta_info"]["cached_tokens"] == 0


def test_update_waits_for_running_requests(pair):
    """A request running when the update is called finishes with the old weights before the update
    runs; one submitted while the update waits runs after it, with the new weights (SGLang's
    model-update lock)."""
    a, b = pair
    hb = _hf(b)
    long_sp = {**SP, "max_new_tokens": 800}
    with nbgen.Engine(a, dtype="float32", device="cpu") as eng:
        old_long = eng.generate(input_ids=PROMPTS[0], sampling_params=long_sp)["output_ids"]
        stream = eng.generate(input_ids=PROMPTS[0], sampling_params=long_sp, stream=True)
        first = next(stream)                          # running now
        t: dict = {}

        def update() -> None:
            t["call"] = time.perf_counter()
            t["result"] = eng.update_weights_from_tensor(list(hb.named_parameters()), weight_version="new")
            t["done"] = time.perf_counter()
        upd = threading.Thread(target=update)
        upd.start()
        while not eng.loop._exclusive.pending and upd.is_alive():   # test-only peek: the update is queued
            time.sleep(0.002)
        aborted: dict = {}
        waiter = threading.Thread(target=lambda: aborted.update(
            out=eng.generate(input_ids=PROMPTS[2], sampling_params=SP, rid="held")))
        waiter.start()
        deadline = time.perf_counter() + 30
        while eng.loop._exclusive.num_held == 0 and time.perf_counter() < deadline:   # held behind the update ...
            time.sleep(0.002)
        eng.abort("held")                             # ... and answered at once when aborted
        waiter.join(30)
        assert aborted["out"]["meta_info"]["finish_reason"]["type"] == "abort"
        later = eng.generate(input_ids=PROMPTS[1], sampling_params=SP)    # held until the update ran
        chunks = [first] + list(stream)
        t_stream = time.perf_counter()
        upd.join()
        assert t["result"][0] and t["call"] < t_stream
        assert chunks[-1]["output_ids"] == old_long    # the final chunk carries every id
        assert chunks[-1]["meta_info"]["weight_version"] == "default"
        assert later["meta_info"]["weight_version"] == "new"
        assert later["output_ids"] == _hf_greedy(hb, [PROMPTS[1]])[0]
        assert eng.stats()["total_aborted"] == 1


def test_after_shutdown(tiny_llama_dir):
    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", weight_version="w0")
    assert eng.generate(input_ids=PROMPTS[0], sampling_params=SP)["meta_info"]["weight_version"] == "w0"
    eng.shutdown()
    assert eng.weight_version == "w0" and eng.get_server_info()["weight_version"] == "w0"
    with pytest.raises(RuntimeError, match="shut down"):
        eng.update_weights_from_tensor([])
    with pytest.raises(RuntimeError, match="shut down"):
        eng.release_memory_occupation()
    with pytest.raises(ValueError, match="weight_version"):
        nbgen.Engine(tiny_llama_dir, device="cpu", weight_version=3)


def test_release_resume_cpu(tiny_llama_dir, tmp_path):
    b = make_tiny_model("llama", str(tmp_path), seed=2)
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu") as eng:
        before = _greedy(eng)
        eng.release_memory_occupation()
        with pytest.raises(RuntimeError, match="resume_memory_occupation"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
        with pytest.raises(RuntimeError, match="released"):
            next(eng.generate(input_ids=PROMPTS[0], sampling_params=SP, stream=True))
        eng.resume_memory_occupation()
        assert _greedy(eng) == before
        # the RL pattern: release all, take the weights back, update them, then the KV cache
        eng.release_memory_occupation(tags=["weights", "kv_cache"])
        ok, msg = eng.update_weights_from_tensor(list(_hf(b).named_parameters()))
        assert not ok and "released" in msg
        eng.resume_memory_occupation(tags=["weights"])
        assert eng.update_weights_from_tensor(list(_hf(b).named_parameters()))[0]
        with pytest.raises(RuntimeError, match="kv_cache"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
        eng.resume_memory_occupation(tags=["kv_cache"])
        assert _greedy(eng) == _hf_greedy(_hf(b))
        with pytest.raises(ValueError, match="tags"):
            eng.release_memory_occupation(tags=["weight"])
        eng.resume_memory_occupation()          # nothing released: nothing to do
        assert eng.stats()["running"] == 0


@pytest.mark.skipif(not cpu_packed_matmul_available(), reason="no oneDNN bf16 weight packing on this CPU")
def test_bf16_cpu_packed_weights(pair):
    """bf16 on the CPU: the linears are oneDNN-packed; reads unpack them exactly, updates re-pack."""
    a, b = pair
    with nbgen.Engine(b, dtype="bfloat16", device="cpu") as eb:
        want = _greedy(eb)
    ha = _hf(a)
    with nbgen.Engine(a, dtype="bfloat16", device="cpu") as eng:
        name = "model.layers.0.mlp.gate_proj.weight"
        assert eng.get_weights_by_name(name, 5) == ha.get_parameter(name).bfloat16().float()[:5].tolist()
        assert eng.update_weights_from_tensor(list(_hf(b).named_parameters()))[0]
        assert _greedy(eng) == want


def test_update_weights_from_distributed_gloo(pair):
    a, b = pair
    hb = _hf(b)
    params = list(hb.named_parameters())
    port = free_port()
    trainer = mp.get_context("spawn").Process(target=broadcast_weights, args=(port, b, "rl"))
    trainer.start()
    try:
        with nbgen.Engine(a, dtype="float32", device="cpu") as eng:
            ok, msg = eng.init_weights_update_group("127.0.0.1", port, 1, 2, "rl", backend="gloo")
            assert ok, msg
            ok, msg = eng.update_weights_from_distributed([n for n, _ in params], ["float32"] * len(params),
                                                          [list(p.shape) for _, p in params], "rl",
                                                          weight_version="dist-1")
            assert ok and msg == "Succeeded to update parameter online. Weight version updated to dist-1.", msg
            assert _greedy(eng) == _hf_greedy(hb)
            assert eng.weight_version == "dist-1"
            assert eng.destroy_weights_update_group("rl")[0]
            assert eng.destroy_weights_update_group("rl") == (False, "The group to be destroyed does not exist.")
            ok, msg = eng.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "rl")
            assert not ok and "init_weights_update_group" in msg
            with pytest.raises(ValueError, match="dtypes"):
                eng.update_weights_from_distributed(["model.norm.weight"], ["float33"], [[64]], "rl")
            assert _greedy(eng) == _hf_greedy(hb)
    finally:
        trainer.join(60)
    assert trainer.exitcode == 0
