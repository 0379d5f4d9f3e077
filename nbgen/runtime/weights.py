"""Weight updates and reads on the loop thread: SGLang's ``update_weights_from_tensor`` /
``_from_disk`` / ``_from_distributed`` and ``get_weights_by_name``, and the ``weight_version``.

An update is checked whole before anything is written (every name known, every shape the model's,
every dtype floating point): a bad one changes nothing and answers ``(False, message)``. The tensors
then go in place through the model's weight loaders (q/k/v and gate/up shards of the fused
parameters; ``lm_head.weight`` of a tied model is the embedding and is skipped), so parameters keep
their storage and the CUDA graphs stay valid. Folded norms (CUDA, bf16; ``models/norm_fold.py``):
rows loaded into a folded qkv / gate|up are folded with the layer's norm weight right after; a new
norm weight first rescales its projection's columns by new / old, so rows sent in the same update are
loaded exactly and the others take one more bf16 rounding. CPU-packed bf16 linears are unpacked,
updated and packed again. The engine runs updates once the requests submitted before them finished
(``LoopThread.call_exclusive``).
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence

import torch

from nbgen.models import norm_fold
from nbgen.models.linear import default_weight_loader
from nbgen.models.loader import checkpoint_dir, checkpoint_metadata, iter_safetensors
from nbgen.runtime.memory import MemoryService
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.weight_names import Slot, WeightNames
from nbgen.runtime.weight_sync import UpdateGroups

logger = logging.getLogger("nbgen")

Entry = tuple[str, tuple[int, ...], bool]     # (name, shape, floating-point dtype)


class _Writer:
    """Writes slots in place (see the module docstring); ``close`` packs CPU linears again."""

    def __init__(self, names: WeightNames) -> None:
        self.names = names
        self.fold = norm_fold.fold_map(names.model)             # fused weight -> its folded norm
        self.folded_into = {v: k for k, v in self.fold.items()}  # folded norm -> fused weight
        self.unpacked: list[torch.nn.Module] = []
        self.touched: set[str] = set()

    def first(self, slot: Slot) -> bool:
        """Folded norms go before the rows they scale."""
        return slot.param in self.folded_into

    @torch.no_grad()
    def write(self, slot: Slot, t: torch.Tensor) -> None:
        params, model = self.names.params, self.names.model
        p = params[slot.param]
        owner = model.get_submodule(slot.param.rsplit(".", 1)[0])
        if getattr(owner, "packed", None) is not None and hasattr(owner, "unpack_cpu") and owner.weight is p:
            owner.unpack_cpu()
            self.unpacked.append(owner)
        fused = self.folded_into.get(slot.param)
        if fused is not None:   # a folded norm changes: its projection's columns by new / old
            norm_fold.refold(params[fused].data, p.data, t.to(device=p.device, dtype=p.dtype))
        if slot.shard is not None:
            p.weight_loader(p, t, slot.shard)
        elif slot.param in self.names.fused:     # a whole fused parameter (load_format="direct")
            default_weight_loader(p, t)
        else:
            getattr(p, "weight_loader", default_weight_loader)(p, t)
        norm = self.fold.get(slot.param)
        if norm is not None:    # rows just loaded unfolded
            rows = p.data if slot.rows is None else p.data.narrow(0, *slot.rows)
            norm_fold.fold_rows(rows, params[norm].data)
        self.touched.add(slot.param)

    def close(self) -> None:
        for m in self.unpacked:
            m.prepack_cpu()
        head = getattr(self.names.model, "lm_head", None)
        if getattr(head, "packed", None) is not None and \
                any(self.names.params[n] is head.weight for n in self.touched):
            head.prepack_cpu()     # its packed copy of the (tied) embedding


def _succeeded(message: str, weight_version: Optional[str]) -> tuple[bool, str]:
    """SGLang's success answer: the message, and the new version when the update names one."""
    if weight_version is None:
        return True, message
    return True, f"{message} Weight version updated to {weight_version}."


def _failed(errors: list[str]) -> str:
    more = f"; and {len(errors) - 5} more" if len(errors) > 5 else ""
    return f"Failed to update weights (nothing was changed): {'; '.join(errors[:5])}{more}"


