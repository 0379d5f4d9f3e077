"""Tensor parallelism on rank 0: start one worker process per extra rank (a fresh interpreter), join the
torch.distributed group (gloo on CPU, NCCL on CUDA; small all-reduces peer-to-peer where the GPUs map each
other's memory, ``models/all_reduce.py``), tell the workers each step of the runner (``runtime/tp_step.py``),
and stop every worker on shutdown, at interpreter exit, or when a worker dies.

Shutdown order: rank 0's CUDA graphs are freed first (they hold captured NCCL launches; a process group
destroyed under live ones can hang in NCCL's finalize, and a caller may still hold the runner), then
the workers stop, then the peer buffers and the process group go.

One tensor-parallel engine per process at a time: it uses torch.distributed's default group.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch
import torch.distributed as dist

from nbgen.core.config import EngineConfig
from nbgen.runtime.tp_step import StepSender, TPStep
from nbgen.models import all_reduce
from nbgen.models.embedded import default_model_path
from nbgen.models.loader import checkpoint_dir
from nbgen.models.model_config import read_model_config
from nbgen.models.parallel_state import check_tp_shapes
from nbgen.runtime import tp_worker
from nbgen.runtime.tp_worker import WorkerSpec

logger = logging.getLogger("nbgen")

TIMEOUT_S = 1800.0      # a collective waiting longer than this fails (a rank died mid-step)
STARTUP_POLL_S = 0.2    # how often start-up checks that the workers still live
JOIN_S = 10.0           # how long shutdown waits for a worker before killing it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> str:
    """Rank ``rank``'s device: the CPU, or the GPU ``rank`` places after rank 0's."""
    if device.type != "cuda":
        return "cpu"
    first = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{first + rank}"


class TPGroup:
    """Rank 0's end of a tensor-parallel group: the workers, their pipes, the process group."""

    def __init__(self, cfg: EngineConfig, device: torch.device) -> None:
        """Start the workers and join the group (rank 0 builds its own shard afterwards, inside
        ``tp_scope(size, 0)``, while the workers build theirs)."""
        if dist.is_initialized():
            raise RuntimeError("tp_size > 1 needs torch.distributed's default group, which this process "
                               "already uses (one tensor-parallel engine per process)")
        self.size = cfg.tp_size
        if device.type == "cuda" and int(rank_device(device, self.size - 1).split(":")[1]) >= torch.cuda.device_count():
            raise ValueError(f"tp_size={self.size} needs {self.size} GPUs from {device}, "
                             f"found {torch.cuda.device_count()}")
        backend = "nccl" if device.type == "cuda" else "gloo"
        init = f"tcp://127.0.0.1:{_free_port()}"
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._closed = False
        self.broken = False          # abandon() ran: no more steps
        self._runner: Optional[weakref.ref] = None   # rank 0's runner, once attached (its graphs go first)
        atexit.register(self.shutdown)
        for rank in range(1, self.size):
            spec = WorkerSpec(cfg, rank, self.size, init, backend, rank_device(device, rank), os.getpid(), TIMEOUT_S)
            self._spawn(spec)
        try:
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)
            dist.init_process_group(backend, init_method=init, rank=0, world_size=self.size,
                                    timeout=datetime.timedelta(seconds=TIMEOUT_S))
            all_reduce.setup(device, not cfg.disable_custom_all_reduce)   # every rank, right after joining
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, spec: WorkerSpec) -> None:
        """Start one worker: a fresh interpreter running ``tp_worker.run_from_fd`` with this nbgen first on its path,
        in a session of its own (a notebook's interrupt to the kernel's process group passes it by),
        the spec sent over a socket pair."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # .../nbgen/runtime/tp_worker.py -> the directory holding nbgen/ (this copy of nbgen runs there)
        root = os.path.abspath(os.path.join(os.path.dirname(tp_worker.__file__), "..", ".."))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        code = f"from nbgen.runtime.tp_worker import run_from_fd; run_from_fd({theirs.fileno()})"
        proc = subprocess.Popen([sys.executable, "-c", code],
                                pass_fds=[theirs.fileno()], env=env, start_new_session=True)
        theirs.close()
        conn = Connection(ours.detach())
        self.procs.append(proc)
        self.conns.append(conn)
        conn.send(spec)

    def wait_ready(self) -> None:
        """After rank 0's setup: every worker has built its shard (raises a worker's error)."""
        for p, conn in zip(self.procs, self.conns):
            while not conn.poll(STARTUP_POLL_S):
                if p.poll() is not None:
                    raise RuntimeError(f"tensor-parallel worker {p.pid} exited during start-up "
                                       f"(exit code {p.returncode})")
            kind, detail = conn.recv()
            if kind != "ready":
                raise RuntimeError(detail)

    def attach(self, runner: Any) -> None:
        """Run the runner's steps on the workers too from now on (``runner.peers``)."""
        if runner.vision is not None:
            raise ValueError("tp_size > 1 runs text models only: the vision tower of "
                             f"{type(runner.model).__name__} is not split over ranks")
        runner.peers = StepSender(self.send, self.abandon)
        self._runner = weakref.ref(runner)

    def abandon(self) -> None:
        """Give the group up after a failed step: the workers are killed at once (they may wait in a
        collective forever) and every later step fails with a message to restart the engine."""
        if not self._closed:
            self.broken = True
            for p in self.procs:
                p.kill()
            self.shutdown()

    def send(self, cmd: TPStep) -> None:
        """One message to every worker (before rank 0 runs the same call)."""
        if self.broken:
            raise RuntimeError("the tensor-parallel workers stopped after a failed step; shut this engine "
                               "down and start a new one")
        try:
            for conn in self.conns:
                conn.send(cmd)
        except (OSError, ValueError) as e:
            dead = [p.pid for p in self.procs if p.poll() is not None]
            raise RuntimeError(f"tensor-parallel worker(s) {dead or '?'} are gone ({e})") from None

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [p.pid for p in self.procs]

    def shutdown(self) -> None:
        """Stop every worker (a command, then terminate, then kill) and leave the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        runner = self._runner() if self._runner is not None else None
        if runner is not None and not self.broken:
            free_graphs(runner)
        for conn in self.conns:
            try:
                conn.send(TPStep("stop"))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            for stop in (None, p.terminate, p.kill):
                if stop is not None:
                    stop()
                try:
                    p.wait(JOIN_S)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for conn in self.conns:
            conn.close()
        all_reduce.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def free_graphs(runner: Any) -> None:
    """Free a runner's CUDA graphs now (``CUDAGraph.reset``), whoever still holds the runner or its graph
    runners; steps would run eagerly afterwards."""
    if runner.device.type != "cuda":
        return
    torch.cuda.synchronize(runner.device)
    for holder in (runner.graphs, runner.prefill_graphs):
        if holder is not None:
            holder.reset()
    runner.drop_graphs()


def start_tp(cfg: EngineConfig, device: torch.device) -> Optional[TPGroup]:
    """A TPGroup when ``cfg.tp_size > 1`` (after checking that the model splits), else None."""
    if cfg.tp_size == 1:
        return None
    path = cfg.model_path if cfg.model_path is not None else default_model_path()
    check_tp_shapes(read_model_config(checkpoint_dir(path, cfg.load_format), cfg.trust_remote_code), cfg.tp_size)
    return TPGroup(cfg, device)
