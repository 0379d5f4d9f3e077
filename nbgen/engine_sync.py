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
from nbgen.runtime.stream_buffer import DIRECT, StreamBuffer, take_chunks
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

    def _stream(self, reqs: list[Request]) -> Iterator[dict[str, Any]]:
        """Chunks of the call's requests as they come: each holds everything that arrived for its
        request since that request's previous chunk (merged while the caller was busy), the text made
        here from the ids (``StreamBuffer``). With several requests (a list of prompts, or n > 1) each
        chunk carries ``index``: its request's place in the non-streamed output list (SGLang's)."""
        ready = threading.Event()
        bufs = [StreamBuffer(r, self.tokenizer, DIRECT, ready) for r in reqs]
        self._submit_streams(bufs)
        try:
            while not all(b.done for b in bufs):
                if not ready.wait(0.1):
                    self._check_alive()
                    continue
                ready.clear()
                yield from take_chunks(bufs)
        finally:
            left = [b.req.rid for b in bufs if not b.done]
            if left:
                self._abort_quietly(left)

    def _submit_streams(self, bufs: list[StreamBuffer]) -> None:
        """Submit each request with its own buffer; if one is refused, abort those already queued."""
        for k, b in enumerate(bufs):
            try:
                self._loop.submit([b.req], b, stream=True)
            except BaseException:
                if k:
                    self._abort_quietly([x.req.rid for x in bufs[:k]], wait=False)
                raise

    def _abort_quietly(self, rids: list[str], wait: bool = True) -> None:
        """Abort an interrupted call's requests; with ``wait``, return once the loop let them go."""
        try:
            self._loop.abort(rids, wait=wait)
        except RuntimeError:
            pass
