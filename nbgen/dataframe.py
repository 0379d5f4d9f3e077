"""generate_df: a DataFrame of prompts in, the same DataFrame plus generation columns out.

Three phases: ``_validate`` (the call's arguments; nothing runs when one is wrong), ``_plan`` (the
checkpoint's rows loaded, the rows that still need the engine picked, rows with bad prompts or
params failed) and ``_run`` (windows of rows through ``Engine.generate_iter``, results recorded and
the progress bar advanced as each row finishes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from nbgen.core.interrupt import GenerationInterrupted
from nbgen.dataframe_io import Checkpoint
from nbgen.dataframe_rows import (
    RowError,
    error_record,
    is_messages,
    jsonable,
    output_columns,
    output_record,
    resolve_param_columns,
    row_key,
    row_params,
    row_prompt,
    template_mode,
)
from nbgen.dataframe_window import PendingRow, run_window
from nbgen.engine import default_engine
from nbgen.notebook.progress_bar import DONE, FAILED, STOPPED, RowProgress

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


def generate_df(
    df: "pd.DataFrame",
    prompt_column: str = "prompt",
    engine: Any = None,
    sampling_params: Optional[Mapping[str, Any]] = None,
    *,
    param_columns: Union[None, Sequence[str], Mapping[str, str]] = None,
    chat: Union[str, bool] = "auto",
    system_prompt: Optional[str] = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    checkpoint: Optional[str] = None,
    on_error: str = "skip",
    batch_size: int = 1024,
    progress: bool = True,
    prefix: str = "",
) -> "pd.DataFrame":
    """Generate one completion per row; return a copy of ``df`` with the output columns added.

    The input's index, row order and columns are kept. Added: ``text``, ``finish_reason``,
    ``prompt_tokens``, ``completion_tokens``, ``error`` (plus ``output_token_logprobs`` /
    ``output_top_logprobs`` with ``return_logprob``), each name prefixed by ``prefix``.
    A row that cannot run (missing or non-text prompt, invalid parameters, a failed request) gets
    a message in ``error`` and the others complete; ``on_error="raise"`` stops at the first one.
    ``param_columns`` names columns holding per-row sampling params (a list of names, or a dict
    column -> param name; a ``sampling_params`` column holds dicts). Chat: ``chat="auto"`` sends text
    cells through the chat template when the model has one (``True``: always, ``False``: raw text);
    cells that are message lists always go through it. ``checkpoint="run.parquet"`` (or ``.jsonl``)
    saves rows as they finish; calling again with the same arguments skips finished rows (failed
    rows are retried); the Stop button raises GenerationInterrupted (a KeyboardInterrupt) saying
    how many were kept. ``out.attrs["nbgen"]``: chat, rows, errors, restored, checkpoint.
    """
    import pandas as pd

    spec = _validate(df, prompt_column, sampling_params, param_columns, chat, system_prompt,
                     return_logprob, top_logprobs_num, on_error, batch_size, prefix)
    # "auto" asks the engine whether it has a chat template; the answer is part of each row's key
    eng = default_engine() if engine is None and not isinstance(chat, bool) else engine
    spec.template = template_mode(chat, system_prompt, _has_template(eng))
    results = _Results(spec, Checkpoint(checkpoint) if checkpoint is not None else None)
    plan = _plan(spec, results)
    if plan.todo and eng is None:
        eng = default_engine()
        template_mode(chat, system_prompt, _has_template(eng))  # chat=True on a model without one
    _run(spec, results, plan, eng, batch_size, progress)
    info = {"chat": spec.template, "rows": len(spec.prompts), "errors": results.errors(),
            "restored": plan.restored, "checkpoint": results.ckpt.path if results.ckpt else None}
    out_df = df.copy()
    for c in spec.cols:
        vals = results.values.pop(c)
        if c in ("prompt_tokens", "completion_tokens"):
            out_df[prefix + c] = pd.array(vals, dtype="Int64")
        else:
            out_df[prefix + c] = pd.Series(vals, index=df.index, dtype=object)
    out_df.attrs = {**df.attrs, "nbgen": info}
    return out_df


def _has_template(eng: Any) -> Optional[bool]:
    """The engine's ``has_chat_template`` (None before an engine is chosen)."""
    return None if eng is None else bool(getattr(eng, "has_chat_template", False))


