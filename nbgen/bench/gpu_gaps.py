"""Where the GPU sat idle in a profiler trace, and what the loop thread did meanwhile.

From a Chrome trace's complete ("X") events: the GPU's busy intervals (kernels, copies, memsets,
merged), the idle gaps between them, the idle time inside named windows of the run (``windows``:
e.g. before the first GPU work, the image prefill steps, the rest) and the largest gaps, each with the
host events of the loop thread that overlap it most (a sync such as ``cudaEventSynchronize`` or
``cudaHostAlloc``, a Python-side wait inside a range with no ops under it, or launches that come too
slowly). ``bench/vlm_profile.py`` reports it for the images-in workload.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Optional

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")

Span = tuple[float, float]


def merge(spans: Iterable[Span]) -> list[Span]:
    """The union of [start, end) intervals as sorted disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def idle_between(busy: list[Span], start: float, end: float) -> list[Span]:
    """The gaps of ``busy`` (merged) inside [start, end)."""
    gaps, cur = [], start
    for s, e in busy:
        if e <= cur:
            continue
        if s >= end:
            break
        if s > cur:
            gaps.append((cur, s))
        cur = max(cur, e)
    if cur < end:
        gaps.append((cur, end))
    return gaps


def loop_tid(events: list[dict[str, Any]], marker: str) -> Optional[Any]:
    """The thread of the first host range named ``marker``, else the thread with the most CPU ops."""
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == marker:
            return e.get("tid")
    count = Counter(e.get("tid") for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    return count.most_common(1)[0][0] if count else None


def gap_report(events: list[dict[str, Any]], windows: dict[str, Span], tid: Any, t0: float, top: int = 8,
               min_gap_us: float = 1000.0) -> dict[str, Any]:
    """GPU idle seconds per window, the gaps of at least ``min_gap_us`` (count, seconds) and the ``top``
    largest gaps: ``at_s`` (from ``t0``), ``ms`` and the loop thread's (``tid``) host events overlapping
    it most, as [name, overlap ms, event ms]."""
    xs = [e for e in events if e.get("ph") == "X"]
    busy = merge((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                 for e in xs if e.get("cat") in DEVICE_CATS)
    host = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", "?"))
            for e in xs if e.get("cat") in HOST_CATS and e.get("tid") == tid]
    idle = {name: sum(e - s for s, e in idle_between(busy, a, b)) / 1e6 for name, (a, b) in windows.items()}
    lo = min((a for a, _ in windows.values()), default=t0)
    hi = max((b for _, b in windows.values()), default=t0)
    gaps = [g for g in idle_between(busy, lo, hi) if g[1] - g[0] >= min_gap_us]
    largest = []
    for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        over = sorted(((min(e, b) - max(s, a), b - a, n) for a, b, n in host if a < e and b > s), reverse=True)
        largest.append({"at_s": round((s - t0) / 1e6, 4), "ms": round((e - s) / 1e3, 3),
                        "host": [[n, round(o / 1e3, 3), round(d / 1e3, 3)] for o, d, n in over[:4]]})
    return {"idle_s_by_window": idle, "gaps_over_min": len(gaps), "gaps_over_min_s": sum(e - s for s, e in gaps) / 1e6,
            "min_gap_ms": min_gap_us / 1e3, "largest_gaps": largest}
