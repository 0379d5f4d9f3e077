"""Memory occupation (SGLang's ``release_memory_occupation`` / ``resume_memory_occupation``): an RL
loop hands the GPU to its trainer between rollouts and takes it back.

Tags: "weights" (the model's parameters and buffers, LoRA's adapters and slot pool), "kv_cache" (the
KV pool), "cuda_graph" (the decode and prefill graphs and their memory pools). On CUDA, released weights are copied to pinned host
memory and their device storage freed; the KV pool's storage is freed (its contents are dropped with
the prefix cache); the tensors stay the same Python objects, so every module keeps its references.
Restored storage lives at new addresses, which the CUDA graphs baked in: any release drops the graphs,
and they are captured again once nothing is released any more. On the CPU the KV pool is freed the
same way and the weights stay where they are (there is nowhere cheaper to put them); only the state
changes. While anything is released the engine refuses requests (``refusal``).
"""
from __future__ import annotations

import gc
import logging
from typing import Optional

import torch

from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.scheduler import Scheduler

logger = logging.getLogger("nbgen")

TAGS = ("weights", "kv_cache", "cuda_graph")


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class MemoryService:
    """Releases and restores the runner's memory (loop thread); ``released`` may be read anywhere."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self._runner = runner
        self._scheduler = scheduler
        self.released: frozenset[str] = frozenset()
        self._host: list[tuple[torch.UntypedStorage, torch.Tensor]] = []   # weight storages and their copies
        self._kv_bytes: list[int] = []
        self._graphs_dropped = False

    def refusal(self) -> Optional[str]:
        """Why requests are refused now (memory released), or None."""
        if not self.released:
            return None
        return (f"the engine's memory is released ({', '.join(sorted(self.released))}): call "
                "resume_memory_occupation() before generating")

    def release(self, tags: list[str]) -> None:
        """Free the memory of ``tags`` (already released ones are skipped); the engine must be idle."""
        new = [t for t in TAGS if t in tags and t not in self.released]
        if not new:
            return
        if "kv_cache" in new:
            self._scheduler.flush_cache()    # its pages' contents are about to go
            held = self._scheduler.stats()["pages_used"]
            if held:
                raise RuntimeError(f"release_memory_occupation: {held} KV page(s) are still held (open "
                                   "sessions?); close them first")
        r = self._runner
        if r.on_gpu and not self._graphs_dropped and (r.graphs is not None or r.prefill_graphs is not None):
            r.drop_graphs()          # they hold the old addresses, and a memory pool of their own
            self._graphs_dropped = True
        if "kv_cache" in new:
            kv = r.backend.k_cache + r.backend.v_cache
            self._kv_bytes = [t.untyped_storage().nbytes() for t in kv]
            for t in kv:
                t.untyped_storage().resize_(0)
        if "weights" in new and r.on_gpu:
            self._offload_weights()
        self.released = self.released | frozenset(new)
        self._settle()
        logger.info("released memory: %s", ", ".join(new))

    def resume(self, tags: list[str]) -> None:
        """Restore the memory of ``tags`` (ones not released are skipped); the graphs are captured again
        once nothing is released."""
        back = [t for t in TAGS if t in tags and t in self.released]
        r = self._runner
        if "weights" in back:
            for st, host in self._host:
                st.resize_(host.numel())
                _bytes_view(st).copy_(host)
            self._host = []
        if "kv_cache" in back:
            for t, n in zip(r.backend.k_cache + r.backend.v_cache, self._kv_bytes):
                t.untyped_storage().resize_(n)
                t.zero_()        # as allocated at start-up
        self.released = self.released - frozenset(back)
        if not self.released and self._graphs_dropped:
            r.capture_graphs()
            self._graphs_dropped = False
        if back:
            self._settle()
            logger.info("resumed memory: %s", ", ".join(back))

    def _offload_weights(self) -> None:
        """Copy each weight storage to pinned host memory and free it on the device."""
        model, lora = self._runner.model, self._runner.lora
        seen: dict[int, torch.UntypedStorage] = {}
        # LoRA: the loaded adapters and the GPU slot pool go with the weights
        for t in list(model.parameters()) + list(model.buffers()) + (lora.tensors() if lora is not None else []):
            st = t.untyped_storage()
            if st.device.type == "cuda" and st.nbytes() and st.data_ptr() not in seen:
                seen[st.data_ptr()] = st
        for st in seen.values():
            host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=True)
            host.copy_(_bytes_view(st))
            self._host.append((st, host))
        torch.cuda.synchronize()
        for st, _ in self._host:
            st.resize_(0)

    def _settle(self) -> None:
        """Return freed device memory to the driver (``torch.cuda.mem_get_info`` shows it)."""
        gc.collect()
        if self._runner.on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
