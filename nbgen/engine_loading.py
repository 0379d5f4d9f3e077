"""Start-up feedback for ``Engine()``: a loading line in notebooks, INFO log lines elsewhere.

The engine reports its start-up stages (fetching the embedded model, loading weights, sizing the
KV cache, capturing CUDA graphs, warming up) through a stage callback, ``Callable[[str], None]``,
called on the thread doing the work. ``StartupFeedback`` forwards them to the caller's callback, or
shows them itself: in a Jupyter kernel one line with an indeterminate bar, replaced by a static
"loaded <model> on <device> in 7.9 s" when the engine is ready (by an empty output when loading
fails), so a saved notebook keeps no spinner; elsewhere one INFO log line per stage, no prints.
IPython is imported lazily, only where it is installed. Also here: the model's short name and the
warning for a second running Engine.
"""
from __future__ import annotations

import contextlib
import html
import logging
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

logger = logging.getLogger("nbgen")

StageCallback = Callable[[str], None]

_CACHE_KEY = re.compile(r"-[0-9a-f]{16}$")                       # converted GGUF dirs: <stem>-<key>
_QUANT = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)  # GGUF quantisation suffixes

_STYLE = "font-family:system-ui,sans-serif;font-size:12px;color:#555;display:flex;align-items:center;gap:8px"


def model_name(path: Optional[str]) -> str:
    """A short display name for a model path: the folder or file name without the GGUF
    quantisation and cache-key suffixes (the embedded model is ``SmolLM2-135M-Instruct``); an HF
    hub snapshot folder gives its repository's name."""
    if not path:
        return "model"
    p = Path(str(path).rstrip("/"))
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.split("--")[-1]
    name = p.name[:-5] if p.name.lower().endswith(".gguf") else p.name
    name = _QUANT.sub("", _CACHE_KEY.sub("", name))
    return name or str(path)


_default_start = threading.local()   # ``starting`` while default_engine() starts nbgen's own Engine


def warn_others_running(models: Sequence[str]) -> None:
    """One UserWarning when other Engines (their ``models``) still run in this process: each holds
    its model and KV cache in memory. Called from ``Engine.__init__`` (the warning points at its caller);
    silent while ``starting_default`` (that warning would tell the user to shut down nbgen's engines)."""
    if models and not getattr(_default_start, "starting", False):
        n, names = len(models), ", ".join(sorted(set(models)))
        warnings.warn(f"{n} other nbgen Engine{'s are' if n > 1 else ' is'} still running in this process "
                      f"({names}), each holding its model and KV cache in memory: call llm.shutdown() on "
                      "the old one first, or use `with nbgen.Engine() as llm:`", UserWarning, stacklevel=3)


@contextlib.contextmanager
def starting_default(yours: Sequence[str]) -> Iterator[None]:
    """Around default_engine() starting nbgen's own Engine: no "other Engines" warning; afterwards one
    naming the user's own running Engines of that kind (``yours``), which ``engine=`` would have used."""
    _default_start.starting = True
    try:
        yield
    finally:
        _default_start.starting = False
    if yours:
        warnings.warn(f"engine=None loads nbgen's default Engine beside your running {', '.join(sorted(set(yours)))}"
                      ": pass engine=<your Engine> to use yours instead of a second model in memory",
                      UserWarning, stacklevel=5)


def _kernel_display(bundle: dict[str, Any]) -> Any:
    """A display handle in a Jupyter kernel (IPython with a kernel); None anywhere else."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return None
    ip = get_ipython()
    if ip is None or getattr(ip, "kernel", None) is None:
        return None
    return display(bundle, raw=True, display_id=True)


class StartupFeedback:
    """The stage callback an Engine reports to while it starts; a context manager around start-up.

    With ``on_stage`` given, stages go to it and nothing is shown. Otherwise: the notebook line
    (Jupyter) or INFO logs. ``done(model, device)`` ends with the one-line summary; leaving the
    ``with`` block on an exception clears the line.
    """

    def __init__(self, on_stage: Optional[StageCallback] = None) -> None:
        self.on_stage = on_stage
        self.stages: list[str] = []
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._handle: Any = None
        if on_stage is None:
            self._handle = _kernel_display(self._line("starting the engine"))

    def __call__(self, stage: str) -> None:
        """Report one stage (any thread)."""
        with self._lock:
            self.stages.append(stage)
        if self.on_stage is not None:
            self.on_stage(stage)
        elif self._handle is not None:
            self._update(self._line(stage))
        else:
            logger.info("nbgen: %s", stage)

    @staticmethod
    def _line(stage: str) -> dict[str, Any]:
        text = f"nbgen: {stage}…"
        return {"text/plain": text,
                "text/html": f'<div class="nbgen-loading" data-stage="{html.escape(stage)}" style="{_STYLE}">'
                             '<progress style="width:120px;height:8px"></progress>'
                             f"<span>{html.escape(text)}</span></div>"}

    def _update(self, bundle: dict[str, Any]) -> None:
        try:
            self._handle.update(bundle, raw=True)
        except Exception:  # noqa: BLE001 - the front end went away; loading goes on
            logger.debug("nbgen: could not update the loading line", exc_info=True)

    def done(self, model: str, device: str) -> str:
        """Start-up finished: the summary line replaces the bar (or is logged); returns it."""
        summary = f"loaded {model} on {device} in {time.perf_counter() - self.t0:.1f} s"
        if self._handle is not None:
            self._update({"text/plain": f"nbgen: {summary}",
                          "text/html": f'<div class="nbgen-loaded" style="{_STYLE}">nbgen: '
                                       f"{html.escape(summary)}</div>"})
        elif self.on_stage is None:
            logger.info("nbgen: %s", summary)
        return summary

    def failed(self) -> None:
        """Start-up raised: clear the line (the error shows below it)."""
        if self._handle is not None:
            self._update({"text/plain": ""})

    def __enter__(self) -> "StartupFeedback":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.failed()
