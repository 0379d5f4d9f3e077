"""Pure state and rendering for the notebook widgets: stats history -> numbers, SVG and HTML.

No ipywidgets here: the widgets only copy these strings into their ``value``, so everything a
person sees is unit-tested without a browser, and the same HTML is the static snapshot shown
where widgets are unavailable (nbconvert, GitHub, a terminal).
"""
from __future__ import annotations

import html
import math
import time
from collections import deque
from datetime import datetime
from typing import Any, Mapping, Optional, Sequence

STAT_KEYS = ("running", "waiting", "kv_pages_used", "kv_pages_total", "prefix_cache_pages", "page_size",
             "input_tok_s", "output_tok_s", "total_input_tokens", "total_output_tokens",
             "total_cached_tokens", "total_finished", "total_aborted", "uptime_s", "time")


class StatsHistory:
    """The last ``maxlen`` ``Engine.stats()`` snapshots (a ring buffer; oldest dropped)."""

    def __init__(self, maxlen: int = 240) -> None:
        self._items: deque[dict[str, Any]] = deque(maxlen=maxlen)

    def append(self, stats: Mapping[str, Any]) -> None:
        s = dict(stats)
        s.setdefault("time", time.time())
        self._items.append(s)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def latest(self) -> Optional[dict[str, Any]]:
        return self._items[-1] if self._items else None

    def series(self, key: str) -> list[float]:
        return [float(s.get(key, 0) or 0) for s in self._items]

    def seconds_ago(self) -> list[float]:
        """x axis: seconds relative to the newest snapshot (<= 0)."""
        if not self._items:
            return []
        t1 = float(self._items[-1]["time"])
        return [float(s["time"]) - t1 for s in self._items]

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per snapshot (columns: the stats() keys reported); ``time`` is
        the local wall-clock time of each snapshot (to the millisecond), ``uptime_s`` the engine's age."""
        import pandas as pd

        frame = pd.DataFrame(list(self._items))
        if "time" in frame:
            frame["time"] = pd.to_datetime([datetime.fromtimestamp(float(t)) for t in frame["time"]]).floor("ms")
        return frame


def fmt_num(x: float) -> str:
    """Compact human numbers: 950, 12.3k, 4.56M."""
    x = float(x)
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}" if x == int(x) or abs(x) >= 100 else f"{x:.1f}"


def kv_summary(stats: Mapping[str, Any]) -> dict[str, float]:
    """KV-cache use: pages used / total, fraction used, and the prefix cache's share of the pages."""
    used, total = int(stats.get("kv_pages_used", 0)), int(stats.get("kv_pages_total", 0))
    prefix = int(stats.get("prefix_cache_pages", 0))
    return {"used": used, "total": total, "frac": used / total if total else 0.0,
            "prefix_frac": prefix / total if total else 0.0}


