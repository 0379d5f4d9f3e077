"""nbgen.playground(engine, prompt=...): sampling sliders, k samples side by side, tok/s shown.

Any change regenerates after a short pause (debounced); a newer change aborts the samples still
running. Each sample streams on its own thread into its own box.
"""
from __future__ import annotations

import html
import math
import threading
import time
import uuid
from typing import Any, Mapping, Optional

from nbgen.notebook._compat import Debouncer, Shown, widgets_or_none
from nbgen.core.sampling import SamplingParams

# name: (min, max, step, default); top_k 0 on the slider means "off" (-1 for the engine)
SLIDERS: dict[str, tuple[float, float, float, float]] = {
    "temperature": (0.0, 2.0, 0.05, 0.7),
    "top_p": (0.05, 1.0, 0.05, 0.95),
    "top_k": (0, 200, 1, 0),
    "min_p": (0.0, 0.5, 0.01, 0.0),
    "repetition_penalty": (0.5, 2.0, 0.05, 1.0),
    "max_new_tokens": (1, 512, 1, 64),
}
INT_SLIDERS = ("top_k", "max_new_tokens")
# on a log2 scale: 0.5 and 2 lie as far from 1 (no penalty) as they act; step 0.02 in the exponent
LOG_SLIDERS = ("repetition_penalty",)
CONTROL_WIDTH, LABEL_WIDTH = "460px", "140px"   # a ~260 px track: a 30 px drag moves temperature ~0.2

def sample_params(values: Mapping[str, Any], k: int, seed: int) -> list[dict[str, Any]]:
    """Slider values -> k validated sampling-param dicts (sample i uses seed + i)."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    base = {name: (int(values[name]) if name in INT_SLIDERS else float(values[name]))
            for name in SLIDERS if name in values}
    if base.get("top_k", -1) == 0:
        base["top_k"] = -1
    out = [{**base, "sampling_seed": int(seed) + i} for i in range(k)]
    for p in out:
        SamplingParams.from_dict(p)  # raise here, with the engine's message, not in a thread
    return out


def sample_html(i: int, text: str, tokens: int, seconds: float, status: str) -> str:
    """One sample's box."""
    rate = tokens / seconds if seconds > 0 else 0.0
    return (f'<div class="nbgen-sample" style="border:1px solid #ddd;border-radius:6px;padding:6px;'
            f'min-width:220px;flex:1"><div style="font-size:11px;color:#888">#{i + 1} · {status} · '
            f'{tokens} tokens · <span class="nbgen-tok-s">{rate:.1f}</span> tok/s</div>'
            f'<div style="white-space:pre-wrap;font-family:monospace">{html.escape(text)}</div></div>')


def settings_text(prompt: str, values: Mapping[str, Any], seed: int, k: int, chat: bool) -> str:
    """The settings in one line (the static snapshot's header)."""
    parts = [f"{n} {'off' if n == 'top_k' and int(values[n]) == 0 else format(float(values[n]), 'g')}"
             for n in SLIDERS if n in values]
    head = f"prompt {prompt!r}" + (" (chat template)" if chat else "")
    return " · ".join([head, *parts, f"seed {seed}", f"k {k}"])


