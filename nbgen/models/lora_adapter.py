"""LoRA adapters in peft's format, loaded and checked against a model's fused linears.

A peft adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) and ``adapter_model.safetensors`` (or ``.bin``) with ``lora_A`` [r, in] and
``lora_B`` [out, r] per targeted module. nbgen's layers fuse q|k|v and gate|up, so each HF module
becomes one shard of a fused linear: its A rows are stacked per fused linear (one x @ A^T for the
shards together) and its B writes the shard's output columns. Embedding / lm_head adapters, DoRA,
per-module rank or alpha patterns and trained biases are refused with a message saying so. An adapter
may also come in memory (``AdapterTensors``: the config as a dict, the tensors by peft's names).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

# HF module name -> (nbgen submodule of the decoder layer, shard id of the fused linear or None)
MODULE_MAP: dict[str, tuple[str, Any]] = {
    "q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}
TARGET_MODULES = tuple(MODULE_MAP)
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class ShardLoRA:
    """One HF module's B inside a fused linear: columns [a_lo, a_hi) of x @ A^T -> output [out_lo, out_hi)."""

    a_lo: int
    a_hi: int
    out_lo: int
    out_hi: int
    b: torch.Tensor            # [out_hi - out_lo, a_hi - a_lo]


@dataclass
class ModuleLoRA:
    """An adapter's weights for one fused linear: delta = ((x @ a^T)[:, shard] @ b^T) * scaling."""

    a: torch.Tensor            # [sum of the shards' ranks, in]
    shards: list[ShardLoRA]
    scaling: float
    a_raw: Optional[torch.Tensor] = None   # the adapter's own A when ``a`` holds it folded (fold_norms_into)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this module's weights hold."""
        return [self.a] + [sh.b for sh in self.shards] + ([self.a_raw] if self.a_raw is not None else [])


@dataclass
class AdapterWeights:
    """A loaded adapter: its rank, scaling and weights per (layer, nbgen submodule)."""

    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    modules: dict[tuple[int, str], ModuleLoRA] = field(default_factory=dict)


@dataclass
class AdapterTensors:
    """An adapter given in memory (``Engine.load_lora_adapter_from_tensors``): its adapter_config.json as a
    dict and its CPU tensors by peft's names; ``label`` stands for a directory in messages and listings."""

    label: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(repr=False)


def read_adapter_config(path: str) -> dict[str, Any]:
    """``adapter_config.json`` of a peft LoRA directory, checked for what nbgen serves."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"lora_path must be a non-empty str (a peft adapter directory), got {path!r:.80}")
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ValueError(f"lora_path {path!r} is not a directory (a peft adapter saved with save_pretrained)")
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"lora_path {path!r} has no adapter_config.json (not a peft adapter)")
    with open(cfg_file) as f:
        return check_adapter_config(json.load(f), path)


def check_adapter_config(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """A peft LoRA config (``path``: the adapter's name in messages), checked for what nbgen serves."""
    ptype = str(cfg.get("peft_type", "LORA")).upper()
    if ptype != "LORA":
        raise ValueError(f"adapter {path!r} is a {ptype} adapter; only LoRA adapters are supported")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"),
                      ("modules_to_save", "fully trained modules (modules_to_save)"),
                      ("lora_bias", "LoRA biases (lora_bias)")):
        if cfg.get(key):
            raise ValueError(f"adapter {path!r} uses {what}, which nbgen does not support")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter {path!r} trains biases (bias={cfg['bias']!r}); only bias='none' is supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    bad = [t for t in targets if any(u in t for u in _UNSUPPORTED_TARGETS)]
    if bad:
        raise ValueError(f"adapter {path!r} targets {bad}: embedding / lm_head LoRA adapters are not "
                         f"supported (targets may be {list(TARGET_MODULES)})")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise ValueError(f"adapter {path!r}: adapter_config.json needs an int r >= 1, got {cfg.get('r')!r}")
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file   # a transformers dependency

        return load_file(st)
    binf = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(binf):
        return torch.load(binf, map_location="cpu", weights_only=True)
    raise ValueError(f"lora_path {path!r} has neither adapter_model.safetensors nor adapter_model.bin")


