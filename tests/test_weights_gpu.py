"""GPU (CUDA only): weight updates and reads with folded norms and CUDA graphs, and memory release /
resume (``torch.cuda.mem_get_info`` shows the memory back, the graphs are captured again, the greedy
output is the same). Self-contained: random models built here, bf16 and fp32."""
from __future__ import annotations

import random

import pytest
import torch

import nbgen
from tests.tiny_models import assert_close_runs, broadcast_weights, free_port

gpu = pytest.mark.gpu
SP = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}


def _model(path: str, family: str, seed: int, hidden: int = 512, inter: int = 1024, layers: int = 3,
           vocab: int = 512, heads: int = 4, kv_heads: int = 2) -> str:
    """A random Llama / Qwen3 (head_dim 128) with norm weights in [0.5, 1.5) and widened logits."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                  eos_token_id=1, bos_token_id=0, pad_token_id=0)
    cfg, cls = (tf.Qwen3Config(head_dim=128, **common), tf.Qwen3ForCausalLM) if family == "qwen3" else \
        (tf.LlamaConfig(**common), tf.LlamaForCausalLM)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(torch.rand(p.shape) + 0.5)
            elif p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    return path


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(vocab: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, vocab) for _ in range(rng.choice([1, 7, 40, 300]))] for _ in range(n)]


def _run(eng: nbgen.Engine, prompts: list[list[int]]) -> list[dict]:
    return eng.generate(input_ids=prompts, sampling_params=SP, return_logprob=True, use_tqdm=False)


def _engine(path: str, dtype: str = "bfloat16", **kw) -> nbgen.Engine:
    return nbgen.Engine(path, device="cuda", dtype=dtype, cuda_graph_max_bs=16, **kw)


READ = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
        "model.layers.2.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.input_layernorm.weight", "model.layers.2.mlp.down_proj.weight"]


@gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_update_and_read_with_folded_norms(family, tmp_path):
    """bf16 on CUDA folds the RMSNorm weights into qkv / gate|up: reads divide them out again, updates
    fold the new rows, a norm update rescales its projection; graphs replay the new weights in place."""
    a, b = _model(str(tmp_path / "a"), family, 0), _model(str(tmp_path / "b"), family, 1)
    prompts = _prompts(512)
    with _engine(b) as eb:
        want_b, read_b = _run(eb, prompts), {n: eb.get_weights_by_name(n, 1000) for n in READ}
    with _engine(a) as ea:
        want_a = _run(ea, prompts)
    ha, hb = _hf(a), _hf(b)
    with _engine(a) as eng:
        info = eng.get_server_info()
        assert info["norms_folded"] and info["cuda_graph_batch_sizes"]
        for n in READ:     # the checkpoint's values within a bf16 rounding of the fold
            got = torch.tensor(eng.get_weights_by_name(n))
            ref = ha.get_parameter(n).detach()[:100].bfloat16().float()
            assert torch.allclose(got, ref, rtol=2 ** -7, atol=1e-6), n
        assert eng.update_weights_from_tensor(list(hb.named_parameters())) == (True, "Success")
        got = _run(eng, prompts)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want_b]   # the same arithmetic
        assert {n: eng.get_weights_by_name(n, 1000) for n in READ} == read_b
        # one norm alone: its projection's columns by new / old (one more bf16 rounding)
        norm = "model.layers.1.post_attention_layernorm.weight"
        assert eng.update_weights_from_tensor([(norm, ha.get_parameter(norm))])[0]
        with torch.no_grad():
            hb.get_parameter(norm).copy_(ha.get_parameter(norm))
        c = str(tmp_path / "c")
        hb.save_pretrained(c)
        with _engine(c) as ec:
            want_c = _run(ec, prompts)
        assert_close_runs(_run(eng, prompts), want_c)
        ok, msg, _ = eng.update_weights_from_disk(a)
        assert ok, msg
        assert [o["output_ids"] for o in _run(eng, prompts)] == [o["output_ids"] for o in want_a]


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_release_resume_memory(dtype, tmp_path):
    """The weights and the KV pool leave the GPU (mem_get_info shows it), generation is refused, and
    after resume (graphs captured again) the greedy output is the same, also after an update made while
    the KV pool was still released (the RL order)."""
    path = _model(str(tmp_path / "m"), "llama", 0, hidden=1024, inter=2816, layers=4, vocab=32000,
                  heads=8, kv_heads=4)
    hf = _hf(path)
    prompts = _prompts(32000)
    elt = 2 if dtype == "bfloat16" else 4
    with _engine(path, dtype, max_total_tokens=1 << 16) as eng:
        info = eng.get_server_info()
        base = [o["output_ids"] for o in _run(eng, prompts)]
        w_bytes = sum(p.numel() for p in hf.parameters()) * elt
        kv_bytes = 4 * 2 * info["num_pages"] * info["page_size"] * 4 * 128 * elt
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        eng.release_memory_occupation()
        free1 = torch.cuda.mem_get_info()[0]
        print(f"{dtype}: released {(free1 - free0) / 2**20:.0f} MiB of weights {w_bytes / 2**20:.0f} MiB "
              f"+ KV {kv_bytes / 2**20:.0f} MiB")
        assert free1 - free0 >= 0.9 * (w_bytes + kv_bytes)
        with pytest.raises(RuntimeError, match="resume_memory_occupation"):
            eng.generate(input_ids=prompts[0], sampling_params=SP)
        eng.resume_memory_occupation()
        assert torch.cuda.mem_get_info()[0] <= free1 - 0.9 * (w_bytes + kv_bytes)
        assert eng.get_server_info()["cuda_graph_batch_sizes"] == info["cuda_graph_batch_sizes"]
        assert [o["output_ids"] for o in _run(eng, prompts)] == base
        eng.release_memory_occupation(tags=["kv_cache"])
        eng.resume_memory_occupation(tags=["kv_cache"])
        assert [o["output_ids"] for o in _run(eng, prompts)] == base
        eng.release_memory_occupation()
        eng.resume_memory_occupation(tags=["weights"])
        assert eng.update_weights_from_tensor(list(hf.named_parameters()))[0]
        eng.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
        assert [o["output_ids"] for o in _run(eng, prompts)] == base


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_update_weights_from_distributed_nccl(tmp_path):
    """A trainer process on the second GPU broadcasts new weights over NCCL into an engine on the first
    (SGLang's init_weights_update_group / update_weights_from_distributed): afterwards the engine's greedy
    output equals an engine loaded from those weights (graphs on, fp32)."""
    import multiprocessing as mp

    a = _model(str(tmp_path / "a"), "llama", 0)
    b = _model(str(tmp_path / "b"), "llama", 1)
    prompts = _prompts(512)
    with _engine(b, dtype="float32") as eng:
        want = [o["output_ids"] for o in _run(eng, prompts)]
    params = list(_hf(b).named_parameters())
    port = free_port()
    trainer = mp.get_context("spawn").Process(target=broadcast_weights, args=(port, b, "rl", "cuda:1"))
    trainer.start()
    try:
        with _engine(a, dtype="float32") as eng:
            before = [o["output_ids"] for o in _run(eng, prompts)]
            ok, msg = eng.init_weights_update_group("127.0.0.1", port, 1, 2, "rl", backend="nccl")
            assert ok, msg
            ok, msg = eng.update_weights_from_distributed([n for n, _ in params], ["float32"] * len(params),
                                                          [list(p.shape) for _, p in params], "rl",
                                                          weight_version="nccl-1")
            assert ok, msg
            assert eng.weight_version == "nccl-1"
            got = [o["output_ids"] for o in _run(eng, prompts)]
            assert eng.destroy_weights_update_group("rl")[0]
    finally:
        trainer.join(120)
    assert trainer.exitcode == 0
    assert before != want            # the update had something to change
    assert got == want