def nice_ceil(x: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that is >= x (a clean axis maximum); 1 for x <= 0."""
    if x <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(x))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= x * (1 - 1e-9))


def time_ticks(span: float, most: int = 5) -> list[float]:
    """Seconds-ago tick positions 0, step, 2*step... within ``span``, at most ``most`` of them."""
    step = next((s for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600) if span / s < most), span)
    return [i * step for i in range(int(span // step) + 1)]


def svg_lines(xs: Sequence[float], series: Mapping[str, tuple[Sequence[float], str]], width: int = 440,
              height: int = 140, x_label: str = "seconds ago", y_unit: str = "tok/s", min_span: float = 10.0) -> str:
    """A small line chart as inline SVG: one polyline per series over x = seconds ago (<= 0, the
    axis spans at least ``min_span``), y from 0 to a clean maximum labelled at the top."""
    left, right, top, bottom = 46, 10, 8, 30
    pw, ph = width - left - right, height - top - bottom
    ymax = nice_ceil(max([max(v) for v, _ in series.values() if len(v)] + [0.0]))
    span = max([-min(xs) if xs else 0.0, float(min_span)])

    def px(x: float) -> float:
        return left + (x + span) / span * pw

    def py(v: float) -> float:
        return top + ph - v / ymax * ph

    grey = 'font-size="10" fill="#666"'
    parts = [f'<svg class="nbgen-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'xmlns="http://www.w3.org/2000/svg"><rect width="100%" height="100%" fill="#fafafa"/>'
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#ddd"/>'
             f'<line x1="{left}" y1="{top}" x2="{left + pw}" y2="{top}" stroke="#eee"/>'
             f'<text class="nbgen-ymax" x="{left - 4}" y="{top + 8}" {grey} text-anchor="end">{fmt_num(ymax)}</text>'
             f'<text x="{left - 4}" y="{top + 18}" font-size="9" fill="#999" text-anchor="end">'
             f'{html.escape(y_unit)}</text>'
             f'<text x="{left - 4}" y="{top + ph}" {grey} text-anchor="end">0</text>']
    for t in time_ticks(span):
        x = px(-t)
        parts.append(f'<line x1="{x:.1f}" y1="{top + ph}" x2="{x:.1f}" y2="{top + ph + 3}" stroke="#999"/>'
                     f'<text x="{x:.1f}" y="{top + ph + 13}" {grey} text-anchor="middle">'
                     f'{"now" if t == 0 else f"{t:g}"}</text>')
    parts.append(f'<text class="nbgen-xlabel" x="{left + pw / 2:.1f}" y="{height - 3}" {grey} '
                 f'text-anchor="middle">{html.escape(x_label)}</text>')
    for name, (values, color) in series.items():
        if len(values) < 2:
            continue
        pts = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in zip(xs, values))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{pts}">'
                     f"<title>{html.escape(name)}</title></polyline>")
    parts.append("</svg>")
    return "".join(parts)


def priority_summary(stats: Mapping[str, Any]) -> str:
    """``stats()["priorities"]`` as one line, most important first ("" without priority scheduling)."""
    prios = stats.get("priorities") or {}
    return " | ".join(f"{'none' if p is None else p}: {c.get('running', 0)} running, {c.get('waiting', 0)} waiting"
                      for p, c in prios.items())


def replica_summary(stats: Mapping[str, Any]) -> str:
    """A data-parallel engine's replicas as one line ("" with one replica): requests and KV use each."""
    parts = []
    for i, r in enumerate(stats.get("replicas") or []):
        kv = kv_summary(r)
        parts.append(f"{i}: {r.get('running', 0)} running, {r.get('waiting', 0)} waiting, KV {kv['frac']:.0%}")
    return " | ".join(parts)


def spec_summary(stats: Mapping[str, Any]) -> str:
    """Speculative decoding as one line: tokens per verify step and the draft acceptance rate
    ("" when the engine does not speculate)."""
    if "spec_accept_length" not in stats:
        return ""
    return (f"{stats['spec_accept_length']:.2f} tokens per step, {stats.get('spec_accept_rate', 0):.0%} of "
            f"drafts accepted")


def _bar(frac: float, prefix_frac: float) -> str:
    f, p = min(max(frac, 0.0), 1.0) * 100, min(max(prefix_frac, 0.0), 1.0) * 100
    return ('<div style="background:#eee;height:10px;width:100%;position:relative;border-radius:3px">'
            f'<div style="background:#4c78a8;height:10px;width:{f:.1f}%;border-radius:3px"></div>'
            f'<div title="prefix cache" style="position:absolute;top:0;left:0;background:#f58518;'
            f'opacity:0.6;height:10px;width:{p:.1f}%"></div></div>')


def dashboard_html(history: StatsHistory, title: str = "nbgen engine", status: str = "live") -> str:
    """The whole dashboard as one HTML fragment (live widget value and static snapshot alike).

    Key numbers are also in ``data-*`` attributes so a browser test can read them.
    """
    s = history.latest or {}
    kv = kv_summary(s)
    xs = history.seconds_ago()
    chart = svg_lines(xs, {"input tok/s": (history.series("input_tok_s"), "#4c78a8"),
                           "output tok/s": (history.series("output_tok_s"), "#e45756")})

    def cell(label: str, value: str, key: str) -> str:
        return (f'<div style="min-width:92px"><div style="font-size:11px;color:#666">{label}</div>'
                f'<div class="nbgen-{key}" style="font-size:18px;font-weight:600">{value}</div></div>')

    cells = "".join([
        cell("input tok/s", fmt_num(s.get("input_tok_s", 0)), "input-tok-s"),
        cell("output tok/s", fmt_num(s.get("output_tok_s", 0)), "output-tok-s"),
        cell("running", str(s.get("running", 0)), "running"),
        cell("waiting", str(s.get("waiting", 0)), "waiting"),
        cell("finished", fmt_num(s.get("total_finished", 0)), "finished"),
        cell("aborted", fmt_num(s.get("total_aborted", 0)), "aborted"),
        cell("tokens in / out", f'{fmt_num(s.get("total_input_tokens", 0))} / '
                                f'{fmt_num(s.get("total_output_tokens", 0))}', "totals"),
    ])
    attrs = " ".join(f'data-{k.replace("_", "-")}="{s.get(k, 0)}"' for k in STAT_KEYS if k in s)
    prio = priority_summary(s)
    prio_line = (f'<div class="nbgen-priorities" style="font-size:11px;color:#444;margin-bottom:4px">'
                 f'priority {html.escape(prio)}</div>' if prio else "")
    if s.get("replicas"):      # dp_size > 1: the numbers above are summed over these
        prio_line += (f'<div class="nbgen-replicas" style="font-size:11px;color:#444;margin-bottom:4px">'
                      f'replicas {html.escape(replica_summary(s))}</div>')
    if "lora_adapters" in s:   # an enable_lora engine: the adapters loaded now
        names = ", ".join(s["lora_adapters"]) or "none"
        prio_line += (f'<div class="nbgen-lora" style="font-size:11px;color:#444;margin-bottom:4px">'
                      f'LoRA adapters: {html.escape(names)}</div>')
    spec = spec_summary(s)
    if spec:
        prio_line += (f'<div class="nbgen-spec" data-spec-accept-length="{s["spec_accept_length"]:.3f}" '
                      f'style="font-size:11px;color:#444;margin-bottom:4px">speculative: {html.escape(spec)}</div>')
    return (f'<div class="nbgen-dashboard" data-status="{html.escape(status)}" {attrs} '
            'style="font-family:system-ui,sans-serif;border:1px solid #ddd;border-radius:6px;padding:8px;'
            'max-width:460px">'
            f'<div style="display:flex;flex-wrap:wrap;justify-content:space-between;align-items:baseline;'
            f'column-gap:8px"><b style="overflow-wrap:anywhere">{html.escape(title)}</b>'
            f'<span class="nbgen-status" style="color:#888;font-size:11px;white-space:nowrap">{html.escape(status)} · '
            f'up {s.get("uptime_s", 0):.0f} s</span></div>'
            f'<div style="display:flex;flex-wrap:wrap;gap:6px;margin:6px 0">{cells}</div>{prio_line}'
            f'<div style="font-size:11px;color:#444"><span style="color:#4c78a8">━</span> input tok/s '
            f'<span style="color:#e45756">━</span> output tok/s</div>'
            f'{chart}<div style="font-size:11px;color:#444;margin-top:4px">KV cache '
            f'<span class="nbgen-kv">{kv["used"]} / {kv["total"]} pages ({kv["frac"]:.0%})</span>, '
            f'prefix cache {kv["prefix_frac"]:.0%} '
            f'<span style="color:#4c78a8">■</span> used <span style="color:#f58518">■</span> prefix</div>'
            f'{_bar(kv["frac"], kv["prefix_frac"])}</div>')


def dashboard_text(stats: Optional[Mapping[str, Any]]) -> str:
    """One-line plain-text snapshot (terminals, logs)."""
    if not stats:
        return "nbgen: no stats yet"
    kv = kv_summary(stats)
    return (f"nbgen: in {fmt_num(stats.get('input_tok_s', 0))} tok/s, out {fmt_num(stats.get('output_tok_s', 0))} "
            f"tok/s | running {stats.get('running', 0)}, waiting {stats.get('waiting', 0)} | KV {kv['used']}/"
            f"{kv['total']} pages ({kv['frac']:.0%}, prefix {kv['prefix_frac']:.0%}) | finished "
            f"{stats.get('total_finished', 0)}, aborted {stats.get('total_aborted', 0)}, tokens in/out "
            f"{stats.get('total_input_tokens', 0)}/"
            f"{stats.get('total_output_tokens', 0)}"
            + (f" | priority {priority_summary(stats)}" if stats.get("priorities") else "")
            + (f" | speculative {spec_summary(stats)}" if "spec_accept_length" in stats else ""))


def svg_bars(labels: Sequence[str], values: Sequence[float], unit: str = "", width: Optional[int] = None,
             bar_h: int = 22, color: str = "#4c78a8", title: Optional[str] = None, bar_w: int = 300,
             max_label_chars: int = 72) -> str:
    """A horizontal bar chart as inline SVG (benchmarks notebook; no matplotlib needed).

    The label column is as wide as the longest label; labels over ``max_label_chars`` are cut with
    "…" (every label's full text is its tooltip). ``title`` is drawn above the bars. ``width`` None
    gives the bars ``bar_w`` pixels; a fixed ``width`` gives them what the labels and values leave.
    """
    pad, char_w = 4, 6.8                       # px per character of 12 px system-ui text, generous
    labels = [str(lab) for lab in labels]
    shown = [lab if len(lab) <= max_label_chars else lab[:max_label_chars - 1] + "…" for lab in labels]
    texts = [f"{fmt_num(v)}{unit}" for v in values]
    label_w = int(max([len(t) for t in shown] + [1]) * char_w) + 12
    value_w = int(max([len(t) for t in texts] + [1]) * char_w * 0.95) + 10
    bar_w = max(width - label_w - value_w, 40) if width is not None else bar_w
    width = label_w + bar_w + value_w
    head = 24 if title else 0
    vmax = max(list(values) + [1e-9])
    height = head + pad * 2 + bar_h * len(shown)
    parts = [f'<svg class="nbgen-bars" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             'xmlns="http://www.w3.org/2000/svg" font-family="system-ui,sans-serif">']
    if title:
        parts.append(f'<text class="nbgen-bars-title" x="{pad}" y="16" font-size="13" font-weight="600">'
                     f"{html.escape(title)}</text>")
    for i, (lab, full, v, text) in enumerate(zip(shown, labels, values, texts)):
        y = head + pad + i * bar_h
        w = max(v / vmax * bar_w, 0.0)
        parts.append(f'<text x="{label_w - 6}" y="{y + bar_h * 0.68:.1f}" font-size="12" text-anchor="end">'
                     f"<title>{html.escape(full)}</title>{html.escape(lab)}</text>"
                     f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{bar_h - 6}" fill="{color}"/>'
                     f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h * 0.68:.1f}" font-size="11">'
                     f"{html.escape(text)}</text>")
    parts.append("</svg>")
    return "".join(parts)
