"""nbgen.stream(engine, prompt): text arriving in place in the cell output, with a Stop button.

Generation runs on a background thread so the cell returns at once and the kernel stays free to
handle the Stop button (a click is a kernel message; it could not be processed while the cell
itself blocked). ``cell.wait()`` blocks for the final text when a script needs it. When the text
is complete (or stopped, or the engine shut down) the output becomes static HTML, which a saved
notebook keeps.
"""
from __future__ import annotations

import html
import threading
import time
import uuid
from typing import Any, Mapping, Optional, Union

from nbgen.notebook import _compat
from nbgen.notebook._compat import Shown, widgets_or_none


class StreamState:
    """Pure accumulator of stream chunks: text so far, token count, rate, finish reason."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self.t0 = clock()
        self.t_last = self.t0
        self.text = ""
        self.tokens = 0
        self.finish_reason: Optional[dict[str, Any]] = None
        self.meta: dict[str, Any] = {}
        self.error: Optional[str] = None

    def add(self, chunk: Mapping[str, Any]) -> str:
        """Take one chunk (``text`` = new text); return the new text."""
        piece = chunk.get("text") or ""
        self.text += piece
        meta = chunk.get("meta_info") or {}
        if "completion_tokens" in meta:
            self.tokens = int(meta["completion_tokens"])  # cumulative in every chunk
        else:
            self.tokens += len(chunk.get("output_ids") or [])
        if meta.get("finish_reason"):
            self.finish_reason = meta["finish_reason"]
            self.meta = dict(meta)
        self.t_last = self.clock()
        return piece

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def tok_s(self) -> float:
        dt = self.t_last - self.t0
        return self.tokens / dt if dt > 0 else 0.0

    @property
    def engine_gone(self) -> bool:
        """True when the generation ended because the engine was shut down."""
        why = self.error or (self.finish_reason or {}).get("message") or ""
        return "engine is shut down" in str(why)

    def status(self) -> str:
        """'streaming · 12 tokens · 34.5 tok/s' or the finish reason once done."""
        if self.engine_gone:
            head = "engine shut down"
        elif self.error:
            return f"error: {self.error}"
        elif self.finish_reason:
            kind = self.finish_reason.get("type")
            head = "stopped" if kind == "abort" else f"done ({kind})"
        else:
            head = "streaming"
        return f"{head} · {self.tokens} tokens · {self.tok_s:.1f} tok/s"

    def html(self, prompt: Optional[str] = None) -> str:
        body = html.escape(self.text) + ("" if self.done else '<span style="color:#999">▌</span>')
        head = (f'<div style="color:#888;white-space:pre-wrap">{html.escape(prompt)}</div>' if prompt else "")
        return (f'<div class="nbgen-stream" data-done="{int(self.done)}" style="font-family:monospace;'
                f'white-space:pre-wrap;border-left:3px solid #4c78a8;padding-left:8px">{head}{body}</div>')


class StreamCell(Shown):
    """One streamed generation shown in place. ``.text``, ``.wait()``, ``.stop()``, ``.output``."""

    def __init__(self, engine: Any, prompt: str, sampling_params: Optional[dict[str, Any]] = None,
                 widget: Optional[bool] = None, show_prompt: bool = False, min_interval: float = 0.05,
                 **generate_kw: Any) -> None:
        self.engine, self.prompt = engine, prompt
        self.sampling_params = sampling_params
        self.generate_kw = generate_kw
        self.rid = f"nbgen-stream-{uuid.uuid4().hex[:12]}"
        self.state = StreamState()
        self.show_prompt = show_prompt
        self.min_interval = min_interval  # at most ~20 front-end updates a second
        self._done = threading.Event()
        self._stopping = False
        self._print = False  # outside Jupyter: print pieces to stdout as they arrive
        self._thread: Optional[threading.Thread] = None
        w = widgets_or_none(widget)
        self.widget = None
        if w is not None:
            self._out = w.HTML(value=self.state.html(self._shown_prompt()))
            self._label = w.Label(value="starting")
            self._button = w.Button(description="Stop", button_style="danger", icon="stop",
                                    layout=w.Layout(width="90px"))
            self._button.on_click(lambda _b: self.stop())
            self.widget = w.VBox([self._out, w.HBox([self._button, self._label])])
            self.widget.add_class("nbgen-stream-widget")

    def _shown_prompt(self) -> Optional[str]:
        return self.prompt if self.show_prompt else None

    # ---- running --------------------------------------------------------------------------------
    def start(self) -> "StreamCell":
        # validation errors (bad params, engine shut down) surface here, in the caller's cell
        it = self.engine.generate(self.prompt, self.sampling_params, stream=True, rid=self.rid,
                                  **self.generate_kw)
        self._thread = threading.Thread(target=self._run, args=(it,), name="nbgen-stream", daemon=True)
        self._thread.start()
        return self

    def _run(self, it: Any) -> None:
        last = 0.0
        try:
            for chunk in it:
                piece = self.state.add(chunk)
                if self._print:
                    print(piece, end="\n" if self.state.done else "", flush=True)
                now = time.perf_counter()
                if now - last >= self.min_interval or self.state.done:
                    self._render()
                    last = now
        except Exception as e:  # shown in the cell; the kernel keeps going
            self.state.error = f"{type(e).__name__}: {e}"
        finally:
            self._done.set()
            self._render()
            self._finish_displays()  # the final text as static HTML: no widget view left to save

    def stop(self) -> None:
        """Abort the request (the Stop button); text generated so far stays."""
        if self._done.is_set() or self._stopping:
            return
        self._stopping = True
        try:
            self.engine.abort(self.rid)
        except RuntimeError:
            pass

    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until the generation ends; return the whole text."""
        self._done.wait(timeout)
        return self.state.text

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def text(self) -> str:
        return self.state.text

    @property
    def output(self) -> dict[str, Any]:
        """An output dict like generate()'s once done (meta_info of the last chunk)."""
        return {"text": self.state.text, "meta_info": self.state.meta}

    # ---- display --------------------------------------------------------------------------------
    def _render(self) -> None:
        if self.widget is not None:
            self._out.value = self.state.html(self._shown_prompt())
            self._label.value = self.state.status()
            self._button.disabled = self._done.is_set()
        else:
            self._update_displays()

    def _text(self) -> str:
        return self.state.text

    def _snapshot_html(self) -> str:
        return (self.state.html(self._shown_prompt())
                + f'<div style="color:#888;font-size:11px">{html.escape(self.state.status())}</div>')


def stream(engine: Any, prompt: Union[str, list[dict[str, Any]]], sampling_params: Optional[dict[str, Any]] = None,
           *, widget: Optional[bool] = None, show_prompt: bool = False, display: bool = True,
           **generate_kw: Any) -> StreamCell:
    """Stream one generation into the cell output; returns the StreamCell at once.

    ``prompt``: text, or a conversation (a list of ``{"role", "content"}`` dicts) that goes through
    the model's chat template. The Stop button (or ``cell.stop()``) aborts the request.
    ``cell.wait()`` returns the text. Extra keyword arguments go to ``engine.generate`` (e.g.
    ``return_logprob=True``).
    """
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        prompt = engine.apply_chat_template(list(prompt))   # a conversation, as generate_df's cells
    elif prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"prompt must be text or a list of chat messages, got {type(prompt).__name__}: "
                         f"{prompt!r:.60}")
    cell = StreamCell(engine, prompt, sampling_params, widget=widget, show_prompt=show_prompt, **generate_kw)
    if display and _compat.ipython_active():
        cell.show()
    elif display:
        cell._print = True
    return cell.start()
