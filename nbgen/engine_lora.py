"""LoRA adapters on the Engine (SGLang's calls): ``load_lora_adapter`` / ``unload_lora_adapter`` and
generate()'s ``lora_path`` (an adapter name per call or per prompt; None = the base model).

As SGLang: load and unload answer a ``LoRAUpdateOutput`` (``success``, ``error_message``,
``loaded_adapters``); an adapter refused (bad path, rank, shapes, name taken) is ``success=False``
with the reason, and the engine goes on serving. An unload removes the name at once and returns once
the requests already submitted with it have finished. A request naming an adapter loaded before but
not now (unloaded, or evicted past ``max_loaded_loras``) loads it again from its path; a name never
loaded is a ValueError.
Arguments of the wrong kind raise ValueError naming the parameter. The loop-thread side is
``runtime/lora.py``; docs/lora.md has the whole story.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from nbgen.core.request import Request
from nbgen.runtime.lora import LoRAManager

logger = logging.getLogger("nbgen")


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
        if not isinstance(pinned, bool):
            raise ValueError(f"pinned must be a bool, got {pinned!r}")
        refused = self._lora_refused()
        if refused is not None:
            return refused
        mgr = self._lora()
        try:
            self._loop.call(lambda: mgr.load(lora_name, lora_path, pinned))
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
