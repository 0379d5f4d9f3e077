"""Engine control calls beside generation (SGLang names): abort, cache flush, profiling and the GC freeze."""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from nbgen.runtime.profiler import ProfileResult, profile_options


@dataclass
class FlushCacheReqOutput:
    """flush_cache()'s answer, SGLang's: ``success`` (False while requests run) and a ``message``;
    in a bool context it is ``success``."""

    success: bool
    message: str = ""

    def __bool__(self) -> bool:
        return self.success


class ControlMixin:
    """abort / flush_cache / start_profile / stop_profile / freeze_gc for Engine (uses its _loop and
    _check_alive)."""

    def abort(self, rid: Any) -> None:
        """Abort one request id (or a list); unknown or finished ids are ignored."""
        rids = [rid] if isinstance(rid, str) else list(rid) if isinstance(rid, (list, tuple)) else None
        if rids is None or not all(isinstance(r, str) for r in rids):
            raise ValueError(f"rid must be a request id (str) or a list of them, got {rid!r:.60}")
        self._check_alive()
        self._loop.abort(rids)

    def flush_cache(self) -> FlushCacheReqOutput:
        """Drop the prefix cache; ``success`` False (nothing flushed) while requests are running, as SGLang."""
        self._check_alive()
        if self._loop.flush_cache():
            return FlushCacheReqOutput(True)
        return FlushCacheReqOutput(False, "the cache was not flushed: requests are running")

    def start_profile(self, output_dir: Optional[str] = None, num_steps: Optional[int] = None,
                      activities: Optional[Sequence[str]] = None, with_stack: Optional[bool] = None,
                      record_shapes: Optional[bool] = None, **unsupported: Any) -> None:
        """Record a torch.profiler trace of the engine's steps (activities: "CPU", "GPU", "MEM").

        It stops at ``stop_profile()`` or by itself after ``num_steps`` engine steps, and writes
        ``<output_dir>/<id>-TP-0.trace.json.gz`` (Chrome / Perfetto); output_dir defaults to the
        temp dir.
        """
        if unsupported:
            raise ValueError(f"start_profile arguments {sorted(unsupported)} are not supported "
                             "(supported: output_dir, num_steps, activities, with_stack, record_shapes)")
        self._check_alive()
        self._loop.start_profile(profile_options(output_dir, num_steps, activities, with_stack, record_shapes))

    def stop_profile(self) -> ProfileResult:
        """Stop the running profile (or collect one that stopped after num_steps) and write its trace;
        returns the trace path, the step count and the top ops."""
        self._check_alive()
        return self._loop.stop_profile()

    def freeze_gc(self) -> None:
        """Move every object alive now out of the cyclic GC's reach (after a warm-up, as SGLang):
        later full collections skip them, so they cannot stall a step."""
        self._check_alive()
        self._loop.call(gc.freeze)
