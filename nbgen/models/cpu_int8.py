"""8-bit LM head on the CPU for decode steps of a few rows: a (tied) output matrix whose values lie on
GGUF's Q8_0 grid (groups of 32 along the hidden size, q in [-127, 127] and one scale per group) keeps an
int8 copy, read by nbgen's C GEMV (``cpu_ops.q8_gemv``).

The embedded SmolLM2-135M's GGUF stores its tied embedding as Q8_0. At batch 1 the logits matmul reads
that 49152 x 576 matrix once per token: 57 MB in bf16, 32 MB as int8 plus fp32 group scales (measured
on a 2-core AVX-512 machine: 1.06 ms against 2.11 ms for the oneDNN-packed bf16 matmul, 1.8 ms against
3.7 ms on one core). The int8 values are the GGUF's own, so the logits stay at the file's precision.
Steps of more than ``MAX_ROWS`` rows keep the bf16 matmul (compute-bound there).

Detection as in ``cpu_int4``: the GGUF loads dequantized; ``cpu_ops.q8_grid`` finds q and d back from the
values and rejects a weight when any value is off its group's grid by more than bf16 rounding, so bf16
checkpoints keep their exact bf16 head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nbgen.kernels import cpu_ops

GROUP = 32
MAX_ROWS = 4          # the C GEMV's row limit; bigger steps use the bf16 matmul
# a value within this share of itself of its grid point is bf16 rounding of a Q8_0 value (bf16 keeps 8
# significant bits; the scale found from the group's largest value carries one more rounding)
_TOL = 2.0 ** -7


@dataclass
class Int8Weight:
    """An int8 copy of a [N, K] weight on a Q8_0 grid."""
    q: torch.Tensor               # [N, K] int8
    scales: torch.Tensor          # [N, K / GROUP] fp32, one per group of 32 along K


@torch.no_grad()
def from_grid(w: torch.Tensor) -> Optional[Int8Weight]:
    """The int8 copy of a bf16 CPU weight [N, K] whose groups of 32 lie on an 8-bit grid, else None."""
    if w.device.type != "cpu" or w.dim() != 2 or w.dtype != torch.bfloat16 or w.shape[1] % GROUP \
            or not cpu_ops.available():
        return None
    found = cpu_ops.q8_grid(w, _TOL)
    return None if found is None else Int8Weight(*found)


def use_int8(x: torch.Tensor, q: Optional[Int8Weight]) -> bool:
    """This matmul takes the int8 path: a copy exists, the step has at most MAX_ROWS rows of bf16."""
    return q is not None and x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16


def int8_linear(x: torch.Tensor, q: Int8Weight) -> torch.Tensor:
    """x [M, K] @ W.T from the int8 copy -> [M, N] in x's dtype."""
    return cpu_ops.q8_gemv(x if x.stride(-1) == 1 else x.contiguous(), q.q, q.scales)
