"""Weights and memory for RL and notebook loops (SGLang's Engine calls): update the weights from
tensors, a checkpoint on disk or a trainer's broadcasts, read them back by HF name, and release /
resume the GPU memory between rollouts.

Updates wait for the requests submitted before them to finish; requests submitted meanwhile start
after the update, with the new weights (SGLang's model-update lock). Each update returns SGLang's
``(success, message)`` (``update_weights_from_disk``: ``(success, message, num_paused_requests)``); a
bad name, shape or dtype answers ``(False, message)`` and changes nothing. Arguments of the wrong
kind raise ValueError naming the parameter. The loop-thread side is ``runtime/weights.py`` and
``runtime/memory.py``; docs/api.md "Weights and memory" has the whole story.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from nbgen.runtime.memory import TAGS
from nbgen.runtime.weight_sync import parse_dtype

NamedTensors = Union[Iterable[tuple[str, torch.Tensor]], Mapping[str, torch.Tensor]]
_DISK_FORMATS = ("auto", "safetensors", "gguf")


def named_pairs(named_tensors: Any, param: str = "named_tensors") -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] from a list of pairs or a dict (a state_dict); ValueError naming ``param`` otherwise
    (also for a tensor without data to copy)."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    if isinstance(items, (str, bytes, torch.Tensor)) or not hasattr(items, "__iter__"):
        raise ValueError(f"{param} must be a list of (name, tensor) pairs or a dict of tensors, "
                         f"got {type(named_tensors).__name__}")
    pairs = []
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"{param}[{i}] must be a (name, torch.Tensor) pair, got {item!r:.80}")
        t = item[1]
        if t.is_meta or t.layout != torch.strided:   # no data to copy: found here, before any write
            raise ValueError(f"{param}[{i}] ({item[0]!r}) must be a dense tensor with data, got a "
                             f"{'meta' if t.is_meta else t.layout} tensor")
        pairs.append((item[0], t))
    return pairs


def _check_group_name(group_name: Any) -> None:
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"group_name must be a non-empty str, got {group_name!r}")


def _check_version(weight_version: Any) -> None:
    if weight_version is not None and not isinstance(weight_version, str):
        raise ValueError(f"weight_version must be None or a str, got {weight_version!r}")


def _check_common(load_format: Any, flush_cache: Any, weight_version: Any) -> None:
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format must be None (HF names) or 'direct' (nbgen's parameter names), "
                         f"got {load_format!r}")
    if not isinstance(flush_cache, bool):
        raise ValueError(f"flush_cache must be a bool, got {flush_cache!r}")
    _check_version(weight_version)


def _tags(tags: Any) -> list[str]:
    """SGLang's tags: None or [] = all of them."""
    if tags is None:
        return list(TAGS)
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or \
            not all(isinstance(t, str) and t in TAGS for t in tags):
        raise ValueError(f"tags must be None or a list drawn from {list(TAGS)}, got {tags!r}")
    return list(tags) or list(TAGS)


