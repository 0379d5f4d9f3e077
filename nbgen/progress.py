"""Progress bars for batch calls: live while work runs, a static HTML line once it ends.

In a Jupyter kernel the live bar is tqdm's widget, displayed under a display id; when the call
ends (normally, by an error or by an interrupt) that output is replaced by a small HTML bar with
the final numbers, so a saved or reopened notebook shows the result rather than a reference to a
widget model that no longer exists. Without ipywidgets the live view is that HTML bar, updated in
place. Outside a kernel it is tqdm's text bar. A ticker thread redraws the live view within a
quarter second of a change (and the clock once a second), so the numbers follow completions even
when they arrive in bursts.
"""
from __future__ import annotations

import html
import io
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

DONE, STOPPED, FAILED = "done", "stopped", "failed"
_COLOURS = {DONE: "#4caf50", STOPPED: "#f0ad4e", FAILED: "#d9534f"}


def notebook_display() -> Optional[Callable[..., Any]]:
    """IPython's ``display`` inside a Jupyter kernel; None elsewhere (terminal IPython, scripts)."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return None
    ip = get_ipython()
    return display if ip is not None and getattr(ip, "kernel", None) is not None else None


@dataclass(frozen=True)
class BarState:
    """What a finished (or running) bar shows."""

    desc: str
    n: int
    total: int
    unit: str
    elapsed: float
    postfix: str
    outcome: str  # "done" | "stopped" | "failed" ("done" also while running)

    def text(self) -> str:
        """One line: ``desc: 5/5 rows · 2 errors · 41 out tok/s · 3.1 s``."""
        parts = [f"{self.n}/{self.total} {self.unit}s"] + ([self.postfix] if self.postfix else [])
        parts.append(f"{self.elapsed:.1f} s")
        if self.outcome != DONE:
            parts.append("interrupted" if self.outcome == STOPPED else "failed")
        return f"{self.desc}: " + " · ".join(parts)

    def html(self) -> str:
        """The line as a small styled bar (inline styles only: it survives nbconvert and reloads)."""
        frac = min(1.0, self.n / self.total) if self.total else 1.0
        colour = _COLOURS.get(self.outcome, _COLOURS[DONE])
        return (f'<div class="nbgen-progress" data-outcome="{self.outcome}" data-n="{self.n}" '
                f'data-total="{self.total}" style="display:flex;align-items:center;gap:8px;'
                f'font:12px/1.6 var(--jp-code-font-family,monospace)">'
                f'<div style="flex:0 0 160px;height:8px;background:#e0e0e0;border-radius:4px;overflow:hidden">'
                f'<div style="width:{frac * 100:.1f}%;height:100%;background:{colour}"></div></div>'
                f'<span>{html.escape(self.text())}</span></div>')

    def bundle(self) -> dict[str, str]:
        """The mime bundle a notebook output keeps: HTML plus the plain-text line."""
        return {"text/html": self.html(), "text/plain": self.text()}


class ProgressBar:
    """A tqdm bar that ends as static HTML in notebooks (a no-op when disabled).

    ``initial`` items count as done before the clock starts; rate and ETA cover the items after
    ``start_clock()`` only. ``close(outcome)`` is idempotent; ``with`` closes it, as "stopped" on
    KeyboardInterrupt and "failed" on other exceptions.
    """

    def __init__(self, total: int, desc: str, unit: str = "it", initial: int = 0, enabled: bool = True,
                 refresh_s: float = 0.25) -> None:
        self.desc, self.unit, self.refresh_s = desc, unit, refresh_s
        self.bar: Any = None
        self._handle: Any = None
        self._widget = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: Optional[threading.Thread] = None
        if not enabled:
            return
        kw = dict(total=total, initial=initial, desc=desc, unit=unit, miniters=1, mininterval=refresh_s,
                  smoothing=0)  # smoothing=0: rate = items since start_clock() / time since then
        show = notebook_display()
        if show is None:
            from tqdm.std import tqdm

            self.bar = tqdm(dynamic_ncols=True, **kw)
            return
        try:
            from tqdm.notebook import tqdm as tqdm_notebook

            self.bar = tqdm_notebook(display=False, leave=False, **kw)
            self._handle = show(self.bar.container, display_id=True)
            self._widget = True
        except ImportError:  # no ipywidgets: the HTML line, updated in place
            from tqdm.std import tqdm

            self.bar = tqdm(file=io.StringIO(), **kw)
            self._handle = show(self.state().bundle(), raw=True, display_id=True)

    @property
    def enabled(self) -> bool:
        """False when disabled or closed."""
        return self.bar is not None

    @property
    def n(self) -> int:
        return int(self.bar.n) if self.bar is not None else 0

    def state(self, outcome: str = DONE) -> BarState:
        """The bar's numbers now."""
        if self.bar is None:
            return BarState(self.desc, 0, 0, self.unit, 0.0, "", outcome)
        d = self.bar.format_dict
        return BarState(self.desc, int(d["n"]), int(d["total"] or 0), self.unit, float(d["elapsed"]),
                        str(self.bar.postfix or ""), outcome)

    def start_clock(self) -> None:
        """Rate, ETA and elapsed time count from now (items so far are not timed)."""
        if self.bar is None or self._ticker is not None:
            return
        self.bar.unpause()
        self._ticker = threading.Thread(target=self._tick, name="nbgen-progress", daemon=True)
        self._ticker.start()

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def set_description(self, desc: str) -> None:
        self.desc = desc
        if self.bar is not None:
            self.bar.set_description_str(desc, refresh=False)

    def set_postfix(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)

    def _tick(self) -> None:
        """Redraw when the count moved since the last tick, and once a second for the clock."""
        shown, ticks = -1, 0
        while not self._stop.wait(self.refresh_s):
            ticks += 1
            n = self.n
            if n != shown or ticks * self.refresh_s >= 1.0:
                shown, ticks = n, 0
                self._refresh()

    def _refresh(self) -> None:
        with self._lock:
            if self.bar is None:
                return
            if self._handle is not None and not self._widget:
                self._handle.update(self.state().bundle(), raw=True)
            else:
                self.bar.refresh()

    def close(self, outcome: Optional[str] = None) -> None:
        """End the bar; in a notebook its output becomes the static HTML line.

        ``outcome`` defaults to "done" when every item settled and "stopped" otherwise.
        """
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        with self._lock:
            bar, self.bar = self.bar, None
        if bar is None:
            return
        d = bar.format_dict
        n, total = int(d["n"]), int(d["total"] or 0)
        final = BarState(self.desc, n, total, self.unit, float(d["elapsed"]), str(bar.postfix or ""),
                         outcome or (DONE if n >= total else STOPPED))
        if self._handle is not None:
            self._handle.update(final.bundle(), raw=True)
        bar.close()
        if self._widget:
            bar.container.close()  # the output no longer shows it: free the widget model

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, etype: Any, exc: Any, tb: Any) -> None:
        if etype is None:
            self.close()
        else:
            self.close(STOPPED if issubclass(etype, KeyboardInterrupt) else FAILED)


class BatchProgress:
    """A progress bar over a batch's requests with input/output tok/s (a no-op when disabled)."""

    def __init__(self, total: int, enabled: bool, desc: str = "generate") -> None:
        self.bar = ProgressBar(total, desc, unit="req", enabled=enabled)
        self.n_in = self.n_out = 0
        self.t0 = time.perf_counter()
        self.bar.start_clock()

    def update(self, output: dict[str, Any]) -> None:
        if not self.bar.enabled:
            return
        meta = output["meta_info"]
        self.n_in += meta["prompt_tokens"]
        self.n_out += meta["completion_tokens"]
        dt = max(time.perf_counter() - self.t0, 1e-6)
        self.bar.set_postfix(f"in {self.n_in / dt:,.0f} tok/s, out {self.n_out / dt:,.0f} tok/s")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
