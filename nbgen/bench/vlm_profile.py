"""``python -m nbgen.bench.vlm --profile``: where the images-in workload's time goes.

After the timed run the same workload runs again (prefix cache flushed first, so it computes the same
prefill) under the engine's profiler (``Engine.start_profile`` / ``stop_profile``; the trace file is kept).
From the trace: wall time, GPU busy time (the union of kernel and copy intervals; the rest is the GPU
waiting for the host), the vision tower's GPU time (kernels under the runner's ``nbgen::vision_tower``
range) and share, the loop thread's time in tower forwards, GPU time by kernel class (matmul, attention, other), and the top kernels.
Where the GPU waited (``bench/gpu_gaps.py``): its idle time before the first GPU work, during the image
prefill steps (up to the end of the last ``nbgen::image_step`` range on the GPU) and after them, the
largest gaps with the loop thread's host events beside them, and the first step's timeline (the loop
thread's first wait for pixels, its first tower launch).
"""
from __future__ import annotations

import gzip
import json
import re
import time
from collections import defaultdict
from typing import Any

from nbgen.bench.gpu_gaps import gap_report, loop_tid, merge
from nbgen.runtime.vision_step import IMAGE_STEP_RANGE, PIXELS_RANGE, TOWER_RANGE

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_MATMUL = re.compile(r"gemm|matmul|cutlass|nvjet|sm90_xmma|cublas|ampere_bf16|splitk", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|attn|prefill|decode|sdpa", re.I)


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    return sum(e - s for s, e in merge(spans))


def _kernel_class(name: str) -> str:
    if _MATMUL.search(name):
        return "matmul"
    if _ATTENTION.search(name):
        return "attention"
    return "other"


def summarize_trace(path: str, wall_s: float, top: int = 20) -> dict[str, Any]:
    """The summary of a Chrome trace written by the engine's profiler (see the module docstring)."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans, by_name, by_class = [], defaultdict(lambda: [0, 0.0]), defaultdict(float)
    tower, tower_host, first_ts = [], [], None
    image_steps, pixels, tower_starts = [], [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        first_ts = float(e["ts"]) if first_ts is None else min(first_ts, float(e["ts"]))
        cat, dur = e.get("cat", ""), float(e.get("dur", 0.0))
        if cat in _DEVICE_CATS:
            spans.append((float(e["ts"]), float(e["ts"]) + dur))
            if cat == "kernel":
                row = by_name[e.get("name", "?")]
                row[0] += 1
                row[1] += dur
                by_class[_kernel_class(e.get("name", ""))] += dur
        elif cat == "gpu_user_annotation" and e.get("name") == TOWER_RANGE:
            tower.append((float(e["ts"]), float(e["ts"]) + dur))
        elif cat == "gpu_user_annotation" and e.get("name") == IMAGE_STEP_RANGE:
            image_steps.append(float(e["ts"]) + dur)
        elif cat == "user_annotation" and e.get("name") == TOWER_RANGE:
            tower_host.append(dur)
            tower_starts.append(float(e["ts"]))
        elif cat == "user_annotation" and e.get("name") == PIXELS_RANGE:
            pixels.append((float(e["ts"]), dur))
    busy_us = _union_us(spans)
    # kernel time inside the tower's GPU ranges
    tower_us = 0.0
    if tower:
        tower_us = _union_us([(max(s, a), min(t, b)) for s, t in spans for a, b in tower if s < b and t > a])
    kernels = sorted(by_name.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    t0 = first_ts or 0.0
    first_gpu = min((s for s, _ in spans), default=t0)
    last_gpu = max((t for _, t in spans), default=t0)
    windows = {"before_first_gpu_work": (t0, first_gpu)}
    if image_steps:
        windows["image_steps"] = (first_gpu, max(image_steps))
        windows["after_image_steps"] = (max(image_steps), last_gpu)
    else:
        windows["steps"] = (first_gpu, last_gpu)
    first_pixels = min(pixels, default=None)
    first_step = {"pixels_wait_starts_s": (first_pixels[0] - t0) / 1e6 if first_pixels else None,
                  "pixels_wait_s": first_pixels[1] / 1e6 if first_pixels else None,
                  "pixels_wait_total_s": sum(d for _, d in pixels) / 1e6,
                  "tower_launch_starts_s": (min(tower_starts) - t0) / 1e6 if tower_starts else None,
                  "first_gpu_work_s": (first_gpu - t0) / 1e6}
    return {
        "wall_s": wall_s,
        "gpu_busy_s": busy_us / 1e6,
        "gpu_busy_share": busy_us / 1e6 / wall_s if wall_s else 0.0,
        # the trace's first event to its first GPU work: the caller's image loading and layout before the
        # first step (the processor's pixel work then runs in the background)
        "first_gpu_work_after_s": (min(s for s, _ in spans) - first_ts) / 1e6 if spans else 0.0,
        "tower_gpu_s": tower_us / 1e6,
        "tower_share_of_wall": tower_us / 1e6 / wall_s if wall_s else 0.0,
        "tower_forwards": len(tower_host),
        "tower_host_s": sum(tower_host) / 1e6,       # the loop thread inside tower forwards (CPU: all of it)
        "gpu_s_by_class": {k: v / 1e6 for k, v in sorted(by_class.items())},
        "top_kernels": [{"name": n[:120], "calls": c, "gpu_s": t / 1e6} for n, (c, t) in kernels],
        "first_step": first_step,
        "gpu_idle": gap_report(events, windows, loop_tid(events, TOWER_RANGE), t0),
    }


def profile_generate(eng: Any, ids: list[list[int]], images: list[Any], sp: dict[str, Any],
                     out_dir: str) -> dict[str, Any]:
    """Run the workload once more under the engine's profiler (cache flushed first) and summarize."""
    eng.flush_cache()
    eng.start_profile(output_dir=out_dir, activities=["CPU", "GPU"])
    t0 = time.perf_counter()
    eng.generate(input_ids=ids, sampling_params=sp, image_data=images, use_tqdm=False)
    wall = time.perf_counter() - t0
    res = eng.stop_profile()
    out = summarize_trace(res.path, wall)
    out["trace"] = res.path
    out["images_per_tower_forward"] = len(images) / out["tower_forwards"] if out["tower_forwards"] else 0.0
    out["steps"] = res.steps
    out["top_ops"] = [{k: r[k] for k in ("name", "calls", "cpu_us", "device_us")} for r in res.ops[:15]]
    return out