class WeightsMixin:
    """Weight updates, reads and memory occupation for Engine (uses its _loop, config, _check_alive)."""

    def _check_one_copy(self, call: str) -> None:
        """Weights and memory are handled for one copy of the model: refused with tp/dp > 1."""
        if self.config.tp_size > 1 or self.config.dp_size > 1:
            raise ValueError(f"{call} needs tp_size 1 and dp_size 1 (got tp_size={self.config.tp_size}, "
                             f"dp_size={self.config.dp_size})")

    def _check_weights_in_place(self, call: str) -> None:
        """Weights read and written in place: refused while layers are offloaded to the host (their
        device tensors are staging buffers shared by those layers)."""
        if self.config.cpu_offload_gb:
            raise ValueError(f"{call} is not supported with cpu_offload_gb={self.config.cpu_offload_gb} "
                             "(offloaded layers share their device buffers)")

    @property
    def weight_version(self) -> str:
        """The name of the weights now loaded ("default" until an update names them)."""
        return self._loop.weights.version

    def update_weights_from_tensor(self, named_tensors: NamedTensors, load_format: Optional[str] = None,
                                   flush_cache: bool = True, *,
                                   weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Load tensors into the model by HF name (``model.layers.0.self_attn.q_proj.weight``; nbgen's
        own parameter names with ``load_format="direct"``) -> ``(success, message)``. Any subset of the
        weights may be sent; ``flush_cache`` drops the prefix cache (its K/V came from the old
        weights); ``weight_version`` renames the weights (``meta_info["weight_version"]``)."""
        pairs = named_pairs(named_tensors)
        _check_common(load_format, flush_cache, weight_version)
        self._check_one_copy("update_weights_from_tensor")
        self._check_weights_in_place("update_weights_from_tensor")
        self._check_alive()
        return self._loop.call_exclusive(
            lambda: self._loop.weights.update_from_tensors(pairs, load_format, flush_cache, weight_version))

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None, *,
                                 weight_version: Optional[str] = None) -> tuple[bool, str, int]:
        """Load every weight of a checkpoint of the same architecture (an HF directory or a .gguf)
        -> ``(success, message, num_paused_requests)`` (0: updates wait instead of pausing). On
        success ``get_server_info()``'s ``model_path`` and ``load_format`` are the new ones; the
        tokenizer stays."""
        if not isinstance(model_path, (str, os.PathLike)):
            raise ValueError(f"model_path must be a path, got {model_path!r}")
        fmt = load_format if load_format is not None else \
            (self.config.load_format if self.config.load_format in _DISK_FORMATS else "auto")
        if fmt not in _DISK_FORMATS:
            raise ValueError(f"load_format must be None or one of {_DISK_FORMATS}, got {load_format!r}")
        _check_version(weight_version)
        self._check_one_copy("update_weights_from_disk")
        self._check_weights_in_place("update_weights_from_disk")
        self._check_alive()
        path = os.path.expanduser(os.fspath(model_path))
        ok, message = self._loop.call_exclusive(
            lambda: self._loop.weights.update_from_disk(path, fmt, weight_version))
        if ok:    # get_server_info() names what is loaded now, as SGLang's
            self.config.model_path, self.config.load_format = path, fmt
        return ok, message, 0

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Optional[list]:
        """The values of one weight by HF name, as the checkpoint has them (one of q/k/v or gate/up
        out of nbgen's fused parameters, a folded norm divided out again): nested fp32 lists of its
        first ``truncate_size`` rows; None (with a logged warning) for a name the model lacks."""
        if not isinstance(name, str):
            raise ValueError(f"name must be a str, got {name!r}")
        if not isinstance(truncate_size, int) or isinstance(truncate_size, bool) or truncate_size < 0:
            raise ValueError(f"truncate_size must be an int >= 0, got {truncate_size!r}")
        self._check_one_copy("get_weights_by_name")
        self._check_weights_in_place("get_weights_by_name")
        self._check_alive()
        return self._loop.call(lambda: self._loop.weights.get(name, truncate_size))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str = "nccl") -> tuple[bool, str]:
        """Join a trainer's torch.distributed group (the trainer is rank 0 and hosts it at
        master_address:master_port; this engine is rank ``rank_offset``); blocks until every rank
        joined -> ``(success, message)``. The trainer builds its side with the same recipe
        (``nbgen.runtime.weight_sync.init_custom_process_group``, or SGLang's)."""
        for arg, value in (("master_port", master_port), ("rank_offset", rank_offset), ("world_size", world_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{arg} must be an int >= 0, got {value!r}")
        if not 0 < rank_offset < world_size:
            raise ValueError(f"rank_offset must be in [1, world_size) (the trainer is rank 0), got {rank_offset}")
        if not isinstance(master_address, str) or not master_address:
            raise ValueError(f"master_address must be a non-empty str, got {master_address!r}")
        _check_group_name(group_name)
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        self._check_one_copy("init_weights_update_group")
        self._check_alive()
        return self._loop.weights.groups.init(master_address, master_port, rank_offset, world_size,
                                              group_name, backend)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[Any],
                                        shapes: Sequence[Sequence[int]], group_name: str = "weight_update_group",
                                        flush_cache: bool = True, load_format: Optional[str] = None, *,
                                        weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Receive one broadcast from the trainer (rank 0 of ``group_name``) per name, in order, and load
        them as ``update_weights_from_tensor`` -> ``(success, message)``. The trainer calls
        ``torch.distributed.broadcast(tensor, src=0, group=...)`` for each, at the same time."""
        if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
            raise ValueError(f"names must be a list of strs, got {names!r:.80}")
        if not isinstance(dtypes, (list, tuple)) or not isinstance(shapes, (list, tuple)) or \
                not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes must be lists of the same length")
        dts = [parse_dtype(d) for d in dtypes]
        if not all(isinstance(s, (list, tuple, torch.Size)) and
                   all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s) for s in shapes):
            raise ValueError(f"shapes must be lists of ints >= 0, got {shapes!r:.80}")
        _check_group_name(group_name)
        _check_common(load_format, flush_cache, weight_version)
        self._check_one_copy("update_weights_from_distributed")
        self._check_weights_in_place("update_weights_from_distributed")
        self._check_alive()
        return self._loop.call_exclusive(lambda: self._loop.weights.update_from_group(
            list(names), dts, [list(s) for s in shapes], group_name, flush_cache, load_format, weight_version))

    def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        """Leave and destroy a weight-update group -> ``(success, message)``."""
        _check_group_name(group_name)
        self._check_alive()
        return self._loop.weights.groups.destroy(group_name)

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Free GPU memory for a trainer: ``tags`` from "weights" (kept in pinned host memory),
        "kv_cache" (contents dropped), "cuda_graph"; None = all. Waits for running requests;
        generation raises RuntimeError until ``resume_memory_occupation``."""
        tags = _tags(tags)
        self._check_one_copy("release_memory_occupation")
        self._check_alive()
        self._loop.call_exclusive(lambda: self._loop.memory.release(tags))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Take released memory back (``tags`` as ``release_memory_occupation``); once nothing is
        released the CUDA graphs are captured again and the engine serves as before."""
        tags = _tags(tags)
        self._check_one_copy("resume_memory_occupation")
        self._check_alive()
        self._loop.call(lambda: self._loop.memory.resume(tags))
