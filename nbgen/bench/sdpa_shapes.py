"""``python -m nbgen.bench.sdpa_shapes``: scaled_dot_product_attention on the Qwen2.5-VL-7B tower's shapes
(16 heads of 80; windows of 64 patches, whole 448x448 images of 1 024) for tower batches of 25-28 images,
per backend: the first call at each new batch size (plan builds) and the steady-state time per call."""
from __future__ import annotations

import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _time(fn: Any, reps: int = 1) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main() -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        first, steady = [], []
        for images in (25, 26, 27, 28):
            for B, n in ((images * 16, 64), (images, 1024)):
                q, k, v = (torch.randn(B, 16, n, 80, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                with sdpa_kernel([backend]):
                    first.append(_time(lambda: F.scaled_dot_product_attention(q, k, v)))
                    steady.append(_time(lambda: F.scaled_dot_product_attention(q, k, v), reps=10))
        res[name] = {"first_calls_s": sum(first), "first_call_max_s": max(first),
                     "steady_ms_per_call": 1e3 * sum(steady) / len(steady)}
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
