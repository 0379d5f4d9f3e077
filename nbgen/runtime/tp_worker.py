"""A tensor-parallel worker process (rank > 0): joins the process group, builds its shard of the
model with the same setup as rank 0 (a ModelRunner), then runs rank 0's steps on it
(``runtime/tp_step.StepReplica``) until told to stop.

Started by ``runtime/tp_group.py`` as a fresh interpreter (``run_from_fd`` via ``python -c``:
spawned, never forked, and without importing the user's main module, so neither a notebook nor a
script needs an ``if __name__ == "__main__"`` guard); its spec arrives over the socket FD. It never
outlives the engine: it exits on the "stop" command, when rank 0's end of the pipe closes (engine or process
gone), and when its parent process disappears (a watcher thread: a killed kernel leaves no
orphans). SIGINT is ignored: a notebook's interrupt goes to the whole process group, and the
engine, not the worker, decides what an interrupt stops.
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from nbgen.core.config import EngineConfig
from nbgen.models import all_reduce
from nbgen.models.parallel_state import tp_scope
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.tp_step import StepReplica

PARENT_POLL_S = 0.5   # how often a worker checks that its parent still lives


@dataclass
class WorkerSpec:
    """Everything a worker needs, pickled to the spawned process."""

    cfg: EngineConfig          # rank 0's resolved config
    rank: int
    world_size: int
    init_method: str           # tcp://127.0.0.1:port of rank 0's store
    backend: str               # "gloo" (CPU) or "nccl" (CUDA)
    device: str                # "cpu" or "cuda:<index>"
    parent_pid: int
    timeout_s: float


def _watch_parent(parent_pid: int) -> None:
    """Exit this process at once when the parent is gone (re-parented: getppid changes)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(PARENT_POLL_S)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The worker's entry point (runs in the spawned process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True, name="nbgen-tp-parent").start()
    device = torch.device(spec.device)
    if device.type == "cpu":   # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    else:
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.rank,
                                world_size=spec.world_size, timeout=datetime.timedelta(seconds=spec.timeout_s))
        all_reduce.setup(device, not spec.cfg.disable_custom_all_reduce)   # as rank 0, right after joining
        with tp_scope(spec.world_size, spec.rank):
            runner = ModelRunner(spec.cfg, device)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it in the Engine's caller
        conn.send(("error", f"tensor-parallel rank {spec.rank}: {type(e).__name__}: {e}"))
        os._exit(1)
    conn.send(("ready", spec.rank))
    replica = StepReplica(runner)
    code = 0
    try:
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):      # rank 0 is gone
                break
            if cmd.kind == "stop":
                break
            replica.run(cmd)
    except Exception:  # noqa: BLE001 - the group cannot go on; rank 0's collective fails with our exit
        traceback.print_exc()
        code = 1
    finally:
        conn.close()
        # no destroy_process_group: a peer that already left would make it wait; the process ends here
        os._exit(code)



def run_from_fd(fd: int) -> None:
    """The spawned interpreter's start: read the spec from socket ``fd`` and serve."""
    conn = Connection(fd)
    worker_main(conn.recv(), conn)
