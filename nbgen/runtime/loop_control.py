"""LoopControl: the LoopThread's caller-side control calls (sessions, profiling, cache flush, server info).

Each runs on the loop thread between steps through ``call`` (blocking, any caller thread); LoopThread
(runtime/loop.py) inherits them and provides ``call``, ``sessions``, ``profiler``, ``runner`` and
``scheduler``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from nbgen.runtime.engine_parts import runner_info
from nbgen.runtime.profiler import ProfileOptions, ProfileResult, StepProfiler
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.sessions import SessionTable


class LoopControl:
    """Sessions, profiling, cache flush and server info on the loop thread (mixed into LoopThread)."""

    runner: Optional[ModelRunner]
    scheduler: Optional[Scheduler]
    profiler: StepProfiler
    sessions: Optional[SessionTable]

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result (LoopThread's)."""
        raise NotImplementedError

    def open_session(self, capacity: int, session_id: str, streaming: bool,
                     timeout: Optional[float]) -> Optional[str]:
        """Open a session (None when that id is open already)."""
        return self.call(lambda: self.sessions.open(capacity, session_id, streaming, timeout))

    def close_session(self, session_id: str) -> None:
        """Close a session and drop its KV pin (an unknown id is ignored with a warning)."""
        self.call(lambda: self.sessions.close(session_id))

    def start_profile(self, opts: ProfileOptions) -> None:
        """Start torch.profiler on the loop thread (RuntimeError if one runs)."""
        cuda = self.runner is not None and self.runner.on_gpu
        self.call(lambda: self.profiler.start(opts, cuda))

    def stop_profile(self) -> ProfileResult:
        """Stop the profile and write its trace (or hand over one that stopped after num_steps)."""
        return self.call(self.profiler.stop)

    def flush_cache(self) -> bool:
        """Drop the prefix cache between steps; False while requests are running (as SGLang)."""
        return self.call(self.scheduler.flush_cache)

    def server_info(self) -> dict[str, Any]:
        """The runner's facts for ``get_server_info()``: attention backend, graph sizes, start-up
        phases, folded norms (empty values once the engine is shut down)."""
        return runner_info(self.runner)