class Playground(Shown):
    """Sliders + prompt box + k sample boxes. ``.values``, ``.regenerate()``, ``.texts``."""

    def __init__(self, engine: Any, prompt: str = "Once upon a time", k: int = 2, seed: int = 0,
                 chat: bool = False, debounce: float = 0.4, widget: Optional[bool] = None, **initial: Any) -> None:
        unknown = set(initial) - set(SLIDERS)
        if unknown:
            raise ValueError(f"unknown playground setting(s) {sorted(unknown)}; known: {list(SLIDERS)}")
        self.engine, self.prompt, self.k, self.seed, self.chat = engine, prompt, k, seed, chat
        self.values = {n: initial.get(n, spec[3]) for n, spec in SLIDERS.items()}
        sample_params(self.values, k, seed)  # bad initial settings fail now
        self.status = "open"  # "open", "closed" or "engine shut down"
        self._gen = 0  # generation counter: threads of an older generation stop drawing
        self._rids: list[str] = []
        self._lock = threading.Lock()
        self.texts: list[str] = [""] * k
        self._boxes_html: list[str] = [sample_html(i, "", 0, 0.0, "waiting") for i in range(k)]
        self._done = threading.Event()
        self._closed = threading.Event()
        self._debouncer = Debouncer(debounce, self.regenerate)
        self.controls: dict[str, Any] = {}
        w = widgets_or_none(widget)
        self.widget = self._build(w) if w is not None else None
        if hasattr(engine, "is_shutdown"):  # follow the engine: disable everything once it is shut down
            threading.Thread(target=self._watch_engine, name="nbgen-playground", daemon=True).start()

    # ---- widgets ----------------------------------------------------------------------------------
    def _build(self, w: Any) -> Any:
        style, layout = {"description_width": LABEL_WIDTH}, {"width": CONTROL_WIDTH}
        for name, (lo, hi, step, _) in SLIDERS.items():
            # the readout is an editable box (type a value, Enter); continuous_update=False: one run per drag
            common = {"value": self.values[name], "description": name, "style": style,
                      "continuous_update": False, "layout": w.Layout(**layout)}
            if name in LOG_SLIDERS:  # exponents of 2: log2(0.5) = -1 .. log2(2) = 1
                ctrl = w.FloatLogSlider(base=2, min=math.log2(lo), max=math.log2(hi), step=0.02,
                                        readout_format=".2f", **common)
            elif name in INT_SLIDERS:
                ctrl = w.IntSlider(min=lo, max=hi, step=step, **common)
            else:
                ctrl = w.FloatSlider(min=lo, max=hi, step=step, readout_format=".2f", **common)
            self.controls[name] = ctrl
        self.controls["seed"] = w.IntText(value=self.seed, description="seed", style=style,
                                          layout=w.Layout(width="300px"))
        self.controls["k"] = w.IntSlider(value=self.k, min=1, max=4, description="samples (k)", style=style,
                                         continuous_update=False, layout=w.Layout(**layout))
        self.controls["chat"] = w.Checkbox(value=self.chat, description="chat template", style=style,
                                           layout=w.Layout(**layout))
        self.prompt_box = w.Textarea(value=self.prompt, layout=w.Layout(width="auto", align_self="stretch", height="70px"))
        for c in [*self.controls.values(), self.prompt_box]:
            c.observe(self._on_change, names="value")
        self.out = w.HTML(value=self._samples_html())
        self.status_label = w.Label(value="")
        # the controls' column is exactly as wide as the controls (no empty band before the samples);
        # the samples take the rest and wrap below the controls on narrow notebooks
        self.left = w.VBox(list(self.controls.values()), layout=w.Layout(flex="0 0 auto", width=CONTROL_WIDTH))
        self.right = w.VBox([self.out, self.status_label], layout=w.Layout(flex="1 1 320px", min_width="320px",
                                                                      margin="0 0 0 12px"))
        return w.VBox([self.prompt_box, w.HBox([self.left, self.right],
                                               layout=w.Layout(flex_flow="row wrap", width="auto"))])

    def _on_change(self, change: Mapping[str, Any]) -> None:
        if self.status != "open":
            return
        self.prompt = self.prompt_box.value
        for name in SLIDERS:
            self.values[name] = self.controls[name].value
        self.seed, self.chat = int(self.controls["seed"].value), bool(self.controls["chat"].value)
        if self.controls["k"].value != self.k:
            self.k = int(self.controls["k"].value)
        self._debouncer.trigger()

    def _samples_html(self) -> str:
        return '<div style="display:flex;gap:8px;flex-wrap:wrap">' + "".join(self._boxes_html) + "</div>"

    def _render(self) -> None:
        if self.widget is not None and not self._final:
            self.out.value = self._samples_html()
        else:
            self._update_displays()

    # ---- generation -------------------------------------------------------------------------------
    def regenerate(self, wait: bool = False) -> None:
        """Abort running samples and start k new ones with the current settings (not once closed)."""
        if self.status != "open":
            return
        try:
            params = sample_params(self.values, self.k, self.seed)
            prompt = (self.engine.apply_chat_template([{"role": "user", "content": self.prompt}])
                      if self.chat else self.prompt)
        except (ValueError, TypeError) as e:
            self._set_status(f"invalid settings: {e}")
            return
        with self._lock:
            if self.status != "open":  # closed meanwhile
                return
            self._gen += 1
            gen, old = self._gen, self._rids
            self._rids = [f"nbgen-play-{uuid.uuid4().hex[:10]}" for _ in range(self.k)]
            self.texts = [""] * self.k
            self._boxes_html = [sample_html(i, "", 0, 0.0, "starting") for i in range(self.k)]
            self._done.clear()
        self._set_status("")
        self._abort(old)
        remaining = [self.k]
        rids = list(self._rids)
        threads = [threading.Thread(target=self._sample, args=(gen, i, prompt, p, rids[i], remaining), daemon=True)
                   for i, p in enumerate(params)]
        for t in threads:
            t.start()
        if wait:
            for t in threads:
                t.join()

    def _sample(self, gen: int, i: int, prompt: str, params: dict[str, Any], rid: str,
                remaining: list[int]) -> None:
        t0, text, tokens, status = time.perf_counter(), "", 0, "running"
        last = 0.0
        try:
            for chunk in self.engine.generate(prompt, params, stream=True, rid=rid):
                if gen != self._gen:
                    return  # a newer run took over (and aborted this request)
                text += chunk.get("text") or ""
                meta = chunk.get("meta_info") or {}
                tokens = int(meta.get("completion_tokens", tokens + len(chunk.get("output_ids") or [])))
                fr = meta.get("finish_reason")
                if fr:
                    status = fr.get("type", "done")
                now = time.perf_counter()
                if fr or now - last > 0.1:
                    self._update(gen, i, text, tokens, now - t0, status)
                    last = now
        except Exception as e:
            self._update(gen, i, text, tokens, time.perf_counter() - t0, f"error: {e}")
        finally:
            with self._lock:
                remaining[0] -= 1
                if remaining[0] == 0 and gen == self._gen:
                    self._done.set()

    def _update(self, gen: int, i: int, text: str, tokens: int, seconds: float, status: str) -> None:
        with self._lock:
            if gen != self._gen:
                return
            self.texts[i] = text
            self._boxes_html[i] = sample_html(i, text, tokens, seconds, status)
        self._render()

    def _set_status(self, msg: str) -> None:
        if self.widget is not None:
            self.status_label.value = msg

    def wait(self, timeout: Optional[float] = None) -> list[str]:
        """Block until the current samples finish; return their texts."""
        self._done.wait(timeout)
        return list(self.texts)

    # ---- the end --------------------------------------------------------------------------------
    def _abort(self, rids: list[str]) -> None:
        if rids:
            try:
                self.engine.abort(rids)
            except RuntimeError:  # the engine is shut down: nothing runs anyway
                pass

    def _end(self, state: str, message: str) -> None:
        """Stop for good: no more runs, controls disabled, the output a static snapshot."""
        self._debouncer.cancel()
        with self._lock:
            if self.status != "open":
                return
            self.status = state
            self._gen += 1
            old, self._rids = self._rids, []
            self._done.set()
        self._closed.set()
        self._abort(old)
        for c in [*self.controls.values(), *([self.prompt_box] if self.widget is not None else [])]:
            c.disabled = True
        self._set_status(message)
        self._finish_displays()

    def close(self) -> None:
        """Stop regenerating and abort running samples; the output keeps a static snapshot."""
        self._end("closed", "closed")

    def _watch_engine(self) -> None:
        while not self._closed.wait(0.25):
            if self.engine.is_shutdown:
                self._end("engine shut down", "engine shut down: start a new Engine and playground")
                return

    # ---- display ----------------------------------------------------------------------------------
    def _text(self) -> str:
        return "\n---\n".join(self.texts)

    def _snapshot_html(self) -> str:
        head = html.escape(settings_text(self.prompt, self.values, self.seed, self.k, self.chat))
        note = "" if self.status == "open" else f" ({html.escape(self.status)})"
        return (f'<div class="nbgen-playground" data-status="{html.escape(self.status)}" '
                'style="font-family:system-ui,sans-serif">'
                f'<div style="font-size:11px;color:#666;margin-bottom:4px">{head}{note}</div>'
                f"{self._samples_html()}</div>")


def playground(engine: Any, prompt: str = "Once upon a time", k: int = 2, seed: int = 0, chat: bool = False,
               widget: Optional[bool] = None, display: bool = True, **initial: Any) -> Playground:
    """Show the sampling playground and run the first generation; returns the Playground.

    ``initial`` sets starting values (temperature, top_p, top_k (0 = off), min_p,
    repetition_penalty, max_new_tokens). Without ipywidgets it runs once and shows the samples.
    """
    pg = Playground(engine, prompt=prompt, k=k, seed=seed, chat=chat, widget=widget, **initial)
    if display:
        pg.show()
    pg.regenerate(wait=pg.widget is None)
    return pg
