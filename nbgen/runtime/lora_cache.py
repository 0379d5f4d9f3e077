"""Adapters no longer loaded, kept in host memory: loading one again (a request naming an adapter
evicted past ``max_loaded_loras``, or ``load_lora_adapter`` after an unload) copies it from here
instead of reading and checking its files again.

An adapter enters when its weights leave the device (``LoRAManager.release_if_unused``), as CPU copies
of its own weights (A before any norm fold). Entries are keyed by path and by the size and
modification time of the directory's files, so an adapter rewritten on disk is read again; the
least recently used go first once the cache holds more than ``max_bytes`` (``HOST_CACHE_BYTES``:
1 GiB, about 35 rank-16 adapters of all seven projections of an 8B Llama in bf16).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Optional

import torch

from nbgen.models.lora_adapter import AdapterWeights, ModuleLoRA, ShardLoRA

HOST_CACHE_BYTES = 1 << 30


def _stamp(path: str) -> tuple:
    """(name, size, mtime) of each file in the adapter directory: changes when it is rewritten."""
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_file()))
    except OSError:
        return ()


def moved(w: AdapterWeights, device: torch.device, dtype: Optional[torch.dtype] = None) -> AdapterWeights:
    """A copy of ``w``'s own weights (A unfolded) on ``device``."""
    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype or t.dtype, copy=True).contiguous()
    out = AdapterWeights(w.path, w.rank, w.scaling, w.target_modules)
    for key, m in w.modules.items():
        out.modules[key] = ModuleLoRA(to(m.a_raw if m.a_raw is not None else m.a),
                                      [ShardLoRA(s.a_lo, s.a_hi, s.out_lo, s.out_hi, to(s.b)) for s in m.shards],
                                      m.scaling)
    return out


def nbytes(w: AdapterWeights) -> int:
    return sum(t.numel() * t.element_size() for m in w.modules.values() for t in [m.a] + [s.b for s in m.shards])


class AdapterHostCache:
    """path -> an adapter's weights on the CPU, least recently used first, at most ``max_bytes``."""

    def __init__(self, max_bytes: int = HOST_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[tuple, AdapterWeights, int]] = OrderedDict()
        self.bytes = 0
        self.hits = 0

    def put(self, w: AdapterWeights) -> None:
        """Keep a CPU copy of ``w`` (its path as loaded), evicting the least recently used past the bound."""
        self._drop(w.path)
        host = moved(w, torch.device("cpu"))
        size = nbytes(host)
        if size > self.max_bytes:
            return
        self._entries[w.path] = (_stamp(w.path), host, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, path: str, device: torch.device) -> Optional[AdapterWeights]:
        """The adapter at ``path`` on ``device`` if cached and its files unchanged, else None."""
        path = os.path.expanduser(path)
        entry = self._entries.get(path)
        if entry is None:
            return None
        if entry[0] != _stamp(path):
            self._drop(path)
            return None
        self._entries.move_to_end(path)
        self.hits += 1
        return moved(entry[1], device)

    def _drop(self, path: str) -> None:
        entry = self._entries.pop(path, None)
        if entry is not None:
            self.bytes -= entry[2]

    def __len__(self) -> int:
        return len(self._entries)
