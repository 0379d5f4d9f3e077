"""RowProgress: a bar over rows that settle one by one (a result or an error), for notebook helpers.

Every settled row advances the bar, errors included, so a call that returns normally ends with a
full (green) bar; the postfix counts errors and output tok/s. Rows settled before the work starts
(restored from a checkpoint, rejected up front) are the bar's ``initial``: rate and ETA count only
the rows that run. The live view, the static HTML finish and the refresh ticker are
``nbgen.progress.ProgressBar``'s.
"""
from __future__ import annotations

from typing import Any, Optional

from nbgen.progress import DONE, FAILED, STOPPED, BarState, ProgressBar

__all__ = ["RowProgress", "BarState", "ProgressBar", "DONE", "STOPPED", "FAILED"]


class RowProgress:
    """Rows settling: ``settle(error=..., out_tokens=...)`` per row after ``start()``.

    ``presettled`` rows (``restored`` of them from a checkpoint, the rest failed before running)
    count as done from the start; ``errors`` of them failed.
    """

    def __init__(self, total: int, desc: str, presettled: int = 0, errors: int = 0, restored: int = 0,
                 enabled: bool = True) -> None:
        self.total = total
        self.settled = presettled
        self.errors = errors
        self.restored = restored
        self.out_tokens = 0
        self.in_tokens = 0
        self.bar = ProgressBar(total, desc, unit="row", initial=presettled, enabled=enabled and total > 0)
        self._show_postfix()

    def start(self) -> None:
        """The rows still to run start now (the rate clock)."""
        self.bar.start_clock()

    def settle(self, error: bool = False, out_tokens: int = 0, in_tokens: int = 0) -> None:
        """One more row finished (``error``: without a result); ``in_tokens`` count for helpers
        whose rows only read their prompts (embed_df)."""
        self.settled += 1
        self.errors += int(error)
        self.out_tokens += out_tokens
        self.in_tokens += in_tokens
        self._show_postfix()
        self.bar.update(1)

    def postfix(self) -> str:
        """``3 from checkpoint · 2 errors · 41 out tok/s`` (parts that are zero are left out)."""
        parts = []
        if self.restored:
            parts.append(f"{self.restored} from checkpoint")
        if self.errors:
            parts.append(f"{self.errors} error" + ("s" if self.errors != 1 else ""))
        elapsed = self.bar.state().elapsed if self.bar.enabled else 0.0
        if self.out_tokens and elapsed > 0:
            parts.append(f"{self.out_tokens / elapsed:,.0f} out tok/s")
        elif self.in_tokens and elapsed > 0:
            parts.append(f"{self.in_tokens / elapsed:,.0f} in tok/s")
        return " · ".join(parts)

    def _show_postfix(self) -> None:
        if self.bar.enabled:
            self.bar.set_postfix(self.postfix())

    def close(self, outcome: Optional[str] = None) -> None:
        """End the bar: "done" (default when every row settled), "stopped" or "failed"."""
        self._show_postfix()
        self.bar.close(outcome)

    def __enter__(self) -> "RowProgress":
        return self

    def __exit__(self, etype: Any, exc: Any, tb: Any) -> None:
        self._show_postfix()
        self.bar.__exit__(etype, exc, tb)
