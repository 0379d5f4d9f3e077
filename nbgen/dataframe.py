"""generate_df: a DataFrame of prompts in, the same DataFrame plus generation columns out.

Three phases: ``_validate`` (the call's arguments; nothing runs when one is wrong), ``_plan`` (the
checkpoint's rows loaded, the rows that still need the engine picked, rows with bad params failed)
and ``_run`` (windows of rows through ``Engine.generate_iter``, results recorded as they finish).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence, Union

from nbgen.dataframe_io import Checkpoint
from nbgen.engine import default_engine
from nbgen.dataframe_rows import (
    RowError,
    error_record,
    jsonable,
    output_columns,
    output_record,
    resolve_param_columns,
    row_key,
    row_params,
    row_prompt,
    tok_s_postfix,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

class _Pending:
    """One row on its way to the engine."""

    __slots__ = ("pos", "prompt", "params", "key")

    def __init__(self, pos: int, prompt: str, params: dict[str, Any], key: str) -> None:
        self.pos, self.prompt, self.params, self.key = pos, prompt, params, key


def _run_window(engine: Any, batch: list[_Pending], kw: dict[str, Any]) -> Iterator[tuple[_Pending, Any]]:
    """Yield (row, output-or-exception) as requests finish (completion order).

    The engine validates a whole call before running any of it, so one row the engine rejects
    (say, a prompt longer than the context) would sink its window: such a window is split in
    halves until the bad rows stand alone, and only those get the error.
    """
    it = None
    try:
        it = engine.generate_iter(prompt=[p.prompt for p in batch],
                                  sampling_params=[p.params for p in batch], **kw)
        first = next(it, None)
    except (ValueError, TypeError) as e:
        if it is not None:
            it.close()
        if len(batch) == 1:
            yield batch[0], e
            return
        mid = len(batch) // 2
        yield from _run_window(engine, batch[:mid], kw)
        yield from _run_window(engine, batch[mid:], kw)
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


def generate_df(
    df: "pd.DataFrame",
    prompt_column: str = "prompt",
    engine: Any = None,
    sampling_params: Optional[Mapping[str, Any]] = None,
    *,
    param_columns: Union[None, Sequence[str], Mapping[str, str]] = None,
    chat: Optional[bool] = None,
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
    column -> param name; a ``sampling_params`` column holds dicts). Chat: cells that are message
    lists, or ``chat=True`` / ``system_prompt=...`` for text cells, go through the chat template.
    ``checkpoint="run.parquet"`` (or ``.jsonl``) saves rows as they finish; calling again with the
    same arguments skips finished rows (failed rows are retried). See docs/dataframe.md.
    """
    import pandas as pd

    spec = _validate(df, prompt_column, sampling_params, param_columns, chat, system_prompt,
                     return_logprob, top_logprobs_num, on_error, batch_size, prefix)
    results = _Results(spec, Checkpoint(checkpoint) if checkpoint is not None else None)
    todo = _plan(spec, results)
    _run(spec, results, todo, engine, batch_size, progress)
    out_df = df.copy()
    for c in spec.cols:
        vals = results.values.pop(c)
        if c in ("prompt_tokens", "completion_tokens"):
            out_df[prefix + c] = pd.array(vals, dtype="Int64")
        else:
            out_df[prefix + c] = pd.Series(vals, index=df.index, dtype=object)
    return out_df


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
    chat: Optional[bool]
    system_prompt: Optional[str]
    gen_kw: dict[str, Any]                # generate() arguments shared by every window

    def params_and_key(self, pos: int) -> tuple[dict[str, Any], str]:
        """Row ``pos``'s sampling params and its checkpoint key (RowError for bad params)."""
        params = row_params(self.base, {c: v[pos] for c, v in self.row_values.items()}, self.mapping)
        return params, row_key(jsonable(self.prompts[pos]), params, self.options)


def _validate(df: Any, prompt_column: str, sampling_params: Optional[Mapping[str, Any]],
              param_columns: Any, chat: Optional[bool], system_prompt: Optional[str], return_logprob: bool,
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
                          "chat": chat, "system_prompt": system_prompt},
                 prompts=df[prompt_column].tolist(), row_values={c: df[c].tolist() for c in mapping},
                 labels=df.index, on_error=on_error, chat=chat, system_prompt=system_prompt, gen_kw=gen_kw)


class _Results:
    """Output column values per row, the key of each row's saved result, and the checkpoint."""

    def __init__(self, spec: _Spec, ckpt: Optional[Checkpoint]) -> None:
        n = len(spec.prompts)
        self.spec, self.ckpt = spec, ckpt
        self.values: dict[str, list[Any]] = {c: [None] * n for c in spec.cols}
        self.keys: list[Optional[str]] = [None] * n  # key of the saved (finished, error-free) result
        self.out_tokens = 0

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

    def finish(self, row: _Pending, out: Any) -> None:
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
        self.out_tokens += rec["completion_tokens"] or 0


def _plan(spec: _Spec, results: _Results) -> list[int]:
    """The rows that still need the engine: not in the checkpoint with the same key (cheap: no
    templating); rows whose params are invalid fail here."""
    results.load()
    todo: list[int] = []
    for pos in range(len(spec.prompts)):
        try:
            _, key = spec.params_and_key(pos)
        except RowError as e:
            results.fail(pos, str(e), None, e)
            continue
        if results.keys[pos] != key:
            todo.append(pos)
    return todo


def _run(spec: _Spec, results: _Results, todo: list[int], engine: Any, batch_size: int, progress: bool) -> None:
    """Send the rows in windows of ``batch_size`` through the engine, recording results as they finish."""
    eng = engine if engine is not None else (default_engine() if todo else None)
    bar = _progress(len(todo), len(spec.prompts) - len(todo), progress)
    t0 = time.perf_counter()
    try:
        for start in range(0, len(todo), batch_size):
            batch = _window(spec, results, todo[start:start + batch_size], eng)
            for row, out in _run_window(eng, batch, spec.gen_kw) if batch else ():
                results.finish(row, out)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(tok_s_postfix(results.out_tokens, time.perf_counter() - t0), refresh=False)
            del batch
    finally:
        if bar is not None:
            bar.close()
        if results.ckpt is not None:
            results.ckpt.close()


def _window(spec: _Spec, results: _Results, positions: list[int], eng: Any) -> list[_Pending]:
    """The window's rows with their prompt text (chat-templated where needed); failures recorded."""
    batch: list[_Pending] = []
    for pos in positions:
        params, key = spec.params_and_key(pos)
        try:
            p = row_prompt(spec.prompts[pos], spec.chat, spec.system_prompt)
            text = p if isinstance(p, str) else eng.apply_chat_template(p)
        except RowError as e:
            results.fail(pos, str(e), key, e)
            continue
        except Exception as e:  # a template that rejects these messages
            results.fail(pos, f"chat template failed: {e}", key, e)
            continue
        batch.append(_Pending(pos, text, params, key))
    return batch


def _progress(total: int, done: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="row", desc="generate_df" + (f" ({done} rows from checkpoint)" if done else ""))
