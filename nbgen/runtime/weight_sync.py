"""Weight-update process groups (SGLang's ``init_weights_update_group``): a trainer at rank 0 of a
torch.distributed group of its own broadcasts each tensor; the engine joins at ``rank_offset`` and
receives them (``update_weights_from_distributed``).

Both sides must build the group the same way: ``init_custom_process_group`` below is the recipe
SGLang, vLLM and the RL frameworks share (a TCP rendezvous at the trainer, the store prefixed with the
group name, a group outside the default one, so neither side's own torch.distributed setup is touched).
"""
from __future__ import annotations

import datetime
import logging
import threading
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                rendezvous)

logger = logging.getLogger("nbgen")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: Optional[datetime.timedelta] = None) -> Any:
    """A process group of ``world_size`` ranks met at ``init_method`` (``tcp://host:port``; rank 0 hosts
    the store), separate from the default group. The trainer calls it with rank 0, the engine with its
    rank; ``dist.broadcast(t, src=0, group=pg)`` then moves tensors."""
    timeout = timeout or DEFAULT_TIMEOUT
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)     # several groups (and other users) may share the port's store
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}   # group ranks are the global ranks
    return pg


def parse_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    """A torch dtype from a dtype or its name ("bfloat16", "torch.bfloat16"); ValueError otherwise."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dt = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dt, torch.dtype):
            return dt
    raise ValueError(f"dtypes: {value!r} is not a torch dtype or its name (e.g. 'bfloat16')")


class UpdateGroups:
    """The engine's weight-update groups by name (any thread: init / destroy on the caller's,
    receive on the loop thread)."""

    def __init__(self) -> None:
        self._groups: dict[str, tuple[Any, str]] = {}   # name -> (process group, backend)
        self._lock = threading.Lock()

    def init(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str) -> tuple[bool, str]:
        """Join the trainer's group (blocks until every rank joined) -> (success, message)."""
        with self._lock:
            if group_name in self._groups:
                return False, f"Failed to initialize custom process group: group {group_name!r} already exists."
        logger.info("joining weight-update group %r at %s:%s as rank %d of %d (%s)", group_name,
                    master_address, master_port, rank, world_size, backend)
        try:
            pg = init_custom_process_group(backend, f"tcp://{master_address}:{master_port}", world_size, rank,
                                           group_name)
        except Exception as e:  # noqa: BLE001 - reported as SGLang does
            return False, f"Failed to initialize custom process group: {e}."
        with self._lock:
            self._groups[group_name] = (pg, backend)
        return True, "Succeeded to initialize custom process group."

    def destroy(self, group_name: str) -> tuple[bool, str]:
        """Leave and destroy a group -> (success, message)."""
        with self._lock:
            entry = self._groups.pop(group_name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        try:
            dist.destroy_process_group(entry[0])
        except Exception as e:  # noqa: BLE001
            return False, f"Failed to destroy custom process group: {e}."
        return True, "Succeeded to destroy custom process group."

    def receive(self, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
                group_name: str, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """Receive one broadcast from rank 0 per name, in order (NCCL into ``device``, gloo on the CPU).
        KeyError when the group does not exist."""
        with self._lock:
            entry = self._groups.get(group_name)
        if entry is None:
            raise KeyError(f"Group {group_name} not in {sorted(self._groups)}. "
                           "Please call `init_weights_update_group` first.")
        pg, backend = entry
        where = device if backend == "nccl" else torch.device("cpu")
        out = []
        works = []
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty(tuple(shape), dtype=dt, device=where)
            works.append(dist.broadcast(t, src=0, group=pg, async_op=True))
            out.append((name, t))
        for w in works:
            w.wait()
        return out