@dataclass
class _Spec:
    """A validated generate_df call: what every row shares, and the rows' raw cells."""

    base: dict[str, Any]                  # call-wide sampling params
    mapping: dict[str, str]               # param column -> sampling-param name
    cols: list[str]                       # output columns (unprefixed)
    options: dict[str, Any]               # what else a row's result depends on (its checkpoint key)
    prompts: list[Any]                    # the prompt cells
    row_values: dict[str, list[Any]]      # param column -> cells
    labels: Any                           # df.index, for error messages
    on_error: str
    system_prompt: Optional[str]
    gen_kw: dict[str, Any]                # generate() arguments shared by every window
    template: bool = False                # text cells go through the chat template

    def params_and_key(self, pos: int) -> tuple[dict[str, Any], str]:
        """Row ``pos``'s sampling params and checkpoint key (RowError for bad params); the key covers
        whether the chat template is applied, so raw and templated results never mix."""
        params = row_params(self.base, {c: v[pos] for c, v in self.row_values.items()}, self.mapping)
        cell = self.prompts[pos]
        templated = self.template or self.system_prompt is not None or is_messages(cell)
        return params, row_key(jsonable(cell), params, {**self.options, "chat": templated})

    def prompt(self, pos: int) -> Any:
        """Row ``pos``'s prompt: text, or messages for the chat template (RowError for bad cells)."""
        return row_prompt(self.prompts[pos], self.template, self.system_prompt)