def load_adapter(source: Union[str, AdapterTensors], model: nn.Module, dtype: torch.dtype, device: torch.device,
                 max_rank: Optional[int] = None, allowed_targets: Optional[tuple[str, ...]] = None
                 ) -> AdapterWeights:
    """Read a peft LoRA directory (or take an adapter in memory) and lay its weights out for ``model``'s
    fused linears.

    ValueError (naming the adapter) for a missing or malformed directory, unsupported features,
    a rank above ``max_rank``, targets outside ``allowed_targets``, or shapes the base model lacks."""
    if isinstance(source, AdapterTensors):
        path, tensors = source.label, source.tensors
        cfg = check_adapter_config(source.config, path)
    else:
        cfg = read_adapter_config(source)
        path = os.path.expanduser(source)
        tensors = _read_tensors(path)
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if any(u in key for u in _UNSUPPORTED_TARGETS):
            raise ValueError(f"adapter {path!r} has {key!r}: embedding / lm_head LoRA adapters are not supported")
        m = _KEY.match(key)
        if m is None or m.group(2) not in MODULE_MAP:
            raise ValueError(f"adapter {path!r}: tensor {key!r} is not a LoRA weight of "
                             f"{list(TARGET_MODULES)} in a decoder layer")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    if not pairs:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    targets = tuple(sorted({name for _, name in pairs}))
    if allowed_targets is not None and not set(targets) <= set(allowed_targets):
        raise ValueError(f"adapter {path!r} is incompatible: it targets {sorted(set(targets) - set(allowed_targets))}, "
                         f"outside "
                         f"lora_target_modules={list(allowed_targets)}")
    layers = model.model.layers
    grouped: dict[tuple[int, str], list[tuple[Any, torch.Tensor, torch.Tensor]]] = {}
    for (layer, name), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {path!r}: layer {layer} {name} lacks lora_{'A' if 'A' not in ab else 'B'}")
        if layer >= len(layers):
            raise ValueError(f"adapter {path!r} has layer {layer}; the base model has {len(layers)} layers")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if max_rank is not None and rank > max_rank:
            raise ValueError(f"adapter {path!r} is incompatible: rank {rank} ({name}) is above max_lora_rank={max_rank}")
        sub, shard = MODULE_MAP[name]
        linear = layers[layer].get_submodule(sub)
        out_lo, size = linear.shard_rows(shard) if shard is not None else (0, linear.weight.shape[0])
        want_a, want_b = (rank, linear.weight.shape[1]), (size, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(f"adapter {path!r}: layer {layer} {name} has lora_A {tuple(a.shape)} / lora_B "
                             f"{tuple(b.shape)}; the base model needs {want_a} / {want_b} (another base model?)")
        grouped.setdefault((layer, sub), []).append((out_lo, a, b))
    out = AdapterWeights(path=path, rank=r, scaling=scaling, target_modules=targets)
    for key, parts in grouped.items():
        shards, a_rows, lo = [], [], 0
        for out_lo, a, b in sorted(parts, key=lambda p: p[0]):
            shards.append(ShardLoRA(lo, lo + a.shape[0], out_lo, out_lo + b.shape[0],
                                    b.to(device=device, dtype=dtype).contiguous()))
            a_rows.append(a)
            lo += a.shape[0]
        a_all = torch.cat(a_rows).to(device=device, dtype=dtype).contiguous()
        out.modules[key] = ModuleLoRA(a_all, shards, scaling)
    return out


def fold_norms_into(weights: AdapterWeights, model: nn.Module) -> None:
    """Fold the norm weight g of folded layers into the adapter's A of qkv / gate|up: A' = A diag(g)
    (fp32, rounded once), as ``norm_fold`` did to the base weights those linears hold. Folding again
    (the norm weights changed: a weight update) starts from the adapter's own A, kept in ``a_raw``."""
    layers = model.model.layers
    for (i, sub), mod in weights.modules.items():
        layer = layers[i]
        if not getattr(layer, "folded", False):
            continue
        norm = {"self_attn.qkv_proj": layer.input_layernorm, "mlp.gate_up_proj": layer.post_attention_layernorm}.get(sub)
        if norm is not None:
            if mod.a_raw is None:
                mod.a_raw = mod.a
            mod.a = (mod.a_raw.float() * norm.weight.float()[None, :]).to(mod.a_raw.dtype)
