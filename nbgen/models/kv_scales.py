"""The fp8 KV cache's per-layer scales from a checkpoint (``kv_cache_dtype="fp8_e4m3"``).

Quantized checkpoints may carry the scale each layer's K and V were calibrated with: the e4m3 cache
then stores K / k_scale and V / v_scale (``attention/kv_quant.py``). The tensor names follow the
formats SGLang and vLLM read, per decoder layer ``model.layers.{i}.self_attn.``:
  * ``k_scale`` / ``v_scale`` (also under ``attn.``, or ``k_proj.k_scale`` / ``v_proj.v_scale``),
  * ``k_proj.output_scale`` / ``v_proj.output_scale`` (compressed-tensors),
  * ``kv_scale`` (an older single scale for both).
Only the safetensors headers and these few scalars are read. A scale given per head is reduced to
its maximum (one scale per tensor: no head saturates); layers without a scale keep 1.0.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Optional

from safetensors import safe_open

logger = logging.getLogger("nbgen")

# layers.{i}.self_attn.[attn.][k_proj. | v_proj.](k_scale | v_scale | kv_scale | output_scale)
_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:([kv])_proj\.)?(k_scale|v_scale|kv_scale|output_scale)$")


def scale_kind(name: str) -> Optional[tuple[int, str]]:
    """(layer, "k" | "v" | "kv") of a KV-cache scale tensor's name; None for any other tensor."""
    m = _NAME.search(name)
    if m is None:
        return None
    layer, proj, what = int(m.group(1)), m.group(2), m.group(3)
    if what == "kv_scale":
        return layer, "kv"
    if what == "output_scale":
        return (layer, proj) if proj else None
    kind = what[0]
    return (layer, kind) if proj in (None, kind) else None


def read_kv_scales(model_dir: str, num_layers: int) -> tuple[tuple[float, float], ...]:
    """Per layer (k_scale, v_scale) from the checkpoint's safetensors files in ``model_dir``; () when
    it has none (the cache then uses 1.0). Scales must be finite and positive (ValueError naming the
    tensor otherwise)."""
    if not model_dir or not os.path.isdir(model_dir):
        return ()
    k = [1.0] * num_layers
    v = [1.0] * num_layers
    found = 0
    for path in sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors")):
        with safe_open(path, framework="pt", device="cpu") as f:     # headers, then the few scalars
            for name in f.keys():
                kind = scale_kind(name)
                if kind is None or kind[0] >= num_layers:
                    continue
                value = float(f.get_tensor(name).float().abs().max())     # per head: the largest
                if not (0.0 < value < float("inf")):
                    raise ValueError(f"KV-cache scale {name!r} must be finite and positive, got {value}")
                layer, which = kind
                if which in ("k", "kv"):
                    k[layer] = value
                if which in ("v", "kv"):
                    v[layer] = value
                found += 1
    if not found:
        return ()
    logger.info("fp8 KV cache: %d K/V scale tensors read from the checkpoint", found)
    return tuple(zip(k, v))

