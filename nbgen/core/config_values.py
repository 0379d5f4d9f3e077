"""The values EngineConfig takes: SGLang's spellings and None defaults mapped to nbgen's, then the kind
and range of every plain argument checked, each ValueError naming its argument.

The arguments with rules of their own (priority, LoRA, speculative decoding, chat template) are
checked by their modules; ``config.py`` calls those.
"""
from __future__ import annotations

import logging
import os
import random
from dataclasses import fields
from typing import Any

from nbgen.core.scheduler_config import POLICIES, is_int

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
QUANTIZATIONS = (None, "fp8")            # fp8 checkpoints are detected from config.json whatever this says
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")   # auto: the model dtype
ATTENTION_BACKENDS = (None, "torch", "flashinfer")
GRAMMAR_BACKENDS = (None, "xgrammar", "none")   # SGLang's outlines / llguidance are refused
MEM_FRACTION_STATIC = 0.85   # nbgen's share of the card for weights + KV cache (SGLang sizes its own)

# SGLang's other spellings of a value with the same meaning -> nbgen's
ALIASES: dict[str, dict[str, str]] = {
    "dtype": {"half": "float16", "float": "float32"},
    "attention_backend": {"torch_native": "torch"},
}

# None or an int >= 1
_COUNTS = ("context_length", "max_running_requests", "max_queued_requests", "max_total_tokens",
           "chunked_prefill_size", "cuda_graph_max_bs", "piecewise_cuda_graph_max_tokens")


def _check(cfg: Any, name: str, ok: bool, want: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {want}, got {getattr(cfg, name)!r}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _path(cfg: Any, name: str) -> None:
    """A path argument: None, a str or an os.PathLike (kept as its str)."""
    v = getattr(cfg, name)
    _check(cfg, name, v is None or isinstance(v, (str, os.PathLike)), "None, a str or a path")
    if v is not None:
        setattr(cfg, name, os.path.expanduser(os.fspath(v)))


def apply_sglang_defaults(cfg: Any) -> None:
    """SGLang's spellings (``dtype="half"``, ``attention_backend="torch_native"``) become nbgen's, and
    SGLang's None defaults get their value: ``mem_fraction_static`` nbgen's 0.85, ``random_seed`` a
    random one (SGLang's rule; ``get_server_info()`` reports it)."""
    for name, table in ALIASES.items():
        v = getattr(cfg, name)
        if isinstance(v, str) and v in table:
            setattr(cfg, name, table[v])
    if cfg.mem_fraction_static is None:
        cfg.mem_fraction_static = MEM_FRACTION_STATIC
    if cfg.random_seed is None:
        cfg.random_seed = random.randint(0, 1 << 30)


def check_values(cfg: Any) -> None:
    """Every plain argument's kind and range; ValueError naming the first wrong one."""
    for f in fields(cfg):   # the flags: a str like "false" would otherwise read as True
        if f.type == "bool":
            _check(cfg, f.name, isinstance(getattr(cfg, f.name), bool), "a bool")
    _path(cfg, "model_path")
    _path(cfg, "tokenizer_path")
    _check(cfg, "dtype", cfg.dtype in DTYPES, f"one of {DTYPES} (or SGLang's 'half', 'float')")
    _check(cfg, "device", cfg.device in DEVICES, f"one of {DEVICES}")
    _check(cfg, "load_format", cfg.load_format in LOAD_FORMATS, f"one of {LOAD_FORMATS}")
    _check(cfg, "quantization", cfg.quantization in QUANTIZATIONS, f"one of {QUANTIZATIONS}")
    _check(cfg, "kv_cache_dtype", cfg.kv_cache_dtype in KV_CACHE_DTYPES, f"one of {KV_CACHE_DTYPES}")
    _check(cfg, "schedule_policy", cfg.schedule_policy is None or cfg.schedule_policy in POLICIES,
           f"None or one of {POLICIES}")
    _check(cfg, "attention_backend", cfg.attention_backend in ATTENTION_BACKENDS,
           f"one of {ATTENTION_BACKENDS} (or SGLang's 'torch_native')")
    _check(cfg, "page_size", is_int(cfg.page_size) and cfg.page_size >= 1, "an int >= 1")
    _check(cfg, "mem_fraction_static", _is_number(cfg.mem_fraction_static) and 0.0 < cfg.mem_fraction_static < 1.0,
           "None or a number in (0, 1)")
    _check(cfg, "cpu_offload_gb", _is_number(cfg.cpu_offload_gb) and cfg.cpu_offload_gb >= 0, "a number >= 0")
    _check(cfg, "random_seed", is_int(cfg.random_seed), "None or an int")
    _check(cfg, "log_level", isinstance(cfg.log_level, str)
           and isinstance(logging.getLevelName(cfg.log_level.upper()), int),
           "a logging level name (debug, info, warning, error, critical)")
    for name in ("tp_size", "dp_size", "stream_interval", "max_prefill_tokens"):
        v = getattr(cfg, name)
        _check(cfg, name, is_int(v) and v >= 1, "an int >= 1")
    _check(cfg, "base_gpu_id", is_int(cfg.base_gpu_id) and cfg.base_gpu_id >= 0, "an int >= 0")
    for name in _COUNTS:
        v = getattr(cfg, name)
        _check(cfg, name, v is None or (is_int(v) and v >= 1), "None or an int >= 1")
    _check(cfg, "weight_version", isinstance(cfg.weight_version, str), "a str")
    _check(cfg, "served_model_name", cfg.served_model_name is None or isinstance(cfg.served_model_name, str),
           "None or a str")
    if cfg.grammar_backend in ("outlines", "llguidance"):
        raise ValueError(f"grammar_backend={cfg.grammar_backend!r} is not supported yet by nbgen "
                         "(its grammar backend is xgrammar); pass None, 'xgrammar' or 'none'")
    _check(cfg, "grammar_backend", cfg.grammar_backend in GRAMMAR_BACKENDS, f"one of {GRAMMAR_BACKENDS}")
