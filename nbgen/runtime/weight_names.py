"""HF checkpoint names -> nbgen parameters, for weight updates and reads (``get_weights_by_name``).

nbgen fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` and ties ``lm_head`` to the
embedding where the config says so. ``WeightNames`` maps each HF name to a ``Slot``: the parameter,
which rows of a fused one (the model's own ``stacked_params`` table and the linears' ``shard_rows``,
the ones its weight loaders use), and the shape an update must have. ``read`` gives the checkpoint's
value back: rows of a fused parameter, folded norms divided out again, CPU-packed weights unpacked.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from nbgen.models import norm_fold

Shard = Union[str, int, None]

# tensors a checkpoint may carry that the model computes itself (HF's rotary caches)
_IGNORED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class Slot:
    """Where one named tensor goes."""

    name: str                             # as the caller named it (HF name, or nbgen's with "direct")
    param: str                            # the nbgen parameter it loads into
    shard: Shard                          # "q" / "k" / "v", 0 / 1 (gate / up), None: the whole parameter
    rows: Optional[tuple[int, int]]       # (first row, rows) of the shard in the parameter
    shape: tuple[int, ...]                # the shape a tensor for it must have
    tied: bool = False                    # lm_head.weight of a tied model: the embedding (updates skip it)
    cols: Optional[tuple[int, int]] = None   # (first column, columns) of a parameter padded wider


class WeightNames:
    """The HF names of one model's parameters (built once per model)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.table: dict[str, Slot] = {}
        self.fused: set[str] = set()       # parameters that hold several HF tensors (q|k|v, gate|up)
        stacked = getattr(model, "stacked_params", [])
        for pname, p in self.params.items():
            owner = model.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else model   # top-level: LLaVA-NeXT's image_newline
            parts = [(fused, part, shard) for fused, part, shard in stacked if f".{fused}." in pname]
            if parts:
                self.fused.add(pname)
            for fused, part, shard in parts:      # a fused parameter: one HF name per shard
                hf = pname.replace(f".{fused}.", f".{part}.")
                first, n = owner.shard_rows(shard)
                self.table[hf] = Slot(hf, pname, shard, (first, n), (n,) + tuple(p.shape[1:]))
            if not parts:   # a parameter padded wider than its checkpoint tensor names its columns
                cols = getattr(p, "checkpoint_cols", None)
                shape = tuple(p.shape) if cols is None else (p.shape[0], cols[1], *p.shape[2:])
                self.table[pname] = Slot(pname, pname, None, None, shape, cols=cols)
        emb = "model.embed_tokens.weight"
        if getattr(model, "tie_word_embeddings", False) and emb in self.params:
            self.table["lm_head.weight"] = Slot("lm_head.weight", emb, None, None, tuple(self.params[emb].shape),
                                                tied=True)

    @staticmethod
    def ignored(name: str) -> bool:
        """A checkpoint tensor the model does not read (HF's rotary caches)."""
        return any(k in name for k in _IGNORED)

    def resolve(self, name: str, direct: bool = False) -> Optional[Slot]:
        """The slot of an HF name (checkpoints of the base model, without ``model.``, too), or with
        ``direct`` of an nbgen parameter name (the whole parameter); None when the model has none."""
        if direct:
            p = self.params.get(name)
            return None if p is None else Slot(name, name, None, None, tuple(p.shape))
        if name.startswith(("layers.", "embed_tokens.", "norm.")):
            name = "model." + name
        return self.table.get(name)

    def unknown(self, name: str, direct: bool = False) -> str:
        """The error text for a name without a slot, with the closest known name."""
        known = list(self.params) if direct else list(self.table)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        kind = "parameter" if direct else "weight"
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{type(self.model).__name__} has no {kind} named {name!r}{hint}"

    def missing(self, slots: list[Slot]) -> list[str]:
        """HF names of the model that ``slots`` leave without a value (a partial checkpoint)."""
        have = {(s.param, s.shard) for s in slots}
        return [n for n, s in self.table.items() if not s.tied and (s.param, s.shard) not in have]

    def dense(self, param: str) -> torch.Tensor:
        """A parameter's values (a CPU-packed linear's weight rebuilt from its packed copy)."""
        p = self.params[param]
        owner = self.model.get_submodule(param.rsplit(".", 1)[0])
        if getattr(owner, "packed", None) is not None and hasattr(owner, "dense_weight") and owner.weight is p:
            return owner.dense_weight()
        return p.data

    @torch.no_grad()
    def read(self, slot: Slot) -> torch.Tensor:
        """The checkpoint's value of a slot as fp32 on the CPU (folded norms divided out again)."""
        w = self.dense(slot.param)
        if slot.rows is not None:
            w = w.narrow(0, *slot.rows)
        if slot.cols is not None:
            w = w.narrow(1, *slot.cols)
        norm = norm_fold.fold_map(self.model).get(slot.param)
        if norm is not None:
            w = norm_fold.unfolded(w, self.params[norm].data)
        return w.float().cpu()
