"""flashinfer's JIT modules built on background threads while the engine starts.

On a host whose flashinfer JIT cache is empty, the first call into a flashinfer module compiles it with
nvcc through ninja on the calling thread: the paged prefill kernels for the model's head size and
dtypes took 74 s on an H100 host (sm_90, 16 cores). ``start_prebuild`` names the modules this engine
will call — the same JIT spec flashinfer's own getter makes, with the same arguments as
``FlashInferBackend``'s plans — and builds each on its own thread from the start of the model setup,
so the compile overlaps the weight load and the decode graphs' Triton compiles (ninja runs in a
subprocess; the GIL is free meanwhile). (Norms and SiLU-and-mul run on nbgen's Triton kernels,
``kernels/triton_norm.py``; flashinfer's RoPE serves only head sizes the fused RoPE kernel does not
take and is built when first used.)

The threads never touch CUDA (a decode graph may be capturing on the loop thread): they write the
generated sources and run ninja under flashinfer's per-module file lock. When the engine then calls
the module, flashinfer's own ``build_and_load`` takes that lock (waiting for a build still running),
finds ninja's outputs up to date and loads the library. A build that fails here is only logged: the
engine's own call builds it again and reports the error there. With a warm cache each thread's ninja
finds nothing to do (tens of milliseconds, off the loop thread).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from nbgen.attention import kv_quant
from nbgen.core.config import EngineConfig
from nbgen.models.embedded import default_model_path
from nbgen.models.loader import checkpoint_dir, resolve_dtype
from nbgen.models.model_config import model_dims, read_model_config
from nbgen.models.registry import prepare_config

logger = logging.getLogger("nbgen")

# seconds a readiness check waits for a build thread to learn whether its module is cached (it writes
# the module's generated sources first: well under a second)
CHECK_TIMEOUT_S = 30.0
# the build threads' nice value (their ninja and nvcc processes inherit it)
NICE = 10


@dataclass
class Job:
    """One module's background build (shared by the engines of a process that need the same module)."""

    thread: threading.Thread = field(default_factory=threading.Thread)
    checked: threading.Event = field(default_factory=threading.Event)   # knows whether it was cached
    cold: bool = False             # the module was not compiled yet: this build compiles it
    name: str = ""
    seconds: Optional[float] = None
    error: Optional[str] = None


@dataclass
class Prebuild:
    """The background builds of one engine start."""

    jobs: list[Job] = field(default_factory=list)
    _ready: bool = False

    @property
    def seconds(self) -> dict[str, float]:
        """Finished builds: module name -> seconds."""
        return {j.name: j.seconds for j in self.jobs if j.seconds is not None}

    @property
    def errors(self) -> dict[str, str]:
        return {j.name: j.error for j in self.jobs if j.error is not None}

    @property
    def threads(self) -> list[threading.Thread]:
        return [j.thread for j in self.jobs]

    def wait(self, timeout: Optional[float] = None) -> dict[str, float]:
        """Join the build threads (tests, benchmarks); the finished builds' seconds."""
        for j in self.jobs:
            j.thread.join(timeout)
        return self.seconds

    def ready(self) -> bool:
        """Whether the modules load without compiling now: every build done, or only no-op checks of
        modules already in the cache left (waited for). False while a missing module compiles."""
        if not self._ready:
            for j in self.jobs:
                j.checked.wait(CHECK_TIMEOUT_S)
                if j.cold and j.thread.is_alive():
                    return False
            self.wait()
            self._ready = True
        return True


# builds running in this process, by generator and arguments: a second engine started meanwhile (a
# notebook re-running its cell) waits for the same build instead of queueing a second one on its lock
_RUNNING: dict[tuple[Any, tuple], Job] = {}
_RUNNING_LOCK = threading.Lock()


def flashinfer_specs(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> list[Any]:
    """The JIT specs (generator, arguments) of the flashinfer modules an engine with these shapes calls (empty
    without flashinfer or off CUDA). Runs on the caller's thread: choosing the prefill backend reads
    the device's compute capability."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):   # flashinfer: half precision
        return []
    try:
        import flashinfer.jit as fjit
        from flashinfer.utils import determine_attention_backend
    except ImportError:
        return []
    # BatchPrefillWithPagedKVCacheWrapper(backend="auto").plan(..., causal, no RoPE, no window, no soft cap)
    backend = determine_attention_backend(device, 0, False, False, dtype, kv_dtype,
                                          head_dim_qk=head_dim, head_dim_vo=head_dim)
    specs = []
    if backend in ("fa2", "fa3"):
        specs.append((fjit.gen_batch_prefill_module, (backend, dtype, kv_dtype, dtype, torch.int32, head_dim,
                                                      head_dim, 0, False, False, False)))
    return specs


def _build(gen: Any, args: tuple, job: Job) -> None:
    t0 = time.perf_counter()
    job.name = getattr(gen, "__name__", "module")
    try:
        # below the loop thread's own work (the decode graphs' Triton compiles): ninja and nvcc inherit it
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):   # not Linux: the build runs at the process's priority
        pass
    try:
        spec = gen(*args)
        job.name = spec.name
        job.cold = not spec.is_compiled
        job.checked.set()
        spec.build(need_lock=True)
    except Exception as e:   # the engine's own call builds it again and raises there
        job.error = f"{type(e).__name__}: {e}"
        logger.info("flashinfer prebuild of %s failed (%s); the engine builds it when first used", job.name, e)
        return
    finally:
        job.checked.set()
    job.seconds = round(time.perf_counter() - t0, 2)


def start_for_config(cfg: EngineConfig, device: torch.device) -> Prebuild:
    """``start_prebuild`` for the model ``cfg`` names, from its config.json alone (before the weights
    load); nothing when the config cannot be read here (the loader then reports why)."""
    if device.type != "cuda" or cfg.attention_backend not in (None, "flashinfer"):
        return Prebuild()
    try:
        path = cfg.model_path if cfg.model_path is not None else default_model_path()
        config = prepare_config(read_model_config(checkpoint_dir(path, cfg.load_format),
                                                  trust_remote_code=cfg.trust_remote_code))
        dtype = resolve_dtype(cfg.dtype, device)
        head_dim = model_dims(config)[3]
        kv_dtype = kv_quant.storage_dtype(cfg.kv_cache_dtype, dtype)
    except Exception as e:   # noqa: BLE001 - load_model reads it again and raises there
        logger.debug("flashinfer prebuild skipped (%s)", e)
        return Prebuild()
    return start_prebuild(device, dtype, kv_dtype, head_dim)


def start_prebuild(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> Prebuild:
    """Start one daemon thread per flashinfer module this engine will call (see the module docstring)."""
    out = Prebuild()
    try:
        specs = flashinfer_specs(device, dtype, kv_dtype, head_dim)
    except Exception as e:   # an unknown flashinfer version: the engine builds as it goes
        logger.info("flashinfer prebuild unavailable (%s)", e)
        return out
    with _RUNNING_LOCK:
        for gen, args in specs:
            job = _RUNNING.get((gen, args))
            if job is None or not job.thread.is_alive():
                job = _RUNNING[(gen, args)] = Job()
                job.thread = threading.Thread(target=_build, args=(gen, args, job), name="nbgen-jit-prebuild",
                                              daemon=True)
                job.thread.start()
            out.jobs.append(job)
    return out
