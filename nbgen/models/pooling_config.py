"""How an embedding model turns hidden states into one vector, as the model directory declares it.

A sentence-transformers layout (``modules.json`` listing a ``Transformer``, a ``Pooling`` module with
its ``<path>/config.json``, and optionally ``Normalize``) is read as written: pooling by the last
token, the mean over the prompt or the first (CLS) token, and L2 normalisation when a ``Normalize``
module is listed. Without ``modules.json`` the causal-LM embedder default applies, as in SGLang's
Llama / Qwen2 / Qwen3 models: the last token, normalised. Modules nbgen does not apply (``Dense``,
max pooling, prompt exclusion, ...) raise at start-up rather than give different vectors.

Matryoshka support (``dimensions=`` in ``encode``) comes from config.json: ``is_matryoshka`` or a
``matryoshka_dimensions`` list (then only those sizes are allowed), as SGLang reads it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from nbgen.core.request import EmbedRequest
from nbgen.core.scheduler_config import is_integral

_ST = "sentence_transformers.models."
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    """An embedding model's pooling, normalisation and Matryoshka sizes."""

    mode: str                                       # "last" | "mean" | "cls"
    normalize: bool                                 # L2-normalise the (truncated) vector
    hidden_size: int                                # the full vector's length
    matryoshka: bool = False                        # dimensions= allowed
    matryoshka_dimensions: Optional[tuple[int, ...]] = None   # the only sizes allowed, when listed
    source: str = "default"                         # "modules.json" or "default"

    def request(self, dimensions: Optional[int]) -> EmbedRequest:
        """The per-request pooling spec for ``encode(..., dimensions=...)`` (checked by the caller)."""
        return EmbedRequest(pooling=self.mode, normalize=self.normalize, dimensions=dimensions)


def check_dimensions(dimensions: Any, cfg: PoolingConfig, model: str) -> Optional[int]:
    """``dimensions`` validated against the model (a ValueError names ``dimensions``)."""
    if dimensions is None:
        return None
    # any integer type (a numpy int read from a config or an array) is a size, as in SGLang
    if not is_integral(dimensions):
        raise ValueError(f"dimensions must be an int or None, got {dimensions!r:.60}")
    dimensions = int(dimensions)
    if not cfg.matryoshka:
        raise ValueError(f"dimensions={dimensions}: model {model!r} does not support matryoshka representation "
                         "(its config.json declares neither is_matryoshka nor matryoshka_dimensions); "
                         "truncated vectors would give poor results")
    if dimensions < 1:
        raise ValueError(f"dimensions must be >= 1, got {dimensions}")
    if dimensions > cfg.hidden_size:
        raise ValueError(f"dimensions={dimensions} is larger than the model's hidden size {cfg.hidden_size}")
    if cfg.matryoshka_dimensions and dimensions not in cfg.matryoshka_dimensions:
        raise ValueError(f"dimensions={dimensions}: model {model!r} supports only the matryoshka dimensions "
                         f"{list(cfg.matryoshka_dimensions)}")
    return dimensions


def read_pooling_config(model_dir: str, hf_config: Any) -> PoolingConfig:
    """The pooling declared in ``model_dir`` (see the module docstring); ValueError for modules
    nbgen cannot apply."""
    hidden = int(hf_config.hidden_size)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    dims_t = tuple(int(d) for d in dims) if dims else None
    matryoshka = bool(dims_t) or bool(getattr(hf_config, "is_matryoshka", False))
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return PoolingConfig("last", True, hidden, matryoshka, dims_t, "default")
    with open(path, encoding="utf-8") as f:
        modules = json.load(f)
    mode, normalize = None, False
    for m in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(m.get("type", ""))
        if kind == _ST + "Transformer":
            continue
        if kind == _ST + "Normalize":
            normalize = True
        elif kind == _ST + "Pooling":
            mode = _pooling_mode(os.path.join(model_dir, m.get("path", ""), "config.json"))
        else:
            raise ValueError(f"{path}: sentence-transformers module {kind!r} ({m.get('path')!r}) is not "
                             "supported by nbgen (Transformer, Pooling and Normalize are)")
    if mode is None:
        raise ValueError(f"{path} lists no sentence_transformers.models.Pooling module")
    return PoolingConfig(mode, normalize, hidden, matryoshka, dims_t, "modules.json")


def _pooling_mode(path: str) -> str:
    """The one pooling mode a sentence-transformers Pooling config.json turns on."""
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    on = [mode for key, mode in _MODES.items() if cfg.get(key)]
    bad = [key for key in _UNSUPPORTED_MODES if cfg.get(key)]
    if bad:
        raise ValueError(f"{path}: {', '.join(bad)} is not supported by nbgen "
                         f"(pooling_mode_lasttoken, pooling_mode_mean_tokens and pooling_mode_cls_token are)")
    if len(on) != 1:
        raise ValueError(f"{path}: exactly one pooling mode must be on, got {on or 'none'}")
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt=false is not supported by nbgen")
    return on[0]
