"""A decode layer's kernels as the GPU ran them in the engine: durations and the gaps before each launch.

From a torch.profiler Chrome trace of an engine run (``python -m nbgen.bench ... --profile --layer-anchor NAME``):
the device kernels are cut into layers at each launch of an anchor kernel that runs once a layer (e.g.
``_qk_rope_kernel``, ``_qk_norm_rope_kernel`` for Qwen3, or ``_qkv_rope_kernel`` for fp8 at one row); the
layers whose kernel sequence is the most common one (decode layers of one step shape) are lined up position
by position, and each position prints its kernel, the median time from the previous kernel's end to its
start (negative: it overlapped the one before, as PDL launches do) and its median duration. A layer's median span, start to start, is the last line. The
decode_layers bench replays a layer without the engine around it; this reads what the engine did.
"""
from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass
class Kernel:
    """One device kernel: its name and [start, end) in µs on the trace's clock."""

    name: str
    start: float
    end: float


def trace_kernels(trace: dict[str, Any]) -> list[Kernel]:
    """The kernel events of a Chrome trace (torch.profiler's export), in start order."""
    out = [Kernel(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
           for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(out, key=lambda k: k.start)


@dataclass
class Layer:
    """The kernels from one launch of the anchor to the next; ``before``: the end of the kernel before the
    anchor; ``span``: anchor start to the next anchor's start (µs)."""

    kernels: list[Kernel]
    before: float
    span: float


def split_layers(kernels: list[Kernel], anchor: str) -> list[Layer]:
    """The kernels from each launch of ``anchor`` (matched as a substring of the name) to the next."""
    starts = [i for i, k in enumerate(kernels) if anchor in k.name and i > 0]
    return [Layer(kernels[a:b], kernels[a - 1].end, kernels[b].start - kernels[a].start)
            for a, b in zip(starts, starts[1:])]


def short(name: str, width: int = 60) -> str:
    """A kernel name cut to ``width`` characters (C++ template arguments dropped first)."""
    base = name.split("<", 1)[0]
    return base if len(base) <= width else base[: width - 1] + "…"


def layer_table(layers: Iterable[Layer]) -> list[str]:
    """Lines: the modal layer's kernels by position (median gap before, median duration; µs) and its span."""
    layers = list(layers)
    if not layers:
        return ["no layers: the anchor kernel ran fewer than three times"]
    names = lambda layer: tuple(k.name for k in layer.kernels)  # noqa: E731
    modal, count = Counter(names(layer) for layer in layers).most_common(1)[0]
    same = [layer for layer in layers if names(layer) == modal]
    lines = [f"{count} of {len(layers)} layers share the most common sequence of {len(modal)} kernels"]
    for j, name in enumerate(modal):
        durs = [layer.kernels[j].end - layer.kernels[j].start for layer in same]
        gaps = [layer.kernels[j].start - (layer.kernels[j - 1].end if j else layer.before) for layer in same]
        lines.append(f"  {j:2d} gap {statistics.median(gaps):7.2f}  dur {statistics.median(durs):7.2f}  {short(name)}")
    lines.append(f"layer span (anchor to the next anchor): median {statistics.median(layer.span for layer in same):.2f} µs")
    return lines


def print_layer_table(prof: Any, anchor: str, path: str) -> None:
    """Export ``prof``'s trace to ``path`` and print ``layer_table`` of its layers cut at ``anchor``."""
    prof.export_chrome_trace(path)
    with open(path) as f:
        kernels = trace_kernels(json.load(f))
    print(f"layers cut at {anchor!r} ({len(kernels)} kernels in the trace):")
    for line in layer_table(split_layers(kernels, anchor)):
        print(line)
