"""LoRA adapters on the Engine (SGLang's calls): ``load_lora_adapter`` (a peft directory),
``load_lora_adapter_from_tensors`` (an adapter in memory), ``unload_lora_adapter`` and generate()'s ``lora_path`` (an adapter name per call or per prompt; None = the base model).

As SGLang: load and unload answer a ``LoRAUpdateOutput`` (``success``, ``error_message``,
``loaded_adapters``); an adapter refused (bad path, rank, shapes, name taken) is ``success=False``
with the reason, and the engine goes on serving. An unload removes the name at once and returns once
the requests already submitted with it have finished. A request naming an adapter loaded before but
not now (unloaded, or evicted past ``max_loaded_loras``) loads it again from its path (an adapter given
as tensors: from the engine's copy of them); a name never loaded is a ValueError.
Arguments of the wrong kind raise ValueError naming the parameter. The loop-thread side is
``runtime/lora.py``; docs/lora.md has the whole story.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from nbgen.core.request import Request
from nbgen.engine_weights import named_pairs
from nbgen.models.lora_adapter import AdapterTensors
from nbgen.runtime.lora import LoRAManager

logger = logging.getLogger("nbgen")
_TENSOR_LOADS = itertools.count(1)   # each in-memory adapter's label (its host-cache key) is new


@dataclass
class LoRAUpdateOutput:
    """SGLang's answer to load / unload: success, the error, and name -> path of the adapters loaded."""

    success: bool
    error_message: Optional[str] = None
    loaded_adapters: dict[str, str] = field(default_factory=dict)


def _check_name(lora_name: Any) -> None:
    if not isinstance(lora_name, str) or not lora_name:
        raise ValueError(f"lora_name must be a non-empty str, got {lora_name!r:.60}")


