"""LoRA serving on the loop thread: the adapter registry, the hooks in the fused linears, and each
step's rows grouped by adapter.

Adapters are loaded once (``models/lora_adapter.py``) and stay on the model's device until unloaded;
each gets an id never reused, which requests carry (``Request.lora_id``) and the prefix cache keys on.
A step whose seqs use adapters runs eagerly: the base GEMM once for every row, then per adapter
the low-rank product of its rows added into the fused output slices (``LinearLoRA``). Steps without
adapters leave the hooks inactive and run exactly as without LoRA (CUDA graphs included).

Unloading follows SGLang: the name goes at once (new requests are refused), the weights stay until
the requests already submitted with them have finished (``release_if_unused``).
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from nbgen.core.batch import ScheduledBatch
from nbgen.core.request import Request
from nbgen.models.lora_adapter import MODULE_MAP, AdapterWeights, ModuleLoRA, load_adapter
from nbgen.runtime.lora_batch import LoRABatchLimit
from nbgen.runtime.step_inputs import to_device

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


@dataclass
class LoRASegment:
    """The rows of one adapter in a step's flat token stream."""

    lora_id: int
    rows: Optional[torch.Tensor]     # [n] int64 row indices on the device; None = every row


@dataclass
class LoRAStep:
    """The per-step adapter info, built by the runner from its batch's requests."""

    segments: list[LoRASegment]


class _StepState:
    """The step the hooks serve now (None outside LoRA steps); shared by every hook of a model."""

    def __init__(self) -> None:
        self.step: Optional[LoRAStep] = None


