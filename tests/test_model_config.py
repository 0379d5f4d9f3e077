"""nbgen's own config.json reader vs transformers' AutoConfig: every value nbgen reads must agree."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from nbgen.core.config import EngineConfig
from nbgen.models import loader, model_config
from nbgen.models.layers import rope_settings
from nbgen.models.llama_layer import head_dim_of
from nbgen.models.model_config import ModelConfig, read_model_config
from nbgen.models.registry import get_model_class
from nbgen.models.model_config import model_dims

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("NBGEN_SHARED_MODELS", REPO.parent / "shared" / "models"))
# every config attribute nbgen reads (grep "config\." / getattr(config, ...) in nbgen/)
READ = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
        "rms_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
        "use_sliding_window", "max_window_layers", "layer_types", "rope_parameters", "rope_scaling",
        "rope_theta", "bos_token_id", "eos_token_id", "pad_token_id")
ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM"}
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=300)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

# config.json dicts as found on disk (old-style keys: rope_theta, rope_scaling, torch_dtype)
RAW: dict[str, dict[str, Any]] = {
    "llama3.1-style": {**SIZES, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                       "num_key_value_heads": 2, "max_position_embeddings": 1024, "rope_theta": 500000.0,
                       "rope_scaling": dict(LLAMA3), "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                       "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
                       "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                       "torch_dtype": "bfloat16"},
    "llama3-no-original-ctx": {**SIZES, "model_type": "llama", "max_position_embeddings": 512,
                               "rope_scaling": {k: v for k, v in LLAMA3.items()
                                                if k != "original_max_position_embeddings"}},
    "llama-linear-legacy-type": {**SIZES, "model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0},
                                 "num_key_value_heads": None, "head_dim": None},
    "qwen2.5-style": {**SIZES, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                      "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
                      "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
                      "torch_dtype": "bfloat16"},
    "qwen2-sliding": {**SIZES, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32,
                      "max_window_layers": 2},
    "qwen2-window-unused": {**SIZES, "model_type": "qwen2", "sliding_window": 32, "max_window_layers": 1},
    "qwen2-legacy-layer-types": {**SIZES, "model_type": "qwen2", "layer_types": ["attention"] * 4},
    "qwen3-style": {**SIZES, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 40960,
                    "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                    "attention_bias": False, "hidden_act": "silu", "eos_token_id": 151645, "dtype": "float16"},
    "qwen3-kv-heads-null": {**SIZES, "model_type": "qwen3", "num_key_value_heads": None, "tie_word_embeddings": False},
    "mistral-window-null": {**SIZES, "model_type": "mistral", "sliding_window": None, "head_dim": 24},
    "mistral-extra-keys": {**SIZES, "model_type": "mistral", "some_future_key": [1, 2], "rope_theta": 1e6},
}
# only the size keys, or nothing but model_type: everything else comes from the defaults
for _mt in ARCH:
    RAW[f"{_mt}-minimal"] = {**SIZES, "model_type": _mt}
    RAW[f"{_mt}-minimal-bare"] = {"model_type": _mt}
RAW["qwen2-minimal-sliding"] = {**SIZES, "model_type": "qwen2", "use_sliding_window": True}
RAW["qwen3-minimal-sliding"] = {**SIZES, "model_type": "qwen3", "use_sliding_window": True}
# configs written by transformers itself (new-style keys: rope_parameters, layer_types, dtype)
HF_MADE = {
    "llama": dict(num_key_value_heads=2, rope_scaling=dict(LLAMA3), rope_theta=500.0, attention_bias=True,
                  mlp_bias=True),
    "llama-tied": dict(tie_word_embeddings=True, eos_token_id=[5, 6]),
    "mistral": dict(head_dim=24, sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "qwen3": dict(head_dim=32, tie_word_embeddings=False, pad_token_id=0),
}


def _write(path: Path, raw: dict[str, Any]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


def _view(cfg: Any) -> dict[str, Any]:
    """What nbgen sees of a config: the raw attributes and the values its code derives from them."""
    out = {k: getattr(cfg, k, "<missing>") for k in READ}
    dtype = getattr(cfg, "dtype", None)
    out["dtype"] = None if dtype is None else str(dtype).removeprefix("torch.")
    out["rope_settings"] = rope_settings(cfg)
    out["model_dims"] = model_dims(cfg)
    out["head_dim_of"] = head_dim_of(cfg)
    out["class"] = get_model_class(cfg).__name__ if getattr(cfg, "architectures", None) or \
        cfg.model_type in ARCH else None
    return out


def _assert_same(model_dir: str) -> None:
    ours = read_model_config(model_dir)
    assert isinstance(ours, ModelConfig)
    ref = transformers.AutoConfig.from_pretrained(model_dir)
    a, b = _view(ours), _view(ref)
    assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b[k]}


@pytest.mark.parametrize("name", sorted(RAW))
def test_raw_configs_match_autoconfig(tmp_path: Path, name: str) -> None:
    model_dir = _write(tmp_path, RAW[name])
    if "legacy-layer-types" in name:   # transformers renames these since 5.2x; 5.17 rejects them
        try:
            transformers.AutoConfig.from_pretrained(model_dir)
        except Exception as e:   # huggingface_hub's StrictDataclassClassValidationError
            pytest.skip(f"transformers {transformers.__version__} rejects legacy layer_types: {type(e).__name__}")
    _assert_same(model_dir)


@pytest.mark.parametrize("name", sorted(HF_MADE))
def test_transformers_written_configs_match(tmp_path: Path, name: str) -> None:
    family = name.split("-")[0]
    cfg = getattr(transformers, ARCH[family].replace("ForCausalLM", "Config"))(**SIZES, **HF_MADE[name])
    cfg.architectures = [ARCH[family]]
    cfg.save_pretrained(tmp_path)
    _assert_same(str(tmp_path))


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen2.5-0.5b", "llama-3.1-8b"])
def test_shared_benchmark_configs_match(name: str) -> None:
    if not (SHARED / name / "config.json").exists():
        pytest.skip(f"{SHARED / name} not present (CI clones only the repo)")
    _assert_same(str(SHARED / name))


def test_embedded_model_config_matches() -> None:
    from nbgen.models import embedded, gguf_convert

    gguf = embedded.embedded_gguf_path()
    if not (gguf.exists() and gguf_convert.is_converted(str(gguf))):
        pytest.skip("the embedded model is not converted on this machine")
    _assert_same(str(gguf_convert.converted_dir(str(gguf))))


def _perturbed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 3 + 1
    return value + "x" if isinstance(value, str) else 7


@pytest.mark.parametrize("family", sorted(ARCH))
def test_comparison_catches_each_wrong_default(tmp_path: Path, family: str, monkeypatch) -> None:
    """A wrong default in the table must make some minimal config disagree with transformers."""
    dirs = [_write(tmp_path / n, raw) for n, raw in RAW.items() if n.startswith(f"{family}-minimal")]
    refs = [_view(transformers.AutoConfig.from_pretrained(d)) for d in dirs]
    for key, value in model_config.DEFAULTS[family].items():
        monkeypatch.setitem(model_config.DEFAULTS[family], key, _perturbed(value))
        caught = False
        for d, ref in zip(dirs, refs):
            try:
                caught |= _view(read_model_config(d)) != ref
            except Exception:   # a nonsensical default may also just break
                caught = True
        assert caught, f"a wrong {family} default for {key!r} went unnoticed"
        monkeypatch.setitem(model_config.DEFAULTS[family], key, value)
    bad = {**RAW[f"{family}-minimal"], "rms_norm_eps": 1e-5}        # and a wrong value in the JSON
    assert _view(read_model_config(_write(tmp_path / "bad", bad))) != refs[0]


@pytest.mark.parametrize("case", ["unknown-type", "auto_map", "remote-code", "nested-rope"])
def test_unusual_configs_go_through_autoconfig(tmp_path: Path, case: str) -> None:
    raw: dict[str, Any] = {**SIZES, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    if case == "unknown-type":
        raw = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).to_dict()
    elif case == "auto_map":
        raw["auto_map"] = {"AutoConfig": "configuration_x.XConfig"}
    elif case == "nested-rope":
        raw["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = read_model_config(_write(tmp_path, raw), trust_remote_code=case == "remote-code")
    assert isinstance(cfg, transformers.PretrainedConfig) and not isinstance(cfg, ModelConfig)


def test_dummy_models_from_both_readers_are_identical(tmp_path: Path, monkeypatch) -> None:
    """Same parameters and RoPE caches from ModelConfig as from the transformers config."""
    ec = EngineConfig(model_path=_write(tmp_path, RAW["llama3.1-style"]), load_format="dummy",
                      dtype="float32", random_seed=1)
    ours = loader.load_model(ec, "cpu", prepack=False)
    monkeypatch.setattr(loader, "read_model_config",
                        lambda d, trust_remote_code=False: transformers.AutoConfig.from_pretrained(d))
    ref = loader.load_model(ec, "cpu", prepack=False)
    assert isinstance(ours.hf_config, ModelConfig) and not isinstance(ref.hf_config, ModelConfig)
    assert (ours.eos_token_ids, ours.context_length) == (ref.eos_token_ids, ref.context_length)
    a, b = ours.model.state_dict(keep_vars=True), ref.model.state_dict(keep_vars=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for m1, m2 in zip(ours.model.modules(), ref.model.modules()):   # non-persistent buffers (RoPE cache)
        for (n1, t1), (n2, t2) in zip(m1.named_buffers(recurse=False), m2.named_buffers(recurse=False)):
            assert n1 == n2 and torch.equal(t1, t2), n1
    assert ours.hf_config.to_dict()["rope_parameters"]["rope_theta"] == 500000.0


def test_dummy_load_imports_no_transformers_config_classes(tmp_path: Path) -> None:
    model_dir = _write(tmp_path, {**RAW["qwen3-style"], "num_hidden_layers": 2})
    code = ("import sys, torch\n"
            "import nbgen\n"
            "from nbgen.core.config import EngineConfig\n"
            "from nbgen.models.loader import load_model\n"
            f"ec = EngineConfig(model_path={model_dir!r}, load_format='dummy', device='cpu', "
            "dtype='float32', skip_tokenizer_init=True)\n"
            "lm = load_model(ec, torch.device('cpu'))\n"
            "assert type(lm.hf_config).__name__ == 'ModelConfig', type(lm.hf_config)\n"
            "bad = [m for m in sys.modules if m.startswith(('transformers.models.', 'transformers.generation'))]\n"
            "print('BAD', bad[:10])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "BAD []" in proc.stdout, proc.stdout[-2000:]
