"""Worker processes that compile Triton variants into the on-disk cache (``triton_variants.compile_variant``).

A Triton compile holds the GIL for much of its time, so compile threads in the engine's process barely
overlap; processes do. ``CompilePool`` starts one helper process with a fresh interpreter (the engine's
process has CUDA initialised and must not fork). It imports torch, Triton and nbgen's ``kernels``
package only — under a stand-in ``nbgen`` package, so ``nbgen/__init__`` and the layers above do not
load; kernels import no other nbgen package — then forks its compile workers, which share those imports
(each importing torch itself would cost every worker seconds of CPU at once).
Jobs go to it as JSON lines on its stdin and come back, one line each, on its stdout.

No process outlives the pool: ``close`` ends the helper (closing its stdin ends it; a kill after
``CLOSE_S``), the helper dies with the thread that started it (``PR_SET_PDEATHSIG``; also with the
engine's process), and each worker with the helper. A worker that dies fails the jobs it had (the
executor reports its pool broken); ``wait`` returns once its jobs are answered, the helper is gone, or
nothing came back for ``idle_s``. A job that fails only means the engine's launch compiles it itself.
"""
from __future__ import annotations

import concurrent.futures as cf
import ctypes
import importlib
import json
import logging
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from nbgen.kernels.triton_variants import Variant, compile_variant

logger = logging.getLogger("nbgen")

MAX_WORKERS = 12     # compile workers at most (the GPU hosts have 16 cores)
CLOSE_S = 2.0        # how long close() waits for the helper to exit before killing it
PR_SET_PDEATHSIG = 1

# the helper's entry point: sys.argv = ["-c", nbgen's package dir, workers]; cwd off sys.path
_BOOT = """import sys, types
del sys.path[0]
pkg = types.ModuleType("nbgen"); pkg.__path__ = [sys.argv[1]]; sys.modules["nbgen"] = pkg
from nbgen.kernels import triton_pool
triton_pool.serve(int(sys.argv[2]))
"""


def workers() -> int:
    """Compile workers for this host: one core left to the engine's thread."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 2
    return max(1, min(MAX_WORKERS, cores - 1))


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when the thread that started it ends (Linux); exit at once if
    the parent is gone already."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):   # not Linux: stdin's end still ends the helper
        pass
    if os.getppid() != parent:
        os._exit(0)


def _worker_init(parent: int) -> None:
    die_with_parent(parent)
    fd = os.open(os.devnull, os.O_WRONLY)   # stdout is the helper's answer channel
    os.dup2(fd, 1)


def _compile(job: dict[str, Any]) -> Optional[str]:
    try:
        compile_variant(Variant.from_json(job))
    except Exception as e:   # noqa: BLE001 - reported to the engine, which compiles it itself
        return f"{type(e).__name__}: {e}"
    return None


def serve(n_workers: int) -> None:
    """The helper process: compile each job line of stdin on a fork pool, answer each on stdout; exit at
    the end of stdin (the workers die with it)."""
    die_with_parent(os.getppid())
    # every kernel module imports torch (seconds): once here, before the workers fork and share it
    importlib.import_module("torch")
    out = sys.stdout
    lock = threading.Lock()
    pool = cf.ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("fork"),
                                  initializer=_worker_init, initargs=(os.getpid(),))

    def answer(i: int, t0: float, fut: cf.Future) -> None:
        try:
            err = fut.result()
        except Exception as e:   # noqa: BLE001 - a worker died (the pool is broken): this job failed
            err = f"{type(e).__name__}: {e}"
        with lock:
            out.write(json.dumps({"id": i, "error": err, "s": round(time.perf_counter() - t0, 3)}) + "\n")
            out.flush()

    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        try:
            fut = pool.submit(_compile, job["variant"])
        except Exception as e:   # noqa: BLE001 - a broken pool refuses new work
            fut = cf.Future()
            fut.set_exception(e)
        fut.add_done_callback(lambda f, i=job["id"], t0=t0: answer(i, t0, f))
    os._exit(0)


class CompilePool:
    """The engine's side: ``submit`` variants, ``wait`` for the first n answers, ``close``."""

    def __init__(self, n_workers: int) -> None:
        nbgen_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, nbgen_dir, str(n_workers)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.submitted = 0
        self.errors: dict[int, str] = {}    # job id -> why it failed
        self.answered: set[int] = set()
        self.seconds: list[float] = []      # each compiled job's seconds from submit to answer
        self.gone = False                   # the helper exited, stopped answering, or was closed
        self._buf = b""

    def submit(self, v: Variant) -> int:
        """Queue ``v``; its job id (jobs run in submit order)."""
        i = self.submitted
        self.submitted += 1
        if not self.gone:
            try:
                self.proc.stdin.write((json.dumps({"id": i, "variant": v.to_json()}) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self.gone = True
        return i

    def wait(self, n: int, idle_s: float) -> bool:
        """Wait until jobs 0..n-1 are answered; False when the helper went away first or nothing came back
        for ``idle_s`` seconds (the pool is then closed)."""
        while not self.gone and any(i not in self.answered for i in range(n)):
            fd = self.proc.stdout.fileno()
            ready, _, _ = select.select([fd], [], [], idle_s)
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:            # end of file: the helper died; or silence for idle_s
                logger.info("Triton compile processes %s; the engine compiles the rest itself",
                            "stopped answering" if not ready else "exited")
                self.close()
                break
            self._buf += chunk
            *lines, self._buf = self._buf.split(b"\n")
            for line in lines:
                self._answer(line)
        return all(i in self.answered for i in range(n))

    def _answer(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
            i = int(msg["id"])
        except (ValueError, KeyError, TypeError):
            return
        self.answered.add(i)
        if msg.get("error"):
            self.errors[i] = str(msg["error"])
        else:
            self.seconds.append(float(msg.get("s", 0.0)))

    def close(self) -> None:
        """End the helper and its workers (idempotent)."""
        self.gone = True
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(CLOSE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:   # workers still running (a kill, no PR_SET_PDEATHSIG): the helper's process group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
