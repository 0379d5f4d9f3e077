"""``asyncio.run(...)`` inside a Jupyter cell, safe under JupyterLab's "Run All".

A kernel cell runs while the kernel's own event loop is running, so the stock ``asyncio.run``
refuses ("cannot be called from a running event loop"). Re-entering the kernel's loop instead (what
nest_asyncio does) lets that loop serve the kernel's *next* queued cell from inside this one; under
Run All with ipykernel 7 that re-entry breaks its context handling and hangs the kernel.

nbgen therefore leaves the kernel's loop alone: when ``asyncio.run`` is called from a thread whose
loop is already running, the coroutine runs to completion on a fresh event loop in a helper thread
while the cell blocks, as a synchronous call would. The cell keeps its output (the helper runs in a
copy of the cell's context), exceptions surface with their own type, and the kernel's Interrupt
button cancels the coroutine (its ``finally`` blocks run, nbgen aborts its requests) and raises
``KeyboardInterrupt`` (shown as one line) in the cell. Where no loop runs, ``asyncio.run`` is the
stock one.
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, Coroutine, Optional

from nbgen.core.interrupt import GenerationInterrupted

_stock_run = asyncio.run
_installed = False


class _CellRun:
    """One coroutine on its own loop in a helper thread; the calling thread waits for it."""

    def __init__(self, main: Coroutine[Any, Any, Any], debug: Optional[bool]) -> None:
        self.main, self.debug = main, debug
        self.done = threading.Event()
        self.started = threading.Event()
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.task: Optional[asyncio.Task] = None
        self.result: Any = None
        self.error: Optional[BaseException] = None

    async def _wrapped(self) -> Any:
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        self.started.set()
        return await self.main

    def _thread(self) -> None:
        try:
            with asyncio.Runner(debug=self.debug) as runner:
                self.result = runner.run(self._wrapped())
        except BaseException as e:  # handed to the waiting cell, re-raised there
            self.error = e
        finally:
            self.started.set()
            self.done.set()

    def cancel(self) -> None:
        """Cancel the coroutine from the waiting thread (Interrupt button)."""
        self.started.wait()
        loop, task = self.loop, self.task
        if loop is not None and task is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed in between: nothing left to cancel
                pass

    def run(self) -> Any:
        ctx = contextvars.copy_context()  # the cell's context: output lands in this cell
        threading.Thread(target=ctx.run, args=(self._thread,), name="nbgen-cell-asyncio", daemon=True).start()
        try:
            while not self.done.wait(0.1):
                pass
        except KeyboardInterrupt:
            self.cancel()
            self.done.wait(10.0)  # let the coroutine's cleanup run (abort requests, close files)
            raise GenerationInterrupted("interrupted: asyncio.run(...) cancelled its coroutine; "
                                        "the engine is ready") from None
        if self.error is not None:
            raise self.error
        return self.result


def run(main: Coroutine[Any, Any, Any], *, debug: Optional[bool] = None, **kwargs: Any) -> Any:
    """``asyncio.run`` that also works where an event loop already runs (a notebook cell)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _stock_run(main, debug=debug, **kwargs)
    if not asyncio.iscoroutine(main):
        raise ValueError(f"a coroutine was expected, got {main!r}")
    return _CellRun(main, debug).run()


def install_cell_asyncio_run() -> None:
    """Route ``asyncio.run`` through :func:`run` in an IPython kernel (no-op elsewhere, idempotent)."""
    global _installed
    if _installed:
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if get_ipython() is None:
        return
    asyncio.run = run
    _installed = True