class LinearLoRA:
    """The hook in one fused linear: adds x[rows] @ A^T @ B^T * scaling into y's shard columns."""

    def __init__(self, state: _StepState) -> None:
        self.state = state
        self.weights: dict[int, ModuleLoRA] = {}   # lora_id -> this linear's weights of that adapter

    @property
    def active(self) -> bool:
        return self.state.step is not None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x [T, in], y [T, out] (the base output, changed in place)."""
        for seg in self.state.step.segments:
            w = self.weights.get(seg.lora_id)
            if w is None:        # the adapter does not target this linear
                continue
            xs = x if seg.rows is None else x.index_select(0, seg.rows)
            t = xs @ w.a.t()                                          # [n, R] all shards' ranks
            for sh in w.shards:
                d = (t[:, sh.a_lo:sh.a_hi] @ sh.b.t()) * w.scaling    # [n, out_hi - out_lo]
                cols = y[:, sh.out_lo:sh.out_hi]
                if seg.rows is None:
                    cols.add_(d)
                else:
                    cols.index_add_(0, seg.rows, d)


class LoRAManager:
    """Adapters of one model: load / unregister / release, the caller-side name lookup, step info.

    ``load``, ``release_if_unused`` and ``begin`` / ``end`` run on the loop thread; ``resolve`` and
    ``track`` on the caller's (the registry is guarded by a lock)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 max_loaded: Optional[int], max_rank: Optional[int],
                 target_modules: Optional[tuple[str, ...]], batch_limit: LoRABatchLimit) -> None:
        self.dtype, self.device = dtype, device
        self.batch_limit = batch_limit          # max_loras_per_batch, checked by the scheduler's admission
        self.max_loaded, self.max_rank, self.target_modules = max_loaded, max_rank, target_modules
        self._model = model
        self._state = _StepState()
        self._hooks: dict[tuple[int, str], LinearLoRA] = {}
        subs = sorted({sub for sub, _ in MODULE_MAP.values()})
        for i, layer in enumerate(model.model.layers):
            for sub in subs:
                hook = LinearLoRA(self._state)
                layer.get_submodule(sub).lora = hook
                self._hooks[(i, sub)] = hook
        self._lock = threading.Lock()
        self._refs: dict[str, LoRARef] = {}                 # name -> ref (registered, usable)
        self._resident: dict[int, AdapterWeights] = {}      # lora_id -> weights (incl. unregistered in use)
        self._users: dict[int, list[Request]] = {}          # lora_id -> requests submitted with it
        self._ids = itertools.count(1)

    # ---- registry ---------------------------------------------------------------------------
    def load(self, name: str, path: str, pinned: bool = False) -> LoRARef:
        """Load an adapter under ``name`` (loop thread); ValueError if the name is taken or the
        adapter is refused (nothing changes then)."""
        with self._lock:
            if name in self._refs:
                raise ValueError(f"LoRA adapter {name!r} is already loaded (unload it first); "
                                 f"loaded: {sorted(self._refs)}")
            if self.max_loaded is not None and len(self._resident) >= self.max_loaded:
                raise ValueError(f"{len(self._resident)} LoRA adapters are loaded, the maximum "
                                 f"(max_loaded_loras={self.max_loaded}); unload one first")
            if pinned and len(self.batch_limit.pinned) >= self.batch_limit.max_loras - 1:
                # as SGLang: one slot stays free for unpinned adapters and the base model
                raise ValueError(f"LoRA adapter {name!r} cannot be pinned: {len(self.batch_limit.pinned)} "
                                 f"adapters are pinned and max_loras_per_batch={self.batch_limit.max_loras} "
                                 f"keeps one slot for the others and the base model")
        weights = load_adapter(path, self._model, self.dtype, self.device, self.max_rank, self.target_modules)
        ref = LoRARef(next(self._ids), name, weights.path, pinned)
        for key, mod in weights.modules.items():
            self._hooks[key].weights[ref.lora_id] = mod
        with self._lock:
            self._resident[ref.lora_id] = weights
            self._users[ref.lora_id] = []
            self._refs[name] = ref
        if pinned:
            self.batch_limit.pinned.add(ref.lora_id)
        return ref

    def unregister(self, name: str) -> int:
        """Remove ``name`` so new requests are refused; its id (weights stay until released)."""
        with self._lock:
            ref = self._refs.pop(name, None)
        if ref is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.loaded())}")
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
            self._resident.pop(lora_id, None)
        self.batch_limit.pinned.discard(lora_id)
        for hook in self._hooks.values():
            hook.weights.pop(lora_id, None)
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
                raise ValueError(f"lora_path: the following requested LoRA adapters are not loaded: "
                                 f"{missing}; loaded: {sorted(self._refs)}")
            for r, n in zip(reqs, names):
                if n is not None:
                    r.lora_id = self._refs[n].lora_id
                    self._users[r.lora_id].append(r)

    # ---- steps ------------------------------------------------------------------------------
    @staticmethod
    def uses_adapters(batch: ScheduledBatch) -> bool:
        """Whether any seq of the batch runs under an adapter."""
        return any(s.req.lora_id is not None for s in batch.seqs)

    def step_info(self, batch: ScheduledBatch, starts: list[int]) -> Optional[LoRAStep]:
        """The batch's rows grouped by adapter (``starts``: each seq's first row), or None."""
        rows: dict[int, list[int]] = {}
        total = 0
        for s, start in zip(batch.seqs, starts):
            total += s.q_len
            if s.req.lora_id is not None:
                if s.req.lora_id not in self._resident:
                    raise ValueError(f"LoRA adapter id {s.req.lora_id} was unloaded before request "
                                     f"{s.req.rid!r} ran")
                rows.setdefault(s.req.lora_id, []).extend(range(start, start + s.q_len))
        if not rows:
            return None
        segs = [LoRASegment(i, None if len(r) == total else to_device(r, self.device)) for i, r in rows.items()]
        return LoRAStep(segs)

    def begin(self, step: LoRAStep) -> None:
        """Activate the hooks for one forward pass."""
        self._state.step = step

    def end(self) -> None:
        self._state.step = None

    def stats(self) -> list[str]:
        """Names of the loaded adapters (the dashboard's ``lora_adapters``)."""
        return sorted(self.loaded())


def make_lora_manager(cfg: Any, model: nn.Module, dtype: torch.dtype, device: torch.device
                      ) -> Optional[LoRAManager]:
    """The manager of an ``enable_lora`` engine (None otherwise), with ``lora_paths`` loaded."""
    if not cfg.enable_lora:
        return None
    targets = cfg.lora_target_modules
    # a blocked request lets a full batch of admissions pass it before the scan stops at it
    limit = LoRABatchLimit(cfg.max_loras_per_batch, patience=cfg.max_running_requests)
    mgr = LoRAManager(model, dtype, device, cfg.lora_slots, cfg.max_lora_rank,
                      None if targets is None else tuple(targets), limit)
    for spec in cfg.lora_paths or []:
        mgr.load(spec["lora_name"], spec["lora_path"], bool(spec.get("pinned", False)))
    return mgr
