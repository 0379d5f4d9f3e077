"""GenerationInterrupted: a KeyboardInterrupt that says, in one line, what an interrupted call kept.

Raised ``from None`` by calls that catch the Stop button (KeyboardInterrupt) mid-generation, so
``except KeyboardInterrupt`` still catches it. IPython shows an exception's ``_render_traceback_()``
lines instead of its traceback, so a notebook shows the one summary line, not the frames of the
queue and threads the interrupt passed through.
"""
from __future__ import annotations

from typing import Any, Optional


class GenerationInterrupted(KeyboardInterrupt):
    """The caller interrupted a generation; ``str(e)`` is the one-line summary.

    ``done`` of ``total`` items finished before the interrupt; ``checkpoint`` is where they are
    saved (None when nothing was saved); ``partial`` is what the call had made so far where it
    has one (the DataFrame helpers: the output frame, unfinished rows with an ``error``), else None.
    """

    def __init__(self, message: str, done: int = 0, total: int = 0, checkpoint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.done = done
        self.total = total
        self.checkpoint = checkpoint
        self.partial: Any = None

    def __str__(self) -> str:
        return self.message

    def _render_traceback_(self) -> list[str]:
        """IPython's traceback hook: the summary line only."""
        return [self.message]
