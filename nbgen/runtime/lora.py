"""LoRA serving on the loop thread: the adapter registry, the hooks in the fused linears, and each
step's rows grouped by adapter.

Adapters are loaded once (``models/lora_adapter.py``) and stay on the model's device until unloaded,
then in a bounded host cache (``runtime/lora_cache.py``: loading them again reads no file); each gets
an id never reused, which requests carry (``Request.lora_id``) and the prefix cache keys on.
The base GEMM runs once for every row; the hooks (``LinearLoRA``) add the low-rank products of each
adapter's rows into the fused output slices:

- CPU (and the reference): per adapter in torch; steps with adapters run eagerly, steps without
  leave the hooks inactive.
- CUDA: a slot pool (``runtime/lora_slots.py``) and the segmented Triton kernels (``kernels/lora_sgmv.py``).
  Each decode graph size and piecewise prefill bucket has a second capture with the hooks reading the
  pool's static step buffers (``graph_variant``): steps with adapters replay it (``stage``), steps
  without replay the plain graphs (no LoRA kernels, the fused epilogues the hooks turn off). Eager
  steps with adapters (graphs off) get their row layout as fresh tensors (``step_info``).

Folded norms (``models/norm_fold.py``): an adapter's A of a folded qkv / gate|up is folded alike at
load (A' = A diag(g)), and again after a weight update (``refold``).

Unloading follows SGLang: the name goes at once (new requests are refused), the weights stay until
the requests already submitted with them have finished (``release_if_unused``).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import numpy as np
import torch
from torch import nn

from nbgen.core.batch import ScheduledBatch
from nbgen.core.request import Request
from nbgen.models.lora_adapter import AdapterTensors, AdapterWeights, fold_norms_into, load_adapter
from nbgen.runtime.cuda_graphs import GraphVariant
from nbgen.runtime.lora_batch import LoRABatchLimit
from nbgen.runtime.lora_cache import AdapterHostCache
from nbgen.runtime.lora_hooks import LinearLoRA, LoRAStep, StepState, install_hooks, torch_step
from nbgen.runtime.lora_slots import LoRASlots, seq_segments

# a request not yet at the scheduler (submission still posted, grammar compiling) keeps its adapter
# loaded this long after it was made
SUBMIT_GRACE_S = 5.0


@dataclass(frozen=True)
class LoRARef:
    """A loaded adapter's identity (SGLang's LoRARef): a unique id, its name and path."""

    lora_id: int
    lora_name: str
    lora_path: str
    pinned: bool = False


class LoRAManager:
    """Adapters of one model: load / unregister / release, the caller-side name lookup, step info.

    ``load``, ``ensure_loaded``, ``release_if_unused``, the step calls and ``begin`` / ``end`` run on
    the loop thread; ``acquire``, ``needs_reload``, ``unregister`` and ``loaded`` on the caller's (the
    registry is guarded by a lock)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 max_loaded: Optional[int], max_rank: Optional[int],
                 target_modules: Optional[tuple[str, ...]], batch_limit: LoRABatchLimit,
                 slot_rank: Optional[int] = None, graph_rows: int = 0) -> None:
        """``slot_rank``: the rank of the slot pool and its kernels (None: the torch path);
        ``graph_rows``: rows of the largest decode graph (the pool's static step buffers)."""
        self.dtype, self.device = dtype, device
        self.batch_limit = batch_limit          # max_loras_per_batch, checked by the scheduler's admission
        self.max_loaded, self.max_rank, self.target_modules = max_loaded, max_rank, target_modules
        self._model = model
        self._state = StepState()
        self._hooks: dict[tuple[int, str], LinearLoRA] = install_hooks(model, self._state)
        self.slots: Optional[LoRASlots] = None
        if slot_rank is not None:
            self.slots = LoRASlots({key: model.model.layers[key[0]].get_submodule(key[1]) for key in self._hooks},
                                   batch_limit.max_loras, slot_rank, dtype, device, max(graph_rows, 1))
            for key, hook in self._hooks.items():
                hook.slots, hook.scaling = self.slots.linears[key], self.slots.scaling
        self._lock = threading.Lock()
        self._refs: dict[str, LoRARef] = {}                 # name -> ref (registered, usable)
        self._resident: dict[int, AdapterWeights] = {}      # lora_id -> weights (incl. unregistered in use)
        self._users: dict[int, list[Request]] = {}          # lora_id -> requests submitted with it
        self._ids = itertools.count(1)
        # SGLang's registry: every name loaded once -> (path, pinned); a request naming one not loaded
        # now (unloaded, or evicted past max_loaded_loras) loads it again (``ensure_loaded``)
        self._known: dict[str, tuple[Union[str, AdapterTensors], bool]] = {}
        self._used_at: dict[str, int] = {}                  # name -> last load / request (LRU eviction)
        self._clock = itertools.count()
        self._evicted: set[int] = set()                     # evicted ids whose requests still run
        self.host_cache = AdapterHostCache()                # weights released from the device

    # ---- registry ---------------------------------------------------------------------------
    def load(self, name: str, path: Union[str, AdapterTensors], pinned: bool = False,
             keep: Optional[set[str]] = None) -> LoRARef:
        """Load an adapter (a directory, or tensors in memory) under ``name`` (loop thread); ValueError if the
        name is taken or the adapter is refused (nothing changes then). Past ``max_loaded_loras`` the least
        recently used unpinned adapter (not in ``keep``) is evicted."""
        with self._lock:
            if name in self._refs:
                raise ValueError(f"LoRA adapter {name!r} is already loaded (unload it first); "
                                 f"loaded: {sorted(self._refs)}")
            if pinned and len(self.batch_limit.pinned) >= self.batch_limit.max_loras - 1:
                # as SGLang: one slot stays free for unpinned adapters and the base model
                raise ValueError(f"LoRA adapter {name!r} cannot be pinned: it is not allowed to pin all slots "
                                 f"({len(self.batch_limit.pinned)} pinned, max_loras_per_batch="
                                 f"{self.batch_limit.max_loras}), to avoid starvation of unpinned adapters "
                                 f"and the base model")
        weights = self.host_cache.get(path if isinstance(path, str) else path.label, self.device) or \
            load_adapter(path, self._model, self.dtype, self.device, self.max_rank, self.target_modules)
        if self.slots is not None and weights.rank > self.slots.rank:
            raise ValueError(f"adapter {weights.path!r} is incompatible: rank {weights.rank} is above the GPU slot pool's rank "
                             f"{self.slots.rank} (set max_lora_rank, or list the adapter in lora_paths)")
        fold_norms_into(weights, self._model)
        self._make_room(keep or set())
        ref = LoRARef(next(self._ids), name, weights.path, pinned)
        for key, mod in weights.modules.items():
            if self.slots is None:            # the torch path's layout (the slot pool copies its own)
                self._hooks[key].add(ref.lora_id, mod)
        with self._lock:
            self._resident[ref.lora_id] = weights
            self._users[ref.lora_id] = []
            self._refs[name] = ref
            self._known[name] = (path, pinned)
            self._used_at[name] = next(self._clock)
        if pinned:
            self.batch_limit.pinned.add(ref.lora_id)
        return ref

    def _make_room(self, keep: set[str]) -> None:
        """At ``max_loaded_loras``: evict the least recently used unpinned adapter not in ``keep`` (as
        SGLang; its running requests keep it until they finish), or ValueError when none can go."""
        self._evicted = {i for i in self._evicted if not self.release_if_unused(i)}
        with self._lock:
            if self.max_loaded is None or len(self._refs) < self.max_loaded:
                return
            victims = [n for n, r in self._refs.items() if not r.pinned and n not in keep]
            if not victims:
                raise ValueError(f"{len(self._refs)} LoRA adapters are loaded, the maximum (max_loaded_loras="
                                 f"{self.max_loaded}), and none can be evicted (pinned or in use here)")
            name = min(victims, key=lambda n: self._used_at.get(n, -1))
        lora_id = self.unregister(name)
        if not self.release_if_unused(lora_id):
            self._evicted.add(lora_id)

    def needs_reload(self, name: str) -> bool:
        """``name`` was loaded once and is not loaded now (a request naming it loads it again)."""
        with self._lock:
            return name not in self._refs and name in self._known

    def ensure_loaded(self, name: str, keep: set[str]) -> None:
        """Load a known adapter again under its name if it is not loaded (loop thread); ``keep``: the
        adapters the same call needs (never evicted for it)."""
        with self._lock:
            if name in self._refs or name not in self._known:
                return
            path, pinned = self._known[name]
        self.load(name, path, pinned, keep)

    def unregister(self, name: str) -> int:
        """Remove ``name`` so new requests are refused; its id (weights stay until released)."""
        with self._lock:
            ref = self._refs.pop(name, None)
        if ref is None:
            raise ValueError(f"LoRA adapter {name!r} does not exist (not loaded); loaded: {sorted(self.loaded())}")
        return ref.lora_id

    def release_if_unused(self, lora_id: int) -> bool:
        """Drop an unregistered adapter's weights once no request submitted with it is in flight
        (loop thread); True when it is gone."""
        with self._lock:
            now = time.perf_counter()
            users = [r for r in self._users.get(lora_id, []) if not r.finished and
                     (r.arrival_seq >= 0 or now - r.arrival < SUBMIT_GRACE_S)]
            if users:
                self._users[lora_id] = users
                return False
            self._users.pop(lora_id, None)
            weights = self._resident.pop(lora_id, None)
        if weights is not None:
            self.host_cache.put(weights)
        self.batch_limit.pinned.discard(lora_id)
        for hook in self._hooks.values():
            hook.weights.pop(lora_id, None)
        if self.slots is not None:
            self.slots.evict(lora_id)
        return True

    def loaded(self) -> dict[str, str]:
        """name -> path of the registered adapters (SGLang's ``loaded_adapters``)."""
        with self._lock:
            return {n: r.lora_path for n, r in self._refs.items()}

    def acquire(self, reqs: list[Request], names: list[Optional[str]]) -> None:
        """Set each request's ``lora_id`` from its adapter name (None = the base model) and note it as
        a user (an unload waits for it); ValueError naming the adapters not loaded (nothing set)."""
        with self._lock:
            missing = sorted({n for n in names if n is not None and n not in self._refs})
            if missing:
                raise ValueError(f"lora_path: the following requested LoRA adapters are not loaded (never been "
                                 f"loaded, or unloaded): "
                                 f"{missing}; loaded: {sorted(self._refs)}")
            for r, n in zip(reqs, names):
                if n is not None:
                    r.lora_id = self._refs[n].lora_id
                    self._users[r.lora_id].append(r)
                    self._used_at[n] = next(self._clock)

    # ---- steps ------------------------------------------------------------------------------
    @staticmethod
    def uses_adapters(batch: ScheduledBatch) -> bool:
        """Whether any seq of the batch runs under an adapter."""
        return any(s.req.lora_id is not None for s in batch.seqs)

    def _used(self, batch: ScheduledBatch) -> tuple[list[Optional[int]], set[int]]:
        """Each seq's adapter id and the set of those used; ValueError if one was unloaded before its request ran."""
        ids = [s.req.lora_id for s in batch.seqs]
        used = {i for i in ids if i is not None}
        gone = used - self._resident.keys()
        if gone:
            raise ValueError(f"LoRA adapter id {min(gone)} was unloaded before request "
                             f"{next(s.req.rid for s in batch.seqs if s.req.lora_id in gone)!r} ran")
        return ids, used

    def step_info(self, batch: ScheduledBatch, starts: list[int]) -> Optional[LoRAStep]:
        """The batch's rows grouped by adapter for an eager step (``starts``: each seq's first row of
        the flat stream), or None when no row uses one."""
        ids, used = self._used(batch)
        if not used:
            return None
        if self.slots is None:
            return torch_step(batch, starts, self.device)
        slots = self.slots.assign(list(used), self._resident, self.batch_limit.pinned)
        return LoRAStep([], self.slots.eager_step(*seq_segments(ids, [s.q_len for s in batch.seqs], slots)))

    @property
    def in_graphs(self) -> bool:
        """Steps with adapters replay CUDA graphs (the slot pool's kernels were captured)."""
        return self.slots is not None

    def stage(self, batch: ScheduledBatch) -> None:
        """Before graphs replay ``batch`` (its flat stream: each seq's ``q_len`` rows in turn; a decode
        graph's row i = seq i): its adapters into slots, its rows staged. Without an adapter row nothing
        happens: the plain graphs replay and read no LoRA buffer."""
        ids, used = self._used(batch)
        if used:        # (slot, first row, rows) per seq, its adapters put in slots first
            slots = self.slots.assign(list(used), self._resident, self.batch_limit.pinned)
            self.slots.stage(*seq_segments(ids, [s.q_len for s in batch.seqs], slots))

    def graph_variant(self) -> Optional[GraphVariant]:
        """The graphs' LoRA variant (slot pool only: decode graphs and piecewise prefill graphs), replayed
        for batches with an adapter row."""
        return GraphVariant(self.capturing, self.uses_adapters) if self.slots is not None else None

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Hooks active on the static step buffers while graphs are captured (none on CPU)."""
        if self.slots is None:
            yield
            return
        self.slots.stage(*(np.zeros(0, dtype=np.int32),) * 3)    # every segment empty
        self._state.step = LoRAStep([], self.slots.graph_step)
        try:
            yield
        finally:
            self._state.step = None

    def begin(self, step: Optional[LoRAStep]) -> None:
        """Activate the hooks for one forward pass (``end``: None, inactive)."""
        self._state.step = step

    def end(self) -> None:
        self.begin(None)

    def refold(self) -> None:
        """After a weight update (loop thread): fold the adapters' A again with the norm weights now."""
        with self._lock:
            resident = dict(self._resident)
        for lora_id, weights in resident.items():
            fold_norms_into(weights, self._model)
            for key, mod in weights.modules.items() if self.slots is None else ():
                self._hooks[key].add(lora_id, mod)
        if self.slots is not None:
            self.slots.reload(resident)

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors of the loaded adapters and the slot pool (memory release offloads them)."""
        with self._lock:
            out = [t for w in self._resident.values() for m in w.modules.values() for t in m.tensors()]
        return out + (self.slots.tensors() if self.slots is not None else [])

    def stats(self) -> list[str]:
        """Names of the loaded adapters (the dashboard's ``lora_adapters``)."""
        return sorted(self.loaded())
