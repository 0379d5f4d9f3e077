"""The row machinery the DataFrame helpers share (generate_df, embed_df, score_df).

A helper describes its rows as a ``RowJob`` (each row's checkpoint key, the request it sends, how
an output becomes column values); ``run_job`` does the rest the same way for all of them:

1. **plan**: load the checkpoint, keep rows whose saved key matches, fail rows whose cells are
   bad (an ``error`` message, or a ValueError with ``on_error="raise"``);
2. **run**: windows of ``batch_size`` rows through the job's engine call in completion order
   (``dataframe_window.run_window``: a row the engine refuses fails alone), each finished row
   recorded, appended to the checkpoint and counted on the ``RowProgress`` bar;
3. **interrupt**: the Stop button saves what finished and raises GenerationInterrupted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, TypeVar

from nbgen.core.errors import ArgumentTypeError
from nbgen.core.interrupt import GenerationInterrupted
from nbgen.core.scheduler_config import is_integral
from nbgen.dataframe_io import Checkpoint
from nbgen.dataframe_rows import RowError, require_column, row_text
from nbgen.dataframe_window import PendingRow, run_window
from nbgen.notebook.progress_bar import DONE, FAILED, STOPPED, RowProgress

T = TypeVar("T")
INTERRUPTED = "interrupted before this row finished"   # the error of rows an interrupt left unrun


class RowJob(Protocol):
    """One DataFrame helper's rows, as ``run_job`` sees them."""

    cols: tuple[str, ...]      # output columns (unprefixed); "error" is one of them
    labels: Any                # the DataFrame's index, for error messages
    on_error: str              # "skip" | "raise"
    desc: str                  # the progress bar's title

    def __len__(self) -> int: ...

    def key(self, pos: int) -> str:
        """Row ``pos``'s checkpoint key (RowError: the row cannot run)."""

    def check(self, pos: int) -> None:
        """RowError when row ``pos``'s cells cannot make a request (checked before anything runs)."""

    def pending(self, pos: int, engine: Any) -> PendingRow:
        """The request of row ``pos`` (RowError fails this row only)."""

    def submit(self, engine: Any, rows: list[PendingRow]) -> Iterator[tuple[int, Any]]:
        """Send a window: ``(index in rows, output)`` as each finishes (ValueError: refused)."""

    def record(self, out: Any) -> dict[str, Any]:
        """An output -> this row's column values (``error`` set when the request failed)."""

    def tokens(self, rec: dict[str, Any]) -> tuple[int, int]:
        """(input, output) tokens of a finished row, for the bar's tok/s."""

    def restore(self, rec: dict[str, Any]) -> dict[str, Any]:
        """A record read back from the checkpoint -> the values a fresh result has (JSON -> tuples)."""


@dataclass
class JobResult:
    """Column values per row and what the call reports in ``out.attrs["nbgen"]``."""

    values: dict[str, list[Any]]
    rows: int
    errors: int
    restored: int
    checkpoint: Optional[str]

    def attrs(self) -> dict[str, Any]:
        """What ``out.attrs["nbgen"]`` reports of the call."""
        return {"rows": self.rows, "errors": self.errors, "restored": self.restored,
                "checkpoint": self.checkpoint}


class TextRows:
    """RowJob parts of the helpers that send one text cell per row (embed_df, score_df)."""

    texts: list[Any]

    def __len__(self) -> int:
        return len(self.texts)

    def key(self, pos: int) -> str:  # pragma: no cover - each helper's own
        raise NotImplementedError

    def check(self, pos: int) -> None:
        row_text(self.texts[pos])

    def pending(self, pos: int, engine: Any) -> PendingRow:
        return PendingRow(pos, row_text(self.texts[pos]), {}, self.key(pos))

    def restore(self, rec: dict[str, Any]) -> dict[str, Any]:
        return rec


