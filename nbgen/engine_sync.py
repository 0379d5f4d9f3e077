"""The blocking half of Engine: submit to the loop thread and wait on a thread-safe queue.

``generate`` / ``generate_iter`` collect finished outputs (with a progress bar for batches), streams
yield chunks as they come; the kernel's stop button (KeyboardInterrupt) aborts what is left and
shows one line (GenerationInterrupted). The loop thread never blocks on the caller.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from nbgen.core.interrupt import GenerationInterrupted
from nbgen.core.multimodal import submit_in_order
from nbgen.core.request import Request
from nbgen.progress import BatchProgress
from nbgen.runtime.stream_buffer import DIRECT, StreamBuffer
from nbgen.runtime.tracker import Update


class SyncBridgeMixin:
    """_run_sync / _stream / _abort_quietly for Engine (uses its _loop and _check_alive)."""

    def _run_sync(self, reqs: list[Request], progress: bool) -> Iterator[tuple[str, dict[str, Any]]]:
        q: queue.Queue = queue.Queue()
        pending = {r.rid for r in reqs}
        # may refuse (duplicate rid): before the bar exists; image requests go as their image ids are ready
        submit_in_order(reqs, lambda rs: self._loop.submit(rs, q.put, stream=False), self._abort_quietly)
        bar = BatchProgress(len(reqs), enabled=progress)
        try:
            while pending:
                try:
                    upd: Update = q.get(timeout=0.1)
                except queue.Empty:
                    self._check_alive()
                    continue
                if upd.finished:
                    pending.discard(upd.rid)
                    bar.update(upd.output)
                    yield upd.rid, upd.output
        except KeyboardInterrupt as e:  # the stop button: one line in a notebook, not the queue's frames
            if isinstance(e, GenerationInterrupted):
                raise
            done = len(reqs) - len(pending)
            raise GenerationInterrupted(f"interrupted: {done}/{len(reqs)} requests had finished; the rest were "
                                        "aborted and the engine is ready", done, len(reqs)) from None
        finally:
            bar.close()
            if pending:  # interrupted (KeyboardInterrupt, generator closed): abort what is left
                self._abort_quietly(list(pending))

    def _stream(self, req: Request) -> Iterator[dict[str, Any]]:
        """Chunks of one request: each holds everything that arrived since the previous one (merged
        while the caller was busy), the text made here from the ids (``StreamBuffer``)."""
        buf = StreamBuffer(req, self.tokenizer, DIRECT, threading.Event())
        self._loop.submit([req], buf, stream=True)
        try:
            while not buf.done:
                if not buf.ready.wait(0.1):
                    self._check_alive()
                    continue
                buf.ready.clear()
                chunk = buf.take()
                if chunk is not None:
                    yield chunk
        finally:
            if not buf.done:
                self._abort_quietly([req.rid])

    def _abort_quietly(self, rids: list[str], wait: bool = True) -> None:
        """Abort an interrupted call's requests; with ``wait``, return once the loop let them go."""
        try:
            self._loop.abort(rids, wait=wait)
        except RuntimeError:
            pass
