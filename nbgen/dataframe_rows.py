"""Pure row logic for generate_df: rows -> (prompt, params, key), outputs -> column values.

Nothing here touches an engine, so every rule (missing prompts, per-row parameter columns, chat
messages, n>1 and logprob columns) is unit-tested on plain Python values.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from typing import Any, Mapping, Optional, Sequence, Union

from nbgen.core.sampling import SamplingParams

BASE_COLUMNS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "error")
LOGPROB_COLUMNS = ("output_token_logprobs", "output_top_logprobs")
PARAM_NAMES = tuple(f.name for f in fields(SamplingParams) if f.init)
_INT_PARAMS = {"max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed"}
# generate() keywords a param column may feed besides the sampling params (a LoRA adapter per row)
GENERATE_KWARGS = ("lora_path",)

Messages = list[dict[str, Any]]
Prompt = Union[str, Messages]


class RowError(ValueError):
    """A row that cannot be sent: its message goes into the ``error`` column."""


class ColumnError(ValueError, KeyError):
    """A column argument that names no single column of the DataFrame (a ValueError, and a
    KeyError as pandas raises for a missing column)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def require_column(df: Any, column: Any, param: str) -> None:
    """ColumnError naming ``param`` unless ``column`` is exactly one column of ``df``."""
    names = list(df.columns)
    shown = f"{names[:20]}" if len(names) <= 20 else f"{names[:20]} (and {len(names) - 20} more)"
    try:
        found = column in df.columns
    except TypeError:  # an unhashable value, e.g. a list of names
        found = False
    if not found:
        raise ColumnError(f"{param}={column!r:.80} is not a column of the DataFrame (columns: {shown})")
    if getattr(df[column], "ndim", 1) != 1:
        raise ColumnError(f"{param}={column!r} names {df[column].shape[1]} columns of the DataFrame "
                          "(duplicate labels, or a level of MultiIndex columns); pass a label of one column")


def is_missing(v: Any) -> bool:
    """None, NaN, pd.NA and NaT count as missing."""
    if v is None:
        return True
    try:
        return bool(v != v)  # NaN, NaT and pd.NA are not equal to themselves
    except (TypeError, ValueError):  # pd.NA raises on bool(); arrays are ambiguous
        return v.__class__.__name__ in ("NAType", "NaTType")


def column_key(columns: Any, name: str) -> Any:
    """The key of a new output column ``name``: the name itself, or ``(name, "", ...)`` under
    MultiIndex columns (pandas wants a full-length tuple there)."""
    levels = getattr(columns, "nlevels", 1)
    return name if levels == 1 else (name,) + ("",) * (levels - 1)


def resolve_param_columns(df: Any,
                          param_columns: Union[None, Sequence[str], Mapping[str, str]]) -> dict[str, str]:
    """``param_columns`` (each naming one column of ``df``) -> {column: sampling param}; a
    ``sampling_params`` param takes dicts, a ``lora_path`` param adapter names (generate()'s keyword: a
    LoRA adapter per row)."""
    if param_columns is None:
        return {}
    if isinstance(param_columns, str):  # one column, named like its param
        param_columns = [param_columns]
    mapping = dict(param_columns) if isinstance(param_columns, Mapping) else {c: c for c in param_columns}
    for col, name in mapping.items():
        require_column(df, col, "param_columns")
        if name != "sampling_params" and name not in PARAM_NAMES and name not in GENERATE_KWARGS:
            raise ValueError(f"param column {col!r} maps to unknown sampling param {name!r}")
    return mapping


def _plain(name: str, v: Any) -> Any:
    """numpy / pandas scalars -> Python values SamplingParams accepts (16.0 -> 16 for ints)."""
    if hasattr(v, "tolist") and not isinstance(v, (list, dict, str)):
        v = v.tolist()  # numpy scalar or array -> Python
    if name in _INT_PARAMS and isinstance(v, float) and v.is_integer():
        v = int(v)  # an int column with NaN holes becomes float in pandas
    return v


