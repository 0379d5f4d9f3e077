"""What a benchmark run is measured against: the device's copy bandwidth and bf16 matmul rate
measured in the same run, the bytes a decode step must read and the FLOPs a prompt's prefill must do.

``floor_seconds`` is DESIGN.md's floor (decode steps only: weights once per step plus every live
sequence's KV, at the copy bandwidth). ``prefill_flops`` is the matmul work the floor leaves out:
each prompt token through every decoder linear, each prompt's last token through the LM head, and
causal attention (q.K^T and P.V over the tokens before each one). Added to the floor at the
measured matmul rate it gives a second, prefill-inclusive bound ("floor+pf"), which matters for a
large model, whose prompts are compute-bound work a decode-only floor does not count.
``roofline_seconds`` also bounds each decode step by its GEMM work: a large model's step at a few
hundred rows is compute-bound (Llama-3.1-8B at 256 rows: 3.6 TFLOP, more than its 15 GB of weights
take to read on an H100 or H200), which the floor, reading the weights once per step, does not see.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from nbgen.models.fp8_linear import scale_bytes


def median_seconds(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median time of ``reps`` calls of ``fn`` after 2 warm-up calls (CUDA events on a GPU)."""
    times = []
    for _ in range(reps + 2):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    return sorted(times[2:])[reps // 2]


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s (bytes read + bytes written), median of 10 copies."""
    if device.type == "cpu":
        nbytes = 256 << 20
    a = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    b = torch.empty_like(a)
    secs = median_seconds(lambda: b.copy_(a), device, 10)
    return 2 * nbytes / secs


def model_bytes(model: torch.nn.Module, hf: Any, kv_bytes_per_token: Optional[int] = None) -> tuple[int, int]:
    """(weight bytes read per decode step, KV bytes per token): parameters at their stored size (fp8
    weights 1 byte each, plus their fp32 scales); the KV from ``kv_bytes_per_token`` when given
    (the pool's own), else at the embedding's dtype."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(scale_bytes(m.fp8)                                       # fp8 linears' scales
                 for m in model.modules() if getattr(m, "fp8", None) is not None)
    emb = model.model.embed_tokens.weight
    if not getattr(hf, "tie_word_embeddings", False):
        total -= emb.numel() * emb.element_size()    # a decode step reads a few embedding rows only
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    if kv_bytes_per_token is not None:
        return total, kv_bytes_per_token
    return total, 2 * hf.num_hidden_layers * kv * hd * emb.element_size()


def floor_seconds(ins: list[int], outs: list[int], weight_bytes: int, kv_bytes: int, bw: float) -> float:
    """Seconds to read the weights once per decode step and each live sequence's KV at ``bw`` bytes/s."""
    steps = max(outs) - 1                            # the first token of each seq comes from prefill
    kv_tokens = sum((o - 1) * i + (o - 1) * o // 2 for i, o in zip(ins, outs))  # sum_j (i + j), j=1..o-1
    return (steps * weight_bytes + kv_tokens * kv_bytes) / bw


def roofline_seconds(ins: list[int], outs: list[int], weight_bytes: int, kv_bytes: int, bw: float,
                     row_flops: float, rate: float, replicas: int = 1) -> float:
    """``floor_seconds`` with each decode step taking the longer of its weight read and its GEMM work
    (``row_flops`` per decoding row at ``rate`` FLOP/s), its rows and KV split over ``replicas``."""
    steps = max(outs) - 1
    live = [0] * (steps + 2)
    for o in outs:                                   # seq decodes at steps 1..o-1
        live[1] += 1
        live[o] -= 1
    t, rows = 0.0, 0
    for j in range(1, steps + 1):
        rows += live[j]
        t += max(weight_bytes / bw, rows / replicas * row_flops / rate)
    return t + floor_seconds(ins, outs, 0, kv_bytes, bw * replicas)


def shared_floor_seconds(prefix_len: int, groups: list[int], ins: list[int], outs: list[int], weight_bytes: int,
                         kv_bytes: int, bw: float) -> float:
    """``floor_seconds`` when each distinct KV page is read once per step (a shared-prefix
    attention): seq i's first ``prefix_len`` tokens are its group's (``groups[i]``), read once per step
    while any seq of the group decodes; the rest of its ``ins[i]`` tokens and its outputs are its own."""
    steps = max(outs) - 1
    last: dict[int, int] = {}
    for g, o in zip(groups, outs):
        last[g] = max(last.get(g, 0), o - 1)         # decode steps the group's prefix is read
    own = sum((o - 1) * (i - prefix_len) + (o - 1) * o // 2 for i, o in zip(ins, outs))
    return (steps * weight_bytes + (prefix_len * sum(last.values()) + own) * kv_bytes) / bw


def matmul_rate(device: torch.device) -> float:
    """Dense matmul throughput in FLOP/s: bf16 8192^3 on CUDA (the tensor cores' practical peak),
    fp32 1024^3 on a CPU; median of the timed repeats after a warm-up."""
    n, dt, reps = (8192, torch.bfloat16, 10) if device.type == "cuda" else (1024, torch.float32, 3)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    secs = median_seconds(lambda: a @ b, device, reps)
    return 2 * n ** 3 / secs


def prefill_flops(model: torch.nn.Module, hf: Any, prompt_lens: list[int], lm_head: bool = True) -> float:
    """Matmul FLOPs of prefilling ``prompt_lens`` (no cached prefixes): 2 x decoder linear weights per
    token, 2 x LM head weights per prompt (its last token; ``lm_head=False`` for embeddings, which
    pool the hidden states instead), 2 x Hq x D x n (n + 1) per layer and prompt for causal attention."""
    layers = model.model.layers
    linear = sum(p.numel() for p in layers.parameters() if p.dim() == 2)
    head = model.lm_head.weight.numel() if lm_head else 0
    heads = hf.num_attention_heads
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    attn = 2 * len(layers) * heads * hd * sum(n * (n + 1) for n in prompt_lens)
    return float(2 * linear * sum(prompt_lens) + 2 * head * len(prompt_lens) + attn)


def linear_rate(model: torch.nn.Module, rows: int, device: torch.device) -> float:
    """FLOP/s of one decoder layer's linears (its 2-D weights, as the model fuses them) on ``rows``
    token rows in bf16 on CUDA (fp32 on a CPU): the rate a prefill chunk of ``rows`` tokens can reach
    in its GEMMs, below the square-matmul rate when the hidden size is small. ``model`` may live on
    the meta device (only the shapes are read)."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [tuple(p.shape) for p in model.model.layers[0].parameters() if p.dim() == 2]
    xs = {k: torch.randn(rows, k, device=device).to(dt) for k in {s[1] for s in shapes}}
    ws = [torch.randn(s, device=device).to(dt) for s in shapes]

    def layer() -> None:
        for w in ws:
            torch.nn.functional.linear(xs[w.shape[1]], w)
    secs = median_seconds(layer, device, 10 if device.type == "cuda" else 3)
    flops = sum(2 * rows * o * i for o, i in shapes)
    return flops / secs

