"""Lazy ipywidgets / IPython access with clear messages when they are missing; the widgets' shared helpers
(``Shown``, ``Debouncer``)."""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Optional

_INSTALL = "pip install ipywidgets  (or: pip install 'nbgen[notebook]')"
_warned = False


def require_widgets() -> Any:
    """Import ipywidgets or raise an ImportError that says how to install it."""
    try:
        import ipywidgets
    except ImportError as e:
        raise ImportError(f"this nbgen widget needs ipywidgets: {_INSTALL}") from e
    return ipywidgets


def widgets_or_none(want: Optional[bool]) -> Any:
    """ipywidgets when wanted and importable; None (with one warning) when auto and missing."""
    global _warned
    if want is False:
        return None
    if want is True:
        return require_widgets()
    try:
        import ipywidgets
    except ImportError:
        if not _warned:
            warnings.warn(f"ipywidgets is not installed; showing a live HTML view without controls. "
                          f"For the interactive widget: {_INSTALL}", stacklevel=3)
            _warned = True
        return None
    return ipywidgets


def display(obj: Any, **kw: Any) -> Any:
    """IPython's display() when IPython is there; a print otherwise."""
    try:
        from IPython.display import display as _display
    except ImportError:
        print(obj)
        return None
    return _display(obj, **kw)


def ipython_active() -> bool:
    """True inside IPython (a kernel or the terminal shell)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _exec_count() -> Optional[int]:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    return getattr(ip, "execution_count", None) if ip is not None else None


class Shown:
    """Mixin: ``show()`` displays once; being a cell's result in the same cell shows nothing more.

    The helpers display themselves (so ``d = nbgen.dashboard(llm)`` shows the dashboard) and also
    return an object; without this, ``nbgen.dashboard(llm)`` as a cell's last line showed it twice.
    Every display keeps its handle: ``_update_displays()`` re-publishes them all, and
    ``_finish_displays()`` replaces them with the static HTML snapshot once the widget is done, so a
    saved notebook holds the final numbers and no widget view (which a reopened notebook cannot show).
    """

    _shown_in: Optional[int] = None
    _final = False  # done: displays carry only the static snapshot

    widget: Any = None

    def _snapshot_html(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _text(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def _handles(self) -> list[Any]:
        if "_display_handles" not in self.__dict__:
            self._display_handles: list[Any] = []
        return self._display_handles

    @property
    def _handle(self) -> Any:
        """The latest display handle (None until shown in IPython)."""
        return self._handles[-1] if self._handles else None

    def _static_bundle(self) -> dict[str, Any]:
        return {"text/plain": self._text(), "text/html": self._snapshot_html()}

    def _bundle(self) -> dict[str, Any]:
        """The widget view where a widget manager runs; the HTML snapshot and text everywhere else."""
        bundle = self._static_bundle()
        if self.widget is not None and not self._final:
            bundle.update(self.widget._repr_mimebundle_() or {})
            bundle["text/plain"] = self._text()
        return bundle

    def show(self) -> Any:
        """Display now: the widget where widgets run, an HTML snapshot elsewhere."""
        self._shown_in = _exec_count()
        if ipython_active():
            handle = display(self._bundle(), raw=True, display_id=True)
            if handle is not None:
                self._handles.append(handle)
        else:
            print(self._text())
        return self

    def _update_displays(self) -> None:
        """Re-publish every display of this object with the current bundle."""
        if not self._handles:
            return
        bundle = self._bundle()
        for handle in list(self._handles):
            try:
                handle.update(bundle, raw=True)
            except Exception:  # noqa: BLE001 - the front end is gone; nothing to update
                pass

    def _finish_displays(self) -> None:
        """The widget is done: its displays become the static snapshot (text/html + text/plain)."""
        self._final = True
        self._update_displays()

    def _ipython_display_(self) -> None:
        if self._shown_in is not None and self._shown_in == _exec_count():
            return
        self.show()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return self._bundle()


class Debouncer:
    """Call ``fn`` once, ``delay`` seconds after the last ``trigger()`` (slider drags -> one run)."""

    def __init__(self, delay: float, fn: Callable[[], None]) -> None:
        self.delay, self.fn = delay, fn
        self._timer: Optional[threading.Timer] = None
        self._lock = threading.Lock()

    def trigger(self, *_: Any) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.delay, self.fn)
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
