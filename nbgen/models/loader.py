"""load_model: an EngineConfig -> model with weights, HF config, tokenizer, EOS ids, generation defaults.

Sources: an HF directory (config.json + safetensors), a GGUF file (converted once and cached), or
``load_format="dummy"`` (random weights of the right shapes from config.json alone). Weights
stream tensor by tensor from safetensors into the already-allocated parameters, so peak memory
stays near the model's own size.
"""
from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch
from torch import nn

from nbgen.core.chat_template import apply_chat_template_arg
from nbgen.core.config import EngineConfig
from nbgen.models.embedded import default_model_path
from nbgen.models.fp8_checkpoint import dequantize_stream, fp8_format, module_scales
from nbgen.models.gguf_convert import gguf_to_hf_dir
from nbgen.models.kv_scales import scale_kind
from nbgen.models import cpu_decode
from nbgen.models.vocab_parallel import prepack_cpu_linears
from nbgen.models.fp8_linear import quantize_linears
from nbgen.models.model_config import ModelConfig, read_model_config
from nbgen.models.pooling_config import PoolingConfig, read_pooling_config
from nbgen.models.registry import get_model_class, prepare_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_GEN_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_REOPEN_BYTES = 64 << 20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """What the runner and the engine need from a loaded model."""

    model: nn.Module
    hf_config: Union[ModelConfig, PretrainedConfig]   # ModelConfig for the families nbgen reads itself
    tokenizer: Optional[Any]                 # HF tokenizer (has .chat_template) or None
    eos_token_ids: list[int]
    generation_defaults: dict[str, Any]      # sampling defaults from generation_config.json
    dtype: torch.dtype
    context_length: int
    model_dir: str = ""                      # the HF directory actually read (after GGUF conversion)
    pooling: Optional[PoolingConfig] = None  # embedding engines: how hidden states become a vector


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 dot products (avx512_bf16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bf16 on CUDA, bf16 on CPUs with native bf16, else fp32; explicit names honoured."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or cpu_supports_bf16():
        return torch.bfloat16
    return torch.float32


def checkpoint_dir(path: str, load_format: str = "auto") -> str:
    """The HF directory of ``path`` (a directory, its config.json, or a .gguf file converted once)."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model_path {path!r} does not exist (nbgen has no model-hub access; "
                                "pass a local HF directory or a .gguf file)")
    if (load_format == "gguf" or path.lower().endswith(".gguf")) and os.path.isfile(path):
        return gguf_to_hf_dir(path)
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        return os.path.dirname(path) or "."
    return path


def _model_dir(cfg: EngineConfig) -> str:
    """The HF directory to read, converting a GGUF first; model_path=None means the embedded model."""
    return checkpoint_dir(cfg.model_path if cfg.model_path is not None else default_model_path(), cfg.load_format)


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r} "
                                "(use load_format='dummy' for random weights)")
    return [os.path.join(model_dir, n) for n in names]


def iter_safetensors(model_dir: str, keep: Optional[Callable[[str], bool]] = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs, one tensor in memory at a time (only names ``keep`` accepts)."""
    from safetensors import safe_open

    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            names = [n for n in f.keys() if keep is None or keep(n)]
        # safe_open maps the whole file and every page read stays in this process's RSS until the
        # file is closed, so reopen it every ~64 MB: peak RSS ~ model size, not model + file size.
        i = 0
        while i < len(names):
            with safe_open(path, framework="pt", device="cpu") as f:
                read = 0
                while i < len(names) and read < _REOPEN_BYTES:
                    t = f.get_tensor(names[i])
                    read += t.numel() * t.element_size()
                    yield names[i], t
                    i += 1


def checkpoint_metadata(model_dir: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, safetensors dtype such as "BF16") of every tensor, from the file headers only."""
    from safetensors import safe_open

    out = []
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out.append((name, tuple(sl.get_shape()), sl.get_dtype()))
    return out


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def fill_dummy_(name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` (named ``name``) filled in place as dummy weights are: unit norms, zero biases, N(0, 0.02)
    anything else, drawn from ``gen`` (a generator on ``t``'s device)."""
    if "norm" in name:
        return t.fill_(1.0)
    if name.endswith(".bias"):
        return t.zero_()
    return t.normal_(0.0, 0.02, generator=gen)


def _dummy_init(model: nn.Module, seed: int) -> None:
    """Deterministic small random weights (``fill_dummy_``), drawn on each parameter's device: fast for
    GPU-sized models."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.device not in gens:
                gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            fill_dummy_(name, p, gens[p.device])


def _eos_ids(model_dir: str, config: Any, tokenizer: Any) -> tuple[list[int], dict]:
    """Union of EOS ids from generation_config.json, config.json and the tokenizer; plus gen defaults."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v if x is not None)

    defaults: dict[str, Any] = {}
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
        add(gen.get("eos_token_id"))
        defaults = {k: gen[k] for k in _GEN_KEYS if gen.get(k) is not None}
    add(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return sorted(ids), defaults


def _load_tokenizer(cfg: EngineConfig, model_dir: str) -> Optional[Any]:
    if cfg.skip_tokenizer_init:
        return None
    tok_dir = cfg.tokenizer_path or model_dir
    if cfg.tokenizer_path is None and not any(os.path.exists(os.path.join(tok_dir, n))
                                              for n in _TOKENIZER_FILES):
        logger.warning("nbgen: no tokenizer files in %s; running without a tokenizer (input_ids only)",
                       tok_dir)
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=cfg.trust_remote_code)
    apply_chat_template_arg(tokenizer, cfg.chat_template)   # the Engine's chat_template, if any
    return tokenizer


def load_model(cfg: EngineConfig, device: torch.device, prepack: bool = True) -> LoadedModel:
    """Build the model named by `cfg` on `device` and fill its weights."""
    device = torch.device(device)
    model_dir = _model_dir(cfg)
    config = prepare_config(read_model_config(model_dir, trust_remote_code=cfg.trust_remote_code))
    pooling = read_pooling_config(model_dir, config) if cfg.is_embedding else None   # bad modules fail first
    cls = get_model_class(config)
    dtype = resolve_dtype(cfg.dtype, device)
    with _default_dtype(dtype), torch.device(device):
        model = cls(config)
    ckpt_scales: dict[str, torch.Tensor] = {}   # an fp8 checkpoint's scales, by weight name
    if cfg.load_format == "dummy":
        _dummy_init(model, cfg.random_seed)
    else:
        # an embedding engine never computes logits: a checkpoint without lm_head (saved as the base model) loads
        # KV-cache scales are not weights: the fp8 KV cache reads them (models/kv_scales.py)
        weights = iter_safetensors(model_dir, keep=lambda n: scale_kind(n) is None)
        fp8 = fp8_format(config)
        if fp8 is not None:   # fp8 checkpoint: weights dequantized as they stream, their scales kept
            weights = dequantize_stream(weights, fp8, ckpt_scales)
        model.load_weights(weights, require_head=not cfg.is_embedding)
    model.eval().requires_grad_(False)
    if cfg.quantization == "fp8" or (cfg.load_format != "dummy" and fp8_format(config) is not None):
        # fp8 GEMMs (models/fp8_linear.py); before the CPU prepack, which skips them
        quantize_linears(model, module_scales(model, ckpt_scales))
    if prepack and device.type == "cpu" and dtype == torch.bfloat16:
        # oneDNN-packed weights: ~25% faster decode matmuls; raw weight values are no longer readable
        prepack_cpu_linears(model)
        cpu_decode.attach(model)      # decode steps of a few rows without the modules' dispatch
    tokenizer = _load_tokenizer(cfg, model_dir)
    eos, defaults = _eos_ids(model_dir, config, tokenizer)
    ctx = cfg.context_length or int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
    return LoadedModel(model=model, hf_config=config, tokenizer=tokenizer, eos_token_ids=eos,
                       generation_defaults=defaults, dtype=dtype, context_length=ctx, model_dir=model_dir,
                       pooling=pooling)
