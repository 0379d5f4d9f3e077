"""FP8 checkpoints read as dequantized weights: HF ``quant_method: "fp8"`` (block-wise e4m3 weights with
``weight_scale_inv`` per ``weight_block_size`` block, or one scale per tensor) and compressed-tensors
float8 (``weight_scale`` per output channel or per tensor). The loader then turns the decoder linears
into fp8 linears (``fp8_linear.quantize_linears``) with the checkpoint's own scales expanded to 1x128
groups (``group_scales``, ``module_scales``): the values round back to the stored e4m3 bytes exactly.
Blocks whose column count is not a multiple of 128 cannot be expanded; their values are requantized.

The weight stream of such a checkpoint passes through ``dequantize_stream``: each float8 weight is held
until its scale arrives (safetensors lists ``x.weight`` before ``x.weight_scale*``), multiplied out in
float32 and handed on under the weight's name, so the model's weight loaders see an ordinary checkpoint
and cast to the engine's dtype. Activation scales (``input_scale``, static fp8 activations) are dropped
here (activations are quantized per token), and so are KV-cache scales (``k_scale`` / ``v_scale``,
compressed-tensors ``output_scale``): the fp8 KV cache reads those itself (``models/kv_scales.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# tensors of fp8 checkpoints nbgen does not read (see the module docstring)
_DROPPED = (".input_scale", ".weight_zero_point", ".k_scale", ".v_scale", ".kv_scale", ".output_scale")


@dataclass(frozen=True)
class Fp8Format:
    """How a checkpoint's float8 weights are scaled."""

    method: str                                  # "fp8" | "compressed-tensors"
    block: Optional[tuple[int, int]] = None      # (rows, cols) of one scale block (HF block-wise fp8)


def fp8_format(hf_config: Any) -> Optional[Fp8Format]:
    """The checkpoint's fp8 format from ``config.json``'s ``quantization_config``; None when the weights
    are not fp8. A quantization nbgen does not read raises a ValueError naming it."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint format {fmt!r} is not supported (e4m3 is)")
        block = qc.get("weight_block_size")
        return Fp8Format("fp8", tuple(int(b) for b in block) if block else None)
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        for g in groups.values():
            w = g.get("weights") or {}
            if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
                raise ValueError("compressed-tensors checkpoints load when their weights are float8 "
                                 f"(type float, 8 bits); this one has {w}")
        return Fp8Format("compressed-tensors")
    raise ValueError(f"quantization_config quant_method {method!r} is not supported "
                     "(supported: fp8, compressed-tensors float8; GGUF files load through load_format='gguf')")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]]) -> torch.Tensor:
    """float32 values of a float8 ``weight`` [out, in]: times ``scale`` per (bo, bi) block when ``block``
    is given (scale [ceil(out/bo), ceil(in/bi)]), else per row ([out] or [out, 1]) or per tensor (one value)."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block is not None and s.dim() == 2 and s.numel() > 1:
        bo, bi = block
        s = s.repeat_interleave(bo, 0)[: w.shape[0]].repeat_interleave(bi, 1)[:, : w.shape[1]]
        return w * s
    if s.numel() == 1:
        return w * s.reshape(())
    return w * s.reshape(-1, 1)


def group_scales(scale: torch.Tensor, shape: tuple[int, int], block: Optional[tuple[int, int]],
                 group: int = 128) -> Optional[torch.Tensor]:
    """A checkpoint scale (per tensor, per row, or per ``block``) as 1 x ``group`` scales [out, ceil(in /
    group)] fp32 with the same value on every column; None when blocks split a group."""
    out, inp = shape
    n_groups = -(-inp // group)
    s = scale.to(torch.float32)
    if block is not None and s.dim() == 2 and s.numel() > 1:
        bo, bi = block
        if bi % group:
            return None
        s = s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi // group, 1)[:, :n_groups]
        return s.contiguous()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(out, n_groups).contiguous()
    return s.reshape(-1, 1).expand(out, n_groups).contiguous()


def module_scales(model: torch.nn.Module, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint weight name -> group scales (``group_scales``) as module name -> [N, G] scales of the
    model's (fused) linears: q/k/v and gate/up rows stacked at the module's ``shard_rows`` offsets.
    A module is left out when any of its parts has no scale or its rows are not all covered."""
    modules = dict(model.named_modules())
    stacked = getattr(model, "stacked_params", [])
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, s in scales.items():
        target, shard = name, None
        for fused, part, shard_id in stacked:
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{fused}."), shard_id
                break
        mod_name = target[: -len(".weight")]
        mod = modules.get(mod_name)
        if mod is None or not hasattr(mod, "fp8"):
            continue
        offset = mod.shard_rows(shard)[0] if shard is not None else 0
        parts.setdefault(mod_name, []).append((offset, s))
    out = {}
    for mod_name, got in parts.items():
        rows = modules[mod_name].weight.shape[0]
        if sum(s.shape[0] for _, s in got) != rows:   # a part without a scale, or tensor-parallel rows
            continue
        out[mod_name] = torch.cat([s for _, s in sorted(got, key=lambda p: p[0])], dim=0)
    return out


def dequantize_stream(weights: Iterable[tuple[str, torch.Tensor]], fmt: Fp8Format,
                      scales: Optional[dict[str, torch.Tensor]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of an fp8 checkpoint with every float8 weight dequantized (see the module
    docstring); a float8 weight whose scale never comes raises a ValueError naming it. ``scales``, when
    given, receives each weight's ``group_scales`` under the weight's name."""
    parts: dict[str, dict[str, torch.Tensor]] = {}   # weight name -> its float8 "weight" / "scale" so far
    for name, t in weights:
        if name.endswith(_DROPPED):
            continue
        base = _weight_of_scale(name)
        if base is None and t.dtype not in FP8_DTYPES:
            yield name, t
            continue
        key, role = (base, "scale") if base is not None else (name, "weight")
        got = parts.setdefault(key, {})
        got[role] = t
        if len(got) == 2:                            # both halves seen, in either order
            del parts[key]
            if scales is not None and got["weight"].dim() == 2:
                gs = group_scales(got["scale"], tuple(got["weight"].shape), fmt.block)
                if gs is not None:
                    scales[key] = gs
            yield key, dequantize(got["weight"], got["scale"], fmt.block)
    missing = sorted(k for k, got in parts.items() if "weight" in got)
    if missing:
        raise ValueError(f"fp8 checkpoint: no scale for {missing[:3]} "
                         "(expected <name>_scale_inv or <name>_scale beside each float8 weight)")


def _weight_of_scale(name: str) -> Optional[str]:
    """``x.weight`` for ``x.weight_scale_inv`` / ``x.weight_scale``, else None."""
    for suffix in ("_scale_inv", "_scale"):
        if name.endswith(".weight" + suffix):
            return name[: -len(suffix)]
    return None