def _validate(df: Any, prompt_column: str, sampling_params: Optional[Mapping[str, Any]],
              param_columns: Any, chat: Union[str, bool], system_prompt: Optional[str], return_logprob: bool,
              top_logprobs_num: int, on_error: str, batch_size: int, prefix: str) -> _Spec:
    """Check the call's arguments (nothing runs when one is wrong) and gather what the rows share."""
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame, got {type(df).__name__}")
    if prompt_column not in df.columns:
        raise KeyError(f"prompt column {prompt_column!r} is not in the DataFrame (columns: {list(df.columns)})")
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    template_mode(chat, None, True)  # chat is "auto", True or False
    base = dict(sampling_params or {})
    row_params(base, {}, {})  # invalid call-wide params fail the whole call, before anything runs
    mapping = resolve_param_columns(list(df.columns), param_columns)
    cols = output_columns(return_logprob, top_logprobs_num)
    clash = [prefix + c for c in cols if prefix + c in df.columns]
    if clash:
        raise ValueError(f"output columns {clash} already exist in df; pass prefix='gen_' (for example)")
    gen_kw: dict[str, Any] = {"return_logprob": return_logprob}
    if top_logprobs_num:
        gen_kw["top_logprobs_num"] = top_logprobs_num
    return _Spec(base=base, mapping=mapping, cols=cols,
                 options={"return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                          "system_prompt": system_prompt},
                 prompts=df[prompt_column].tolist(), row_values={c: df[c].tolist() for c in mapping},
                 labels=df.index, on_error=on_error, system_prompt=system_prompt, gen_kw=gen_kw)


class _Results:
    """Output column values per row, the key of each row's saved result, and the checkpoint."""

    def __init__(self, spec: _Spec, ckpt: Optional[Checkpoint]) -> None:
        n = len(spec.prompts)
        self.spec, self.ckpt = spec, ckpt
        self.values: dict[str, list[Any]] = {c: [None] * n for c in spec.cols}
        self.keys: list[Optional[str]] = [None] * n  # key of the saved (finished, error-free) result
        self.progress: Optional[RowProgress] = None  # told of every row that settles while running

    def load(self) -> None:
        """Fill in the rows a checkpoint already holds."""
        if self.ckpt is None:
            return
        n = len(self.keys)
        for rec in self.ckpt.load():
            pos = int(rec["_row"])
            if 0 <= pos < n:
                for c in self.spec.cols:
                    self.values[c][pos] = rec.get(c)
                self.keys[pos] = rec["_key"] if not rec.get("error") else None

    def fail(self, pos: int, msg: str, key: Optional[str], exc: Optional[BaseException] = None) -> None:
        """Row ``pos`` gets ``msg`` as its error (or, with on_error="raise", the call raises)."""
        if self.spec.on_error == "raise":
            label = self.spec.labels[pos]
            label = label.item() if hasattr(label, "item") else label  # np.int64(3) -> 3
            raise ValueError(f"row {label!r} (position {pos}): {msg}") from exc
        rec = error_record(msg)
        for c in self.spec.cols:
            self.values[c][pos] = rec.get(c)
        self.keys[pos] = None
        if self.ckpt is not None and key is not None:
            self.ckpt.append({"_row": pos, "_key": key, **rec})
        if self.progress is not None:
            self.progress.settle(error=True)

    def finish(self, row: PendingRow, out: Any) -> None:
        """A window's result for ``row``: an output dict (or n of them), or the exception it raised."""
        if isinstance(out, BaseException):
            self.fail(row.pos, f"request rejected: {out}", row.key, out)
            return
        rec = output_record(out, self.spec.cols)
        if rec["error"]:
            self.fail(row.pos, rec["error"], row.key)
        else:
            for c in self.spec.cols:
                self.values[c][row.pos] = rec.get(c)
            self.keys[row.pos] = row.key
            if self.ckpt is not None:
                self.ckpt.append({"_row": row.pos, "_key": row.key, **rec})
            if self.progress is not None:
                self.progress.settle(error=False, out_tokens=rec["completion_tokens"] or 0)

    def done(self) -> int:
        """Rows with a result (restored or finished in this call)."""
        return sum(k is not None for k in self.keys)

    def errors(self) -> int:
        """Rows whose ``error`` is set."""
        return sum(e is not None for e in self.values["error"])


@dataclass
class _Plan:
    """The rows that still need the engine, and how the others settled before any ran."""

    todo: list[int]
    restored: int  # taken from the checkpoint
    failed: int    # bad params or prompt


def _plan(spec: _Spec, results: _Results) -> _Plan:
    """Pick the rows not in the checkpoint with the same key; bad params or prompts fail here."""
    results.load()
    plan = _Plan(todo=[], restored=0, failed=0)
    for pos in range(len(spec.prompts)):
        key = None
        try:
            _, key = spec.params_and_key(pos)
            if results.keys[pos] == key:
                plan.restored += 1
                continue
            spec.prompt(pos)
        except RowError as e:
            results.fail(pos, str(e), key, e)
            plan.failed += 1
            continue
        plan.todo.append(pos)
    return plan


def _run(spec: _Spec, results: _Results, plan: _Plan, eng: Any, batch_size: int, progress: bool) -> None:
    """Send the rows in windows of ``batch_size`` through the engine, recording results as they
    finish; a KeyboardInterrupt becomes GenerationInterrupted once the finished rows are saved."""
    n = len(spec.prompts)
    mode = "chat template" if spec.template else "raw text"
    bar = RowProgress(n, f"generate_df ({mode})", presettled=n - len(plan.todo), errors=plan.failed,
                      restored=plan.restored, enabled=progress)
    results.progress = bar
    outcome = FAILED
    try:
        bar.start()
        for start in range(0, len(plan.todo), batch_size):
            batch = _window(spec, results, plan.todo[start:start + batch_size], eng)
            for row, out in run_window(eng, batch, spec.gen_kw) if batch else ():
                results.finish(row, out)
            del batch
        outcome = DONE
    except KeyboardInterrupt:
        outcome = STOPPED
    finally:
        bar.close(outcome)
        results.progress = None
        if results.ckpt is not None:
            results.ckpt.close()
    if outcome == STOPPED:
        raise _interrupted(results, n) from None


def _interrupted(results: _Results, total: int) -> GenerationInterrupted:
    done, path = results.done(), results.ckpt.path if results.ckpt is not None else None
    msg = (f"interrupted: {done}/{total} rows saved to {path}; run the cell again to resume" if path else
           f"interrupted: {done}/{total} rows done; pass checkpoint= to keep finished rows across interrupts")
    return GenerationInterrupted(msg, done=done, total=total, checkpoint=path)


def _window(spec: _Spec, results: _Results, positions: list[int], eng: Any) -> list[PendingRow]:
    """The window's rows with their prompt text (chat-templated where needed); failures recorded."""
    batch: list[PendingRow] = []
    for pos in positions:
        params, key = spec.params_and_key(pos)
        p = spec.prompt(pos)  # checked by _plan
        try:
            text = p if isinstance(p, str) else eng.apply_chat_template(p)
        except Exception as e:  # a template that rejects these messages
            results.fail(pos, f"chat template failed: {e}", key, e)
            continue
        batch.append(PendingRow(pos, text, params, key))
    return batch
