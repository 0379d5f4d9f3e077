"""generate_df: a DataFrame of prompts in, the same DataFrame plus generation columns out."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence, Union

from nbgen.dataframe_io import Checkpoint
from nbgen.engine import default_engine
from nbgen.dataframe_rows import (
    RowError,
    error_record,
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

    n = len(df)
    results: dict[str, list[Any]] = {c: [None] * n for c in cols}
    keys: list[Optional[str]] = [None] * n  # key of the saved (finished, error-free) result per row
    ckpt = Checkpoint(checkpoint) if checkpoint is not None else None
    if ckpt is not None:
        for rec in ckpt.load():
            pos = int(rec["_row"])
            if 0 <= pos < n:
                for c in cols:
                    results[c][pos] = rec.get(c)
                keys[pos] = rec["_key"] if not rec.get("error") else None

    options = {"return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
               "chat": chat, "system_prompt": system_prompt}
    prompts = df[prompt_column].tolist()
    row_values = {c: df[c].tolist() for c in mapping}
    labels = df.index

    def fail(pos: int, msg: str, key: Optional[str], exc: Optional[BaseException] = None) -> None:
        if on_error == "raise":
            label = labels[pos]
            label = label.item() if hasattr(label, "item") else label  # np.int64(3) -> 3
            raise ValueError(f"row {label!r} (position {pos}): {msg}") from exc
        rec = error_record(msg)
        for c in cols:
            results[c][pos] = rec.get(c)
        keys[pos] = None
        if ckpt is not None and key is not None:
            ckpt.append({"_row": pos, "_key": key, **rec})

    # first pass (cheap, no templating): which rows still need the engine
    todo: list[int] = []
    for pos in range(n):
        try:
            params = row_params(base, {c: v[pos] for c, v in row_values.items()}, mapping)
            key = row_key(_jsonable(prompts[pos]), params, options)
        except RowError as e:
            fail(pos, str(e), None, e)
            continue
        if keys[pos] != key:
            todo.append(pos)

    eng = engine if engine is not None else (default_engine() if todo else None)
    gen_kw: dict[str, Any] = {"return_logprob": return_logprob}
    if top_logprobs_num:
        gen_kw["top_logprobs_num"] = top_logprobs_num
    bar = _progress(len(todo), n - len(todo), progress)
    t0, out_tokens = time.perf_counter(), 0
    try:
        for start in range(0, len(todo), batch_size):
            batch: list[_Pending] = []
            for pos in todo[start:start + batch_size]:
                params = row_params(base, {c: v[pos] for c, v in row_values.items()}, mapping)
                key = row_key(_jsonable(prompts[pos]), params, options)
                try:
                    p = row_prompt(prompts[pos], chat, system_prompt)
                    text = p if isinstance(p, str) else eng.apply_chat_template(p)
                except RowError as e:
                    fail(pos, str(e), key, e)
                    continue
                except Exception as e:  # a template that rejects these messages
                    fail(pos, f"chat template failed: {e}", key, e)
                    continue
                batch.append(_Pending(pos, text, params, key))
            for row, out in _run_window(eng, batch, gen_kw) if batch else ():
                if isinstance(out, BaseException):
                    fail(row.pos, f"request rejected: {out}", row.key, out)
                else:
                    rec = output_record(out, cols)
                    if rec["error"]:
                        fail(row.pos, rec["error"], row.key)
                    else:
                        for c in cols:
                            results[c][row.pos] = rec.get(c)
                        keys[row.pos] = row.key
                        if ckpt is not None:
                            ckpt.append({"_row": row.pos, "_key": row.key, **rec})
                    out_tokens += rec["completion_tokens"] or 0
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(tok_s_postfix(out_tokens, time.perf_counter() - t0), refresh=False)
            del batch
    finally:
        if bar is not None:
            bar.close()
        if ckpt is not None:
            ckpt.close()

    out_df = df.copy()
    for c in cols:
        vals = results.pop(c)
        if c in ("prompt_tokens", "completion_tokens"):
            out_df[prefix + c] = pd.array(vals, dtype="Int64")
        else:
            out_df[prefix + c] = pd.Series(vals, index=df.index, dtype=object)
    return out_df


def _jsonable(v: Any) -> Any:
    """A prompt cell as a stable JSON value (numpy arrays of messages -> lists)."""
    return v.tolist() if hasattr(v, "tolist") and not isinstance(v, str) else v


def _progress(total: int, done: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="row", desc="generate_df" + (f" ({done} rows from checkpoint)" if done else ""))