class LoRAMixin:
    """LoRA calls for Engine (uses its _loop, config and _check_alive)."""

    def _lora(self) -> Optional[LoRAManager]:
        runner = self._loop.runner
        return runner.lora if runner is not None else None

    def _lora_refused(self) -> Optional[LoRAUpdateOutput]:
        if self._lora() is None:
            return LoRAUpdateOutput(False, "LoRA is not enabled: create the Engine with enable_lora=True "
                                           "(or lora_paths=[...])")
        return None

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> LoRAUpdateOutput:
        """Load a peft LoRA adapter directory under ``lora_name`` without restarting the engine;
        generate(..., lora_path=lora_name) then uses it. -> LoRAUpdateOutput."""
        self._check_alive()
        _check_name(lora_name)
        if not isinstance(lora_path, str) or not lora_path:
            raise ValueError(f"lora_path must be a non-empty str (a peft adapter directory), got {lora_path!r:.60}")
        return self._load_lora(lora_name, lora_path, pinned)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict[str, Any],
                                       load_format: Optional[str] = None, pinned: bool = False) -> LoRAUpdateOutput:
        """Load a LoRA adapter held in memory under ``lora_name`` (SGLang's call, e.g. weights fresh from a
        training step): ``tensors`` maps peft's weight names (``base_model.model.model.layers.0.self_attn.
        q_proj.lora_A.weight`` ...) to tensors, or is a list of (name, tensor) pairs; ``config_dict`` is the
        adapter's adapter_config.json as a dict. The tensors are copied (later changes to them do not reach
        the engine). -> LoRAUpdateOutput, as ``load_lora_adapter``."""
        self._check_alive()
        _check_name(lora_name)
        if load_format is not None:
            raise ValueError(f"load_format={load_format!r} is not supported: pass the tensors themselves "
                             f"(a dict of name -> tensor) and load_format=None")
        if not isinstance(config_dict, dict):
            raise ValueError(f"config_dict must be a dict (the adapter's adapter_config.json), got "
                             f"{type(config_dict).__name__}")
        pairs = named_pairs(tensors, "tensors")
        if not pairs:
            raise ValueError("tensors must be a non-empty dict of weight name -> torch.Tensor (or a list of "
                             f"(name, tensor) pairs), got an empty {type(tensors).__name__}")
        copied = {k: v.detach().to("cpu", copy=True) for k, v in pairs}
        source = AdapterTensors(f"<tensors {next(_TENSOR_LOADS)}>", copy.deepcopy(config_dict), copied)
        return self._load_lora(lora_name, source, pinned)

    def _load_lora(self, lora_name: str, source: Union[str, AdapterTensors], pinned: Any) -> LoRAUpdateOutput:
        if not isinstance(pinned, bool):
            raise ValueError(f"pinned must be a bool, got {pinned!r}")
        refused = self._lora_refused()
        if refused is not None:
            return refused
        mgr = self._lora()
        try:
            self._loop.call(lambda: mgr.load(lora_name, source, pinned))
        except ValueError as e:
            logger.warning("nbgen: LoRA adapter %r not loaded: %s", lora_name, e)
            return LoRAUpdateOutput(False, str(e), mgr.loaded())
        return LoRAUpdateOutput(True, None, mgr.loaded())

    def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        """Unload an adapter: new requests naming it are refused at once; returns once the requests
        already submitted with it have finished (they keep it until then). -> LoRAUpdateOutput."""
        self._check_alive()
        _check_name(lora_name)
        refused = self._lora_refused()
        if refused is not None:
            return refused
        mgr = self._lora()
        try:
            lora_id = mgr.unregister(lora_name)
        except ValueError as e:
            return LoRAUpdateOutput(False, str(e), mgr.loaded())
        while not self._loop.call(lambda: mgr.release_if_unused(lora_id)):
            time.sleep(0.01)
        return LoRAUpdateOutput(True, None, mgr.loaded())

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str,
                                      pinned: bool = False) -> LoRAUpdateOutput:
        """Awaitable twin of load_lora_adapter() (SGLang's); it runs in a worker thread, so the
        event loop goes on serving meanwhile."""
        return await asyncio.to_thread(self.load_lora_adapter, lora_name, lora_path, pinned)

    async def async_load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict[str, Any],
                                                   load_format: Optional[str] = None,
                                                   pinned: bool = False) -> LoRAUpdateOutput:
        """Awaitable twin of load_lora_adapter_from_tensors(); it runs in a worker thread."""
        return await asyncio.to_thread(self.load_lora_adapter_from_tensors, lora_name, tensors, config_dict,
                                       load_format, pinned)

    async def async_unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        """Awaitable twin of unload_lora_adapter() (SGLang's): it returns once the requests already
        submitted with the adapter have finished, while the event loop goes on serving them."""
        return await asyncio.to_thread(self.unload_lora_adapter, lora_name)

    def list_lora_adapters(self) -> dict[str, str]:
        """name -> path of the loaded adapters (empty without enable_lora)."""
        mgr = self._lora()
        return mgr.loaded() if mgr is not None else {}

    def _attach_lora(self, reqs: list[Request], counts: list[int], lora_path: Any) -> None:
        """Set each request's adapter from generate()'s ``lora_path`` (``counts``: requests per prompt,
        n > 1 makes several); ValueError naming lora_path for a bad value or an adapter not loaded."""
        if lora_path is None:
            return
        n = len(counts)
        if isinstance(lora_path, (list, tuple)):
            if len(lora_path) != n:
                raise ValueError(f"lora_path has {len(lora_path)} entries for {n} prompts")
            names = list(lora_path)
        else:
            names = [lora_path] * n
        for name in names:
            if name is not None and (not isinstance(name, str) or not name):
                raise ValueError(f"lora_path must be None, an adapter name or a list of them (one per "
                                 f"prompt), got {name!r:.60}")
        if all(name is None for name in names):
            return
        mgr = self._lora()
        if mgr is None:
            raise ValueError("lora_path needs an Engine with enable_lora=True (or lora_paths=[...])")
        wanted = {name for name in names if name is not None}
        for name in sorted(wanted):
            if mgr.needs_reload(name):       # unloaded or evicted: loaded again, as SGLang
                try:
                    self._loop.call(lambda name=name: mgr.ensure_loaded(name, wanted))
                except ValueError as e:
                    raise ValueError(f"lora_path: adapter {name!r} could not be loaded again: {e}") from None
        mgr.acquire(reqs, [name for name, count in zip(names, counts) for _ in range(count)])
