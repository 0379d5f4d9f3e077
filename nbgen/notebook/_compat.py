"""Lazy ipywidgets / IPython access with clear messages when they are missing."""
from __future__ import annotations

import warnings
from typing import Any, Optional

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


def _ipython_active() -> bool:
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
    """

    _shown_in: Optional[int] = None

    widget: Any = None

    def _snapshot_html(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _text(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _bundle(self) -> dict[str, Any]:
        """The widget view where a widget manager runs; the HTML snapshot and text everywhere else."""
        bundle: dict[str, Any] = {"text/plain": self._text(), "text/html": self._snapshot_html()}
        if self.widget is not None:
            bundle.update(self.widget._repr_mimebundle_() or {})
            bundle["text/plain"] = self._text()
        return bundle

    def show(self) -> Any:
        """Display now: the widget where widgets run, an HTML snapshot elsewhere."""
        self._shown_in = _exec_count()
        if _ipython_active():
            self._handle = display(self._bundle(), raw=True, display_id=True)
        else:
            print(self._text())
        return self

    def _ipython_display_(self) -> None:
        if self._shown_in is not None and self._shown_in == _exec_count():
            return
        self.show()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return self._bundle()
