"""The DataFrame helpers' windows: rows through an engine iterator (``Engine.generate_iter``,
``encode_iter``, ``score_iter``), results in completion order.

Rows whose request the engine refuses are isolated by splitting the window, so only they fail;
rows with ``n > 1`` are handed back once all their samples finished.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass(slots=True)
class PendingRow:
    """One row on its way to the engine: its position, prompt text, sampling params and key."""

    pos: int
    prompt: str
    params: dict[str, Any]
    key: str


Submit = Callable[[list["PendingRow"]], Iterator[tuple[int, Any]]]   # rows -> (index, output) as they finish


def run_window(submit: Submit, batch: list[PendingRow]) -> Iterator[tuple[PendingRow, Any]]:
    """Yield (row, output-or-exception) as requests finish (completion order).

    The engine validates a whole call before running any of it, so one row the engine rejects
    (say, a prompt longer than the context) would sink its window: such a window is split in
    halves until the bad rows stand alone, and only those get the error.
    """
    it = None
    try:
        it = submit(batch)
        first = next(it, None)
    except (ValueError, TypeError) as e:
        if it is not None:
            it.close()
        if len(batch) == 1:
            yield batch[0], e
            return
        mid = len(batch) // 2
        yield from run_window(submit, batch[:mid])
        yield from run_window(submit, batch[mid:])
        return
    # the engine indexes outputs prompt-major over the n samples of each prompt
    owner = [k for k, p in enumerate(batch) for _ in range(int(p.params.get("n", 1) or 1))]
    need = [int(p.params.get("n", 1) or 1) for p in batch]
    got: dict[int, list[tuple[int, Any]]] = {}
    try:
        for item in _chain(first, it):
            i, out = item
            k = owner[i]
            if need[k] == 1:
                yield batch[k], out
                continue
            got.setdefault(k, []).append((i, out))
            if len(got[k]) == need[k]:
                yield batch[k], [o for _, o in sorted(got.pop(k), key=lambda t: t[0])]
    finally:
        it.close()  # early exit / KeyboardInterrupt: the engine aborts the unfinished requests


def _chain(first: Any, it: Iterator[Any]) -> Iterator[Any]:
    if first is not None:
        yield first
    yield from it
