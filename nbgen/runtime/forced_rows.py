"""Forced tokens as one-token rows: a jump-forward's tokens join the decode step (torch-free).

After a jump (runtime/jump_forward.py) a request holds several output tokens without KV: the forced
text and the token sampled before it. Computed as one chunk, they make the whole step a mixed
prefill step, which on CUDA leaves the decode graphs for the piecewise prefill graphs with one eager
attention call per layer and a prefill plan: a jump-forward step cost about twice the host time of
a decode step, and with hundreds of requests some request jumps at nearly every step.

A chunk of ``k`` tokens at positions ``p .. p+k-1`` is the same computation as ``k`` one-token rows,
row ``j`` at position ``p+j`` attending over the first ``p+j+1`` tokens of the request's pages: every
backend writes a step's K/V for all rows before any row attends (the decode graphs' fused RoPE
kernel, the Triton / flashinfer decode kernels, the torch backend), so row ``j`` sees the K/V rows
``0..j-1`` wrote. The step stays decode-only (a CUDA-graph replay, the padded batch growing by the
forced tokens); only the last row samples. The scheduler's update walks the rows in order, each
advancing ``num_computed`` by one. The rows sit at their request's place among the step's decode rows
(running order, chunks after them), so the step's sampling rows come in the same order from step to step
whether their requests jumped or not; the decode graphs stage those first (runtime/cuda_graphs.py).

``SchedulerConfig.forced_token_rows`` caps the rows of such a step (the largest decode graph on
CUDA). Requests of one schema move nearly in step, so their jumps come in waves (every request
forcing ``"name": "`` after its ``{``); a request whose rows do not fit waits one step
(``RowWaits``) rather than joining as a chunk, which would turn the whole step into a mixed prefill
step off the decode graphs; after one wait it goes as a chunk, so no request waits longer.
"""
from __future__ import annotations

from nbgen.core.batch import SeqWork
from nbgen.core.config import EngineConfig
from nbgen.core.request import Request

MAX_FORCED = 64  # longer runs (rare: a long enum member or constant) go as a chunk: one row per token costs KV reads


def forced_rows(req: Request, start: int, end: int, room: int) -> list[SeqWork]:
    """One-token rows for ``req``'s output tokens at positions ``[start, end)`` (the last samples),
    or [] when they should run as a chunk: prompt tokens among them, more than ``MAX_FORCED``, or
    more rows than ``room`` (the rows the step may still take)."""
    n_prompt = len(req.prompt_ids)
    k = end - start
    if start < n_prompt or k > min(room, MAX_FORCED) or k < 1:
        return []
    out, pages = req.output_ids, req.pages
    rows = [SeqWork(req, [out[p - n_prompt]], p, pages, False) for p in range(start, end)]
    rows[-1].sample = end == n_prompt + len(out)
    return rows


def forced_token_rows(cfg: EngineConfig) -> int:
    """``SchedulerConfig.forced_token_rows`` of a resolved config: 0 without jump-forward; with it the
    largest decode graph (a step beyond it would run eagerly), or, without decode graphs (CPU), four
    rows per running request."""
    if not cfg.enable_jump_forward:
        return 0
    return cfg.cuda_graph_max_bs or 4 * cfg.max_running_requests


class RowWaits:
    """The requests whose forced tokens did not fit a step's rows (scheduler only, torch-free): each
    may wait one schedule for rows, not two in a row."""

    def __init__(self) -> None:
        self._last: set[str] = set()    # rids that waited at the previous schedule
        self._now: set[str] = set()     # rids waiting at this one

    def next_step(self) -> None:
        """Call at the start of each schedule."""
        self._last, self._now = self._now, set()

    def wait(self, req: Request, start: int, end: int, cap: int, rows_taken: int) -> bool:
        """True when req's output tokens at ``[start, end)``, which found no room as rows, should wait
        for the next step (as rows then) instead of running as a chunk now: the step has other rows
        (``rows_taken``) to keep on the decode graphs, the tokens are output tokens that fit a step's
        rows (``cap``: ``forced_token_rows``; at most ``MAX_FORCED``), and req did not wait at the
        previous schedule."""
        if (not rows_taken or start < len(req.prompt_ids) or end - start > min(cap, MAX_FORCED)
                or req.rid in self._last):
            return False
        self._now.add(req.rid)
        return True
