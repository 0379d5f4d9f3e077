"""nbgen.dashboard(engine): live throughput / KV-cache / request counts, refreshed from a thread.

The refresh thread only calls ``engine.stats()`` (cheap, thread-safe) and sets one HTML value,
so it never blocks the kernel and keeps updating while another cell runs a blocking generate().
It stops by itself when the engine shuts down or is garbage-collected; then (and on ``stop()``)
the output becomes a static HTML snapshot of the final numbers, which a saved notebook keeps.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

from nbgen.engine import default_engine
from nbgen.notebook._compat import Shown, widgets_or_none
from nbgen.notebook.state import StatsHistory, dashboard_html, dashboard_text


class Dashboard(Shown):
    """A live view of one Engine. Display it (it is the cell's result) or call ``.show()``."""

    def __init__(self, engine: Any, interval: float = 0.33, history: int = 240,
                 title: Optional[str] = None, widget: Optional[bool] = None) -> None:
        if not 0.05 <= float(interval) <= 60:
            raise ValueError(f"interval must be in [0.05, 60] seconds, got {interval!r}")
        self.interval = float(interval)
        self.history = StatsHistory(history)
        self.title = title or _title(engine)
        self.status = "live"
        self._engine = weakref.ref(engine)  # the dashboard must not keep a shut-down engine alive
        self._stop = threading.Event()
        self._ended_event = threading.Event()
        self._thread: Optional[threading.Thread] = None
        w = widgets_or_none(widget)
        self.widget = w.HTML(value="") if w is not None else None
        if self.widget is not None:
            self.widget.add_class("nbgen-dashboard-widget")
        self.poll()

    # ---- state --------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Read one stats snapshot and re-render; False once the engine is gone or shut down."""
        eng = self._engine()
        if eng is None:
            return self._ended("engine released")
        try:
            stats = eng.stats()
        except RuntimeError:  # "engine is shut down": show the numbers it had at shutdown
            if getattr(eng, "shutting_down", False):
                # stats() refuses as soon as shutdown() starts, final_stats comes once the loop has
                # stopped: end then, or the last numbers shown are those of the previous refresh
                return True
            final = getattr(eng, "final_stats", None)
            if self.status == "live" and final:
                self.history.append(final)
            return self._ended("engine shut down")
        self.history.append(stats)
        self._render()
        return True

    def _ended(self, why: str) -> bool:
        if self.status in ("live", "stopped"):
            self.status = why
            self._render()
            self._finish_displays()
        self._ended_event.set()
        return False

    def html(self) -> str:
        """The current view as an HTML fragment (also the static snapshot)."""
        return dashboard_html(self.history, self.title, self.status)

    def text(self) -> str:
        """The current numbers as one line of text."""
        return dashboard_text(self.history.latest) + ("" if self.status == "live" else f" ({self.status})")

    def _render(self) -> None:
        if self.widget is not None:
            self.widget.value = self.html()
        if self.widget is None or self._final:  # an HTML output: update it in place
            self._update_displays()

    # ---- refresh thread -------------------------------------------------------------------------
    def start(self) -> "Dashboard":
        """Start refreshing every ``interval`` seconds (idempotent; resumes after ``stop()``)."""
        if self._thread is not None and self._thread.is_alive():
            return self
        if self.status == "stopped":
            self.status, self._final = "live", False
            self._update_displays()  # the live widget again
        if self.status != "live":
            return self
        self._stop.clear()
        self._ended_event.clear()
        self._thread = threading.Thread(target=self._run, name="nbgen-dashboard", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.poll():
                    break
            except Exception as e:  # never let a rendering error kill the kernel's output silently
                self._ended(f"stopped: {type(e).__name__}: {e}")
                break

    def stop(self) -> None:
        """Stop refreshing; the output becomes a static snapshot of the last numbers."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.status == "live":
            self._ended("stopped")

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the dashboard ends (engine shut down or released, or ``stop()``); True if it did."""
        return self._ended_event.wait(timeout)

    @property
    def running(self) -> bool:
        """True while the refresh thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # ---- display (Shown.show / _ipython_display_ use these) -------------------------------------
    def _text(self) -> str:
        return self.text()

    def _snapshot_html(self) -> str:
        return self.html()


def _title(engine: Any) -> str:
    """'nbgen · <model name> · <device>' (the model's short name, not its cache folder)."""
    name = getattr(engine, "model_name", None)
    if not name:
        path = getattr(getattr(engine, "config", None), "model_path", None)
        name = str(path).rstrip("/").split("/")[-1] if path else type(engine).__name__
    device = getattr(engine, "device", None)
    return f"nbgen · {name}" + (f" · {device}" if device else "")


def dashboard(engine: Any = None, interval: float = 0.33, history: int = 240,
              widget: Optional[bool] = None, display: bool = True) -> Dashboard:
    """Show a live dashboard for ``engine`` (the default engine when None) and return it.

    Refreshes every ``interval`` seconds from a background thread until ``.stop()`` or engine
    shutdown. ``widget=None`` uses ipywidgets when installed, else an updating HTML output.
    """
    if engine is None:
        engine = default_engine()
    d = Dashboard(engine, interval=interval, history=history, widget=widget)
    if display:
        d.show()
    return d.start()