class _Results:
    """Output column values per row, the key of each row's saved result, and the checkpoint."""

    def __init__(self, job: RowJob, ckpt: Optional[Checkpoint]) -> None:
        n = len(job)
        self.job, self.ckpt = job, ckpt
        self.values: dict[str, list[Any]] = {c: [None] * n for c in job.cols}
        self.keys: list[Optional[str]] = [None] * n  # key of the saved (finished, error-free) result
        self.settled = [False] * n  # restored, failed or finished in this call
        self.progress: Optional[RowProgress] = None  # told of every row that settles while running

    def load(self) -> None:
        """Fill in the rows a checkpoint already holds."""
        if self.ckpt is None:
            return
        n = len(self.keys)
        for rec in self.ckpt.load():
            pos = int(rec["_row"])
            if 0 <= pos < n:
                rec = self.job.restore(rec)
                for c in self.job.cols:
                    self.values[c][pos] = rec.get(c)
                self.keys[pos] = rec["_key"] if not rec.get("error") else None

    def fail(self, pos: int, msg: str, key: Optional[str], exc: Optional[BaseException] = None) -> None:
        """Row ``pos`` gets ``msg`` as its error (or, with on_error="raise", the call raises)."""
        if self.job.on_error == "raise":
            label = self.job.labels[pos]
            label = label.item() if hasattr(label, "item") else label  # np.int64(3) -> 3
            raise ValueError(f"row {label!r} (position {pos}): {msg}") from exc
        rec: dict[str, Any] = {c: None for c in self.job.cols}
        rec["error"] = msg
        self.settled[pos] = True
        for c in self.job.cols:
            self.values[c][pos] = rec[c]
        self.keys[pos] = None
        if self.ckpt is not None and key is not None:
            self.ckpt.append({"_row": pos, "_key": key, **rec})
        if self.progress is not None:
            self.progress.settle(error=True)

    def finish(self, row: PendingRow, out: Any) -> None:
        """A window's result for ``row``: an output (or n of them), or the exception it raised."""
        if isinstance(out, BaseException):
            self.fail(row.pos, f"request rejected: {out}", row.key, out)
            return
        rec = self.job.record(out)
        if rec["error"]:
            self.fail(row.pos, rec["error"], row.key)
            return
        for c in self.job.cols:
            self.values[c][row.pos] = rec.get(c)
        self.keys[row.pos] = row.key
        self.settled[row.pos] = True
        if self.ckpt is not None:
            self.ckpt.append({"_row": row.pos, "_key": row.key, **rec})
        if self.progress is not None:
            n_in, n_out = self.job.tokens(rec)
            self.progress.settle(error=False, out_tokens=n_out, in_tokens=n_in)

    def unsettled_as_interrupted(self) -> None:
        """Rows that did not settle before an interrupt: no output, ``error`` = INTERRUPTED (values
        a checkpoint held for a changed row are dropped)."""
        for pos, ok in enumerate(self.settled):
            if not ok:
                for c in self.job.cols:
                    self.values[c][pos] = None
                self.values["error"][pos] = INTERRUPTED

    def done(self) -> int:
        """Rows with a result (restored or finished in this call)."""
        return sum(k is not None for k in self.keys)

    def errors(self) -> int:
        """Rows whose ``error`` is set."""
        return sum(e is not None for e in self.values["error"])