def row_params(base: Mapping[str, Any], values: Mapping[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
    """Merge the call's sampling_params with this row's columns (a missing cell keeps the default)."""
    params = dict(base)
    for col, name in mapping.items():
        v = values[col]
        if name == "sampling_params":
            if not isinstance(v, dict) and is_missing(v):
                continue
            if not isinstance(v, dict):
                raise RowError(f"column {col!r} must hold dicts of sampling params, got {type(v).__name__}")
            params.update({k: _plain(k, x) for k, x in v.items()})
        elif isinstance(v, (list, tuple, dict)) or not is_missing(v):
            if name == "lora_path" and not isinstance(v, str):
                raise RowError(f"column {col!r} must hold LoRA adapter names (str), got {v!r:.60}")
            params[name] = _plain(name, v)
    try:
        SamplingParams.from_dict(split_generate_kwargs(params)[0])  # validates; the engine gets the dict
    except (ValueError, TypeError) as e:
        raise RowError(f"invalid sampling params: {e}") from None
    return params


def split_generate_kwargs(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A row's params -> (sampling params, generate() keywords such as ``lora_path``)."""
    sp = {k: v for k, v in params.items() if k not in GENERATE_KWARGS}
    return sp, {k: v for k, v in params.items() if k in GENERATE_KWARGS}


def is_messages(value: Any) -> bool:
    """A cell holding a conversation (a list, tuple or array of messages) rather than text."""
    return isinstance(value, (list, tuple)) or hasattr(value, "tolist") and not isinstance(value, str)


def row_prompt(value: Any, template: bool, system_prompt: Optional[str]) -> Prompt:
    """A cell -> a prompt string or a chat message list (validated).

    Message lists are always conversations; a text cell becomes one (a user message, after
    ``system_prompt`` if given) when ``template`` is true or a system prompt is given.
    """
    if is_messages(value):
        if hasattr(value, "tolist"):
            value = value.tolist()
        msgs = list(value)
        if not msgs or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise RowError("a chat prompt must be a non-empty list of {'role', 'content'} dicts")
        if system_prompt is not None and msgs[0].get("role") != "system":
            msgs = [{"role": "system", "content": system_prompt}] + msgs
        return msgs
    if is_missing(value):
        raise RowError("missing prompt")
    if not isinstance(value, str):
        raise RowError(f"prompt must be text (or a list of chat messages), got {type(value).__name__}: {value!r:.60}")
    if not value:
        raise RowError("empty prompt")
    if template or system_prompt is not None:
        msgs = [{"role": "user", "content": value}]
        if system_prompt is not None:
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs
    return value


def row_text(value: Any) -> str:
    """A text cell for embed_df / score_df (RowError for missing, non-text or empty cells)."""
    if not isinstance(value, str) and is_missing(value):
        raise RowError("missing text")
    if not isinstance(value, str):
        raise RowError(f"the cell must be text, got {type(value).__name__}: {value!r:.60}")
    if not value:
        raise RowError("empty text")
    return value


def abort_message(out: Mapping[str, Any]) -> Optional[str]:
    """The abort message of an engine output (None when it finished normally)."""
    fr = out.get("meta_info", {}).get("finish_reason") or {}
    if isinstance(fr, dict) and fr.get("type") == "abort":
        return str(fr.get("message") or "request aborted")
    return None


def template_mode(chat: Any, system_prompt: Optional[str], has_template: Optional[bool]) -> bool:
    """Whether text cells go through the chat template: ``chat`` is "auto", True or False;
    ``has_template`` is the engine's answer (None: not known yet, for chat=True/False only)."""
    auto = isinstance(chat, str) and chat == "auto"
    if not auto and not isinstance(chat, bool):
        raise ValueError(f"chat must be 'auto', True or False, got {chat!r}")
    if chat is True and has_template is False:
        raise ValueError("chat=True needs a chat template and this model's tokenizer has none; "
                         "pass chat=False (or chat='auto') to send text cells as raw completions")
    template = bool(has_template) if auto else chat
    if system_prompt is not None and not template:
        why = "chat=False sends text cells raw" if chat is False else "this model's tokenizer has none"
        raise ValueError(f"system_prompt needs the chat template, but {why}")
    return template


def row_key(prompt_value: Any, params: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    """Fingerprint of what a row asks for: a checkpointed row is reused only if it matches."""
    blob = json.dumps([prompt_value, dict(params), dict(options)], sort_keys=True, default=str)
    return hashlib.sha1(blob.encode("utf-8")).hexdigest()[:16]


def output_columns(return_logprob: bool, top_logprobs_num: int) -> tuple[str, ...]:
    """The columns generate_df adds, in order."""
    cols = list(BASE_COLUMNS)
    if return_logprob:
        cols.append("output_token_logprobs")
        if top_logprobs_num:
            cols.append("output_top_logprobs")
    return tuple(cols)


def _one(out: Mapping[str, Any]) -> tuple[str, str, int, int, Optional[str]]:
    meta = out.get("meta_info", {})
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    err = None
    if kind == "abort":
        err = str(fr.get("message") or "request aborted") if isinstance(fr, dict) else "request aborted"
    return out.get("text", ""), kind, int(meta.get("prompt_tokens", 0)), int(meta.get("completion_tokens", 0)), err


def output_record(out: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]], cols: Sequence[str]) -> dict[str, Any]:
    """An engine output (or the n outputs of an ``n>1`` row) -> this row's column values.

    With n>1, ``text`` and ``finish_reason`` are lists of n values, ``completion_tokens`` is the sum.
    """
    outs = [out] if isinstance(out, Mapping) else list(out)
    parts = [_one(o) for o in outs]
    errors = [p[4] for p in parts if p[4]]
    rec: dict[str, Any] = {
        "text": parts[0][0] if len(parts) == 1 else [p[0] for p in parts],
        "finish_reason": parts[0][1] if len(parts) == 1 else [p[1] for p in parts],
        "prompt_tokens": parts[0][2],
        "completion_tokens": sum(p[3] for p in parts),
        "error": "; ".join(errors) if errors else None,
    }
    for c in cols:
        if c in LOGPROB_COLUMNS:
            vals = [o.get("meta_info", {}).get(c) for o in outs]
            rec[c] = vals[0] if len(vals) == 1 else vals
    return rec


def restore_record(rec: dict[str, Any]) -> dict[str, Any]:
    """A checkpointed record with its logprob entries as tuples again, as ``output_record`` gives them
    (JSON stores ``(logprob, token_id, text)`` as a list)."""
    return {c: (_entry_tuples(v) if c in LOGPROB_COLUMNS else v) for c, v in rec.items()}


def _entry_tuples(v: Any) -> Any:
    if isinstance(v, list):
        if len(v) == 3 and isinstance(v[0], (int, float)) and not isinstance(v[0], bool) and isinstance(v[1], int):
            return tuple(v)
        return [_entry_tuples(x) for x in v]
    return v


def error_record(message: str) -> dict[str, Any]:
    """Column values of a row that did not run."""
    return {"text": None, "finish_reason": None, "prompt_tokens": None, "completion_tokens": None,
            "error": message}


def jsonable(v: Any) -> Any:
    """A prompt cell as a stable JSON value (numpy arrays of messages -> lists)."""
    return v.tolist() if hasattr(v, "tolist") and not isinstance(v, str) else v
