"""Triton kernel variants: recorded from the launches a dry run makes, looked up in Triton's on-disk cache,
and compiled in another process into that cache.

A variant is what Triton's JIT compiles once per process: one ``@triton.jit`` function at one
specialization (argument types, the integers Triton specialises on, pointer alignment, constexprs) with
one set of options (warps, stages, ...) for one target. Triton's ``jit_cache_hook`` hands it over as
``specialization_data`` (JSON) each time a launch misses the in-memory kernel cache. ``Recorder``
answers that hook on the thread that installed it: the launch is skipped, and a variant that is not in
the on-disk cache either goes to ``on_missing``. ``compile_variant``, in a process without a GPU,
rebuilds the kernel from its module and compiles the variant through ``JITFunction.preload`` — the
deserialisation and ``compile`` call the JIT itself uses — so it writes exactly the cache entry the
engine's launch later reads (the key covers source, specialization, constexprs, options, target and
Triton's own version; any difference is a miss and the launch compiles as it would have anyway).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

try:
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.cache import get_cache_key, get_cache_manager
    from triton.runtime.driver import driver
    from triton._C.libtriton import get_cache_invalidating_env_vars
except ImportError:  # pragma: no cover - CPU installs without triton, or a Triton without these
    knobs = None


@dataclass(frozen=True)
class Variant:
    """One kernel variant, as much as another process needs to compile it."""

    module: str                   # the kernel's module ("nbgen.kernels.small_gemm")
    name: str                     # its qualified name there ("_small_gemm_kernel")
    target: tuple[str, Any, int]  # Triton's GPUTarget: (backend, arch, warp_size)
    data: str                     # Triton's specialization data (JSON)

    def to_json(self) -> dict[str, Any]:
        return {"module": self.module, "name": self.name, "target": list(self.target), "data": self.data}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Variant":
        return cls(d["module"], d["name"], tuple(d["target"]), d["data"])


def available() -> bool:
    """Whether this Triton offers what recording and compiling need."""
    return knobs is not None and hasattr(knobs.runtime, "jit_cache_hook")


def cached(jit_function: Any, device: Any, compile_kwargs: dict[str, Any]) -> bool:
    """Whether the variant a hook call describes is in Triton's on-disk cache: the cache key ``compile``
    computes, from the same inputs (``JITFunction._do_compile`` → ``compile``). An input this code does
    not know (a Triton whose pipeline hook changes the key) counts as cached: the launch compiles it."""
    if getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None:
        return True
    _, _, target, backend, _ = jit_function.device_caches[device]
    data = json.loads(compile_kwargs["specialization_data"])
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    src = jit_function.ASTSource(jit_function, compile_kwargs["signature"], compile_kwargs["constants"],
                                 compile_kwargs["configs"][0])
    options = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(f"{src.name[:150]}.json")
    return bool(group) and f"{src.name[:150]}.json" in group


_HOOK_LOCK = threading.Lock()   # guards installing and removing Triton's process-wide jit_cache_hook


class Recorder:
    """``with Recorder(on_missing):`` — this thread's Triton launches that miss the in-memory cache are
    skipped; the variants among them missing from the on-disk cache go to ``on_missing`` once each.
    Other threads' launches run as usual. ``installed`` is False where another hook was set already
    (then launches run as usual here too)."""

    def __init__(self, on_missing: Callable[[Variant], None]) -> None:
        self.on_missing = on_missing
        self.seen: set[tuple[int, str]] = set()
        self.missing = 0                  # variants handed to on_missing
        self.installed = False
        self._owner = threading.get_ident()

    def _hook(self, *, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        if threading.get_ident() != self._owner:
            return False                  # other threads compile and launch as usual
        jf = fn.jit_function
        k = (id(jf), str(key))
        if k not in self.seen:
            self.seen.add(k)
            try:
                missing = not cached(jf, compile["device"], compile)
            except Exception:             # noqa: BLE001 - a Triton this code does not know: the launch compiles
                missing = False
            if missing:
                target = jf.device_caches[compile["device"]][2]
                self.missing += 1
                self.on_missing(Variant(jf.fn.__module__, jf.fn.__qualname__,
                                        (target.backend, target.arch, target.warp_size),
                                        compile["specialization_data"]))
        return True                       # not compiled here, not launched

    def __enter__(self) -> "Recorder":
        with _HOOK_LOCK:   # engines starting on several threads: one records, the others compile as usual
            if available() and knobs.runtime.jit_cache_hook is None:
                knobs.runtime.jit_cache_hook = self._hook
                self.installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        with _HOOK_LOCK:
            if self.installed:
                knobs.runtime.jit_cache_hook = None
                self.installed = False


class _CompileOnly:
    """The Triton driver of a compile process: a target and a device index, no GPU."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Optional[int] = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


def jit_function(module: str, name: str) -> Any:
    """The ``@triton.jit`` function ``name`` of ``module`` (imported)."""
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def compile_variant(v: Variant) -> str:
    """Compile ``v`` into Triton's on-disk cache (a hit if it is there); its cache hash. For a process
    without a GPU: Triton's driver here only names the target."""
    driver.set_active(_CompileOnly(GPUTarget(*v.target)))
    kernel = jit_function(v.module, v.name).preload(v.data)
    return kernel.hash