class WeightService:
    """Updates and reads the runner's weights (loop thread); ``version`` and ``groups`` from any."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, memory: MemoryService, version: str,
                 load_format: str) -> None:
        self.version = version                  # SGLang's weight_version: the caller names it
        self.groups = UpdateGroups()            # update_weights_from_distributed's process groups
        self._names = WeightNames(runner.model)
        self._device = runner.device
        self._scheduler = scheduler
        self._memory = memory
        self._lora = runner.lora                # adapters folded with the norm weights (refold)
        self._model_dir = runner.loaded.model_dir   # what a failed disk update rolls back to
        self._from_disk = load_format != "dummy"    # a checkpoint on disk to roll back to

    def close(self) -> None:
        """Let go of the model (engine shutdown); ``version`` stays readable."""
        self._names = self._scheduler = self._memory = None   # type: ignore[assignment]

    # ---- reads ------------------------------------------------------------------------------------
    def get(self, name: str, truncate_size: int) -> Optional[list]:
        """The checkpoint value of an HF weight name (or an nbgen parameter name) as nested fp32 lists,
        its first ``truncate_size`` rows; None (logged) when the model has no such weight, as SGLang."""
        if "weights" in self._memory.released:
            raise RuntimeError("the weights are released: call resume_memory_occupation() first")
        slot = self._names.resolve(name) or self._names.resolve(name, direct=True)
        if slot is None:
            logger.warning("get_weights_by_name: %s", self._names.unknown(name))
            return None
        return self._names.read(slot)[:truncate_size].numpy().tolist()

    # ---- updates ----------------------------------------------------------------------------------
    def update_from_tensors(self, named: Sequence[tuple[str, torch.Tensor]], load_format: Optional[str],
                            flush_cache: bool, weight_version: Optional[str]) -> tuple[bool, str]:
        """Load in-memory tensors (HF names; nbgen's parameter names with load_format="direct")."""
        return self._update(named, load_format == "direct", flush_cache, weight_version, "Success")

    def update_from_group(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                          shapes: Sequence[Sequence[int]], group_name: str, flush_cache: bool,
                          load_format: Optional[str], weight_version: Optional[str]) -> tuple[bool, str]:
        """Receive the trainer's broadcasts (always all of them, so that both sides stay in step), then
        load them as ``update_from_tensors``."""
        try:
            named = self.groups.receive(names, dtypes, shapes, group_name, self._device)
        except Exception as e:  # noqa: BLE001 - answered as SGLang does
            return False, f"Failed to update parameter online: {e}."
        return self._update(named, load_format == "direct", flush_cache, weight_version,
                            "Succeeded to update parameter online.")

    def update_from_disk(self, model_path: str, load_format: str,
                         weight_version: Optional[str]) -> tuple[bool, str]:
        """Load every weight of a checkpoint with the model's architecture (headers checked first)."""
        if (err := self._blocked()) is not None:
            return False, err
        try:
            new_dir = checkpoint_dir(model_path, load_format)
            meta = checkpoint_metadata(new_dir)
        except Exception as e:  # noqa: BLE001
            return False, f"Failed to get weights iterator: {e}."
        slots, errors = self._plan([(n, shape, dt.startswith(("F", "BF"))) for n, shape, dt in meta], False)
        missing = self._names.missing([s for s in slots if s is not None])
        if missing:
            errors.append(f"the checkpoint lacks {len(missing)} weight(s) of the model, e.g. {missing[:3]}")
        if errors:
            return False, _failed(errors)
        try:
            self._load_dir(new_dir)
        except Exception as e:  # noqa: BLE001 - e.g. a file that changed since its header was read
            if not self._from_disk:
                self._finish(True, None)     # weights changed in part: cached K/V and folds are stale
                return False, f"Failed to update weights: {e}. The weights are partially updated."
            self._load_dir(self._model_dir)
            self._finish(True, None)         # the checkpoint may differ from what tensor updates had set
            return False, f"Failed to update weights: {e}.\nRolling back to original weights."
        self._model_dir = new_dir
        self._from_disk = True               # a later failed load rolls back to this checkpoint
        self._finish(True, weight_version)
        return _succeeded("Succeeded to update model weights.", weight_version)

    # ---- steps ------------------------------------------------------------------------------------
    def _blocked(self) -> Optional[str]:
        if "weights" in self._memory.released:
            return "Failed to update weights: the weights are released; call " \
                   "resume_memory_occupation(tags=['weights']) first."
        return None

    def _plan(self, entries: Iterable[Entry], direct: bool) -> tuple[list[Optional[Slot]], list[str]]:
        """The slot of each entry (None: not loaded) and every problem found."""
        slots: list[Optional[Slot]] = []
        errors: list[str] = []
        for name, shape, floating in entries:
            slot = None if not direct and self._names.ignored(name) else self._names.resolve(name, direct)
            if slot is None and (direct or not self._names.ignored(name)):
                errors.append(self._names.unknown(name, direct))
            elif slot is not None and not slot.tied:
                if not floating:
                    errors.append(f"{name!r} is not a floating-point tensor")
                elif tuple(shape) != slot.shape:
                    errors.append(f"{name!r} has shape {list(shape)}, the model's is {list(slot.shape)}")
            slots.append(None if slot is None or slot.tied else slot)
        return slots, errors

    def _update(self, named: Sequence[tuple[str, torch.Tensor]], direct: bool, flush_cache: bool,
                weight_version: Optional[str], ok: str) -> tuple[bool, str]:
        if (err := self._blocked()) is not None:
            return False, err
        slots, errors = self._plan([(n, tuple(t.shape), t.dtype.is_floating_point) for n, t in named], direct)
        if errors:
            return False, _failed(errors)
        writer = _Writer(self._names)
        pairs = [(s, t) for s, (_, t) in zip(slots, named) if s is not None]
        try:
            for s, t in sorted(pairs, key=lambda st: not writer.first(st[0])):   # stable: folded norms first
                writer.write(s, t.detach())
        finally:
            writer.close()
        self._finish(flush_cache, weight_version)
        return _succeeded(ok, weight_version)

    def _load_dir(self, model_dir: str) -> None:
        """Stream a checkpoint into the model: folded norms first, then the rest."""
        writer = _Writer(self._names)

        def first(name: str) -> bool:
            s = self._names.resolve(name)
            return s is not None and writer.first(s)
        try:
            for keep in (first, lambda n: not first(n)):
                for name, t in iter_safetensors(model_dir, keep):
                    s = None if self._names.ignored(name) else self._names.resolve(name)
                    if s is not None and not s.tied:
                        writer.write(s, t)
        finally:
            writer.close()

    def _finish(self, flush_cache: bool, weight_version: Optional[str]) -> None:
        if self._lora is not None:
            self._lora.refold()              # folded norms may have changed
        if flush_cache:
            self._scheduler.flush_cache()    # cached prefixes hold the old weights' K/V
        if weight_version is not None:
            self.version = weight_version
