"""``with nbgen.profile(llm):`` — a torch.profiler trace of the engine's steps and a per-op table."""
from __future__ import annotations

import html
from typing import Any, Optional, Sequence

from nbgen.notebook._compat import Shown
from nbgen.notebook.state import fmt_num
from nbgen.runtime.profiler import ProfileResult


def has_device_time(result: ProfileResult) -> bool:
    """Whether the profile recorded device (GPU) time; a CPU profile's tables leave that column out."""
    return any(r["device_us"] for r in result.ops)


def ops_table_html(result: ProfileResult, top: int = 15) -> str:
    """The top ops (device time first, then self CPU time) as an HTML table."""
    dev = has_device_time(result)
    head = ("<tr><th style='text-align:left'>op</th><th>calls</th>" + ("<th>device ms</th>" if dev else "")
            + "<th>CPU ms (total)</th><th>self CPU ms</th></tr>")
    rows = "".join(
        f"<tr><td style='text-align:left;font-family:monospace'>{html.escape(r['name'][:80])}</td>"
        f"<td>{r['calls']}</td>" + (f"<td>{r['device_us'] / 1e3:.2f}</td>" if dev else "")
        + f"<td>{r['cpu_us'] / 1e3:.2f}</td><td>{r['self_cpu_us'] / 1e3:.2f}</td></tr>" for r in result.ops[:top])
    return (f"<div class='nbgen-profile'><b>profile</b>: {result.steps} engine steps in "
            f"{fmt_num(result.seconds)} s · trace <code>{html.escape(result.path)}</code> "
            "(open in Perfetto or chrome://tracing)"
            f"<table style='font-size:12px;text-align:right'>{head}{rows}</table></div>")


class Profile(Shown):
    """Context manager: profiles the engine's steps inside the block, then shows the top ops."""

    def __init__(self, engine: Any, output_dir: Optional[str] = None, num_steps: Optional[int] = None,
                 activities: Optional[Sequence[str]] = None, with_stack: bool = False,
                 record_shapes: bool = False, top: int = 15) -> None:
        self.engine = engine
        self.kw = dict(output_dir=output_dir, num_steps=num_steps, activities=activities,
                       with_stack=with_stack, record_shapes=record_shapes)
        self.top = top
        self.result: Optional[ProfileResult] = None

    def __enter__(self) -> "Profile":
        self.engine.start_profile(**self.kw)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.result = self.engine.stop_profile()
        self.show()

    @property
    def path(self) -> Optional[str]:
        """The Chrome / Perfetto trace file (None until the block ends)."""
        return self.result.path if self.result else None

    def table(self) -> Any:
        """The top ops as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.result.ops if self.result else [])

    def _text(self) -> str:
        if self.result is None:
            return "profile: running"
        lines = [f"profile: {self.result.steps} steps, {self.result.seconds:.2f} s, trace {self.result.path}"]
        dev = has_device_time(self.result)
        lines += [f"  {r['name'][:60]:60s} {r['calls']:6d}" + (f" dev {r['device_us'] / 1e3:9.2f} ms" if dev else "")
                  + f" cpu {r['self_cpu_us'] / 1e3:9.2f} ms" for r in self.result.ops[: self.top]]
        return "\n".join(lines)

    def _snapshot_html(self) -> str:
        return ops_table_html(self.result, self.top) if self.result else "<i>profile: running</i>"


def profile(engine: Any, output_dir: Optional[str] = None, num_steps: Optional[int] = None,
            activities: Optional[Sequence[str]] = None, with_stack: bool = False,
            record_shapes: bool = False, top: int = 15) -> Profile:
    """``with nbgen.profile(llm): llm.generate(...)`` records the steps and shows the top ops."""
    return Profile(engine, output_dir, num_steps, activities, with_stack, record_shapes, top)
