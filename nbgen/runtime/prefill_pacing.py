"""Decode-aware prefill pacing: a large model's prompts spread over its decode steps, never past the run.

A large model's decode step reads all its weights whatever its row count, and its matmuls stay near
that read time up to about the bf16 ridge point (Llama-3.1-8B on an H100, 32 layers' linears: 5.3 ms
at 16 rows, 6.8 ms at 256, 9.0 ms at 384; 20 us a row in 8192-row prefill chunks). Prompt tokens that
fill a decode step up to 256 rows cost far less than in a prefill-only step — as long as no request
starts decoding later than the batch's longest decode lasts anyway, or the run gets longer instead.

``paced_budget`` keeps both. The horizon is the most output tokens any running request may still
produce (``max_new_tokens``). While every pending prompt (running ones mid-prefill, then the queue in
admission order) belongs to a request due to produce fewer tokens than that, the step's budget is
``low`` (decode rows included); once one would outlast the horizon, or has no ``max_new_tokens``, the
step gets the full budget, as without pacing. So with nothing running, prompts are admitted in full
chunks; with the longest outputs first in the queue (``lof``) those start at once and the shorter
ones fill the decode steps later; with equal outputs (every request due at once) nothing changes.
Requests that stop early only shorten the horizon, which ends the pacing sooner.

The engine paces a large model's offline batches on a GPU when the user sets neither
``schedule_policy`` nor ``chunked_prefill_size`` (``pacing_tokens``; runtime/engine_parts.py).
"""
from __future__ import annotations

from itertools import islice
from typing import Iterable

from nbgen.core.request import Request

# queued requests looked at per step (admission takes the queue's head anyway)
MAX_LOOKAHEAD = 512
# steps a queued request may be held back by pacing (the longest W-nano output: pacing there never
# holds one longer than the run)
MAX_WAIT_STEPS = 1024
# the paced budget: the piecewise-prefill bucket at the bf16 ridge point of an H100 (~990 TFLOP/s over
# ~3.3 TB/s: a GEMM reads its weights for up to ~300 rows); the schedule cost model (bench/sim.py) on
# Llama-3.1-8B's measured GEMMs: 14.6 s with 256, 15.0 s with 384, 16.2 s with 288 (it pads to 384)
PACED_TOKENS = 256
# models whose weights take at least this many bytes (a step's weight read >= ~1.4 ms at 3 TB/s);
# below it a decode step is mostly attention (Qwen3-0.6B: 0.4 ms of weights in a ~6.5 ms step) and
# its mixed steps' small prefill-attention calls cost more than the matmul rows they fill
MIN_WEIGHT_BYTES = 4 << 30


def pacing_tokens(weight_bytes: int, on_gpu: bool) -> int:
    """The paced budget for a model with these weight bytes (per rank), or 0 (no pacing)."""
    return PACED_TOKENS if on_gpu and weight_bytes >= MIN_WEIGHT_BYTES else 0


def _left(req: Request) -> float:
    """Output tokens ``req`` may still produce (inf without ``max_new_tokens``)."""
    n = req.params.max_new_tokens
    return float("inf") if n is None else max(0, n - len(req.output_ids))


class PrefillPacer:
    """The scheduler's pacing state: when each queued request was first seen waiting (a request is never
    held back by pacing for more than ``max_wait`` steps, so a stream of long arrivals cannot starve a
    short request behind them)."""

    def __init__(self, low: int, max_wait: int = MAX_WAIT_STEPS) -> None:
        self.low, self.max_wait = low, max_wait
        self.step = 0
        self._since: dict[str, int] = {}     # rid -> the step it was first seen waiting

    def budget(self, running: list[Request], queue: Iterable[Request], high: int) -> int:
        """This step's budget (``paced_budget``), or ``high`` once a queued request waited too long."""
        self.step += 1
        head = list(islice(queue, MAX_LOOKAHEAD))
        self._since = {r.rid: self._since.get(r.rid, self.step) for r in head}   # admitted ones drop out
        if self.step - min(self._since.values(), default=self.step) >= self.max_wait:
            return high
        return paced_budget(running, head, self.low, high)


def paced_budget(running: list[Request], queue: Iterable[Request], low: int, high: int) -> int:
    """This step's token budget, ``low`` or ``high`` (see the module docstring): ``running`` in
    admission order, ``queue`` the waiting requests in admission order (read lazily)."""
    horizon = max((_left(r) for r in running), default=0.0)
    if horizon == float("inf"):
        return high
    for r in running:                                      # mid-prefill: admitted, not decoding yet
        if len(r.prompt_ids) + len(r.output_ids) - r.num_computed > 1 and _left(r) >= horizon:
            return high
    for k, r in enumerate(queue):
        if k >= MAX_LOOKAHEAD:
            break
        if _left(r) >= horizon:                            # would outlast the running decodes
            return high
    return min(low, high)