def check_call(df: Any, column: str, on_error: str, batch_size: int, param: str = "prompt_column") -> None:
    """The arguments every helper takes: a DataFrame with ``column`` (the argument ``param``),
    ``on_error``, ``batch_size``."""
    import pandas as pd

    if isinstance(df, pd.Series):
        raise ArgumentTypeError("df must be a pandas DataFrame, got a Series; pass series.to_frame() "
                        f"(its column is then {df.name if df.name is not None else 0!r})")
    if not isinstance(df, pd.DataFrame):
        raise ArgumentTypeError(f"df must be a pandas DataFrame, got {type(df).__name__}")
    require_column(df, column, param)
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if not is_integral(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")


def check_new_columns(df: Any, cols: Sequence[str], prefix: str, example: str) -> None:
    """The output columns must not overwrite the caller's data: ValueError suggesting a prefix."""
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str, got {prefix!r:.60}")
    clash = [prefix + c for c in cols if prefix + c in df.columns]
    if clash:
        raise ValueError(f"output columns {clash} already exist in df; pass prefix={example!r} (for example)")


def run_job(job: RowJob, checkpoint: Optional[str], engine: Callable[[], Any], batch_size: int,
            progress: bool, build: Callable[[JobResult], T]) -> T:
    """Plan, run and record ``job``'s rows (see the module docstring); ``build`` makes the output
    frame of the result. ``engine()`` is called only when some row still needs it. On an interrupt
    the GenerationInterrupted's ``partial`` is ``build`` of the rows settled so far (the others with
    ``error`` = INTERRUPTED)."""
    results = _Results(job, Checkpoint(checkpoint) if checkpoint is not None else None)
    n, restored, outcome = len(job), 0, FAILED
    bar: Optional[RowProgress] = None
    try:  # the checkpoint is closed (parquet: merged) however the call ends, also while planning or loading
        todo, restored, failed = _plan(job, results)
        eng = engine() if todo else None
        bar = results.progress = RowProgress(n, job.desc, presettled=n - len(todo), errors=failed,
                                             restored=restored, enabled=progress)
        bar.start()
        for start in range(0, len(todo), batch_size):
            window = _window(job, results, todo[start:start + batch_size], eng)
            for row, out in run_window(lambda rows: job.submit(eng, rows), window) if window else ():
                results.finish(row, out)
            del window
        outcome = DONE
    except KeyboardInterrupt:  # the Stop button, also while the default engine loads
        outcome = STOPPED
    finally:
        if bar is not None:
            bar.close(outcome)
        results.progress = None
        if results.ckpt is not None:
            results.ckpt.close()
    path = results.ckpt.path if results.ckpt is not None else None
    if outcome == STOPPED:
        exc = _interrupted(results, n)
        results.unsettled_as_interrupted()
        try:
            exc.partial = build(JobResult(results.values, n, results.errors(), restored, path))
        except Exception:  # pragma: no cover - the interrupt matters more than its partial frame
            exc.partial = None
        raise exc from None
    return build(JobResult(results.values, n, results.errors(), restored, path))


def _plan(job: RowJob, results: _Results) -> tuple[list[int], int, int]:
    """(rows still to run, rows restored, rows failed): rows whose checkpoint key matches are kept,
    rows with bad cells fail here."""
    results.load()
    todo: list[int] = []
    restored = failed = 0
    for pos in range(len(job)):
        key = None
        try:
            key = job.key(pos)
            if results.keys[pos] == key:
                restored += 1
                results.settled[pos] = True
                continue
            job.check(pos)
        except RowError as e:
            results.fail(pos, str(e), key, e)
            failed += 1
            continue
        todo.append(pos)
    return todo, restored, failed


def _window(job: RowJob, results: _Results, positions: list[int], eng: Any) -> list[PendingRow]:
    """The window's requests; rows that fail to build one (e.g. a chat template error) are recorded."""
    window: list[PendingRow] = []
    for pos in positions:
        try:
            window.append(job.pending(pos, eng))
        except RowError as e:
            results.fail(pos, str(e), job.key(pos), e)
    return window


def _interrupted(results: _Results, total: int) -> GenerationInterrupted:
    done, path = results.done(), results.ckpt.path if results.ckpt is not None else None
    msg = (f"interrupted: {done}/{total} rows saved to {path}; run the cell again to resume" if path else
           f"interrupted: {done}/{total} rows done (kept in this exception's .partial); "
           "pass checkpoint= to keep finished rows across interrupts")
    return GenerationInterrupted(msg, done=done, total=total, checkpoint=path)
