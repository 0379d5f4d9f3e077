"""generate_df: a DataFrame of prompts in, the same DataFrame plus generation columns out.

``_validate`` checks the call's arguments (nothing runs when one is wrong) and builds a ``_Spec``,
the ``RowJob`` of generate_df: each row's sampling params, prompt (chat-templated where asked) and
checkpoint key, sent through ``Engine.generate_iter``. ``dataframe_job.run_job`` does the rest
(checkpoint, plan, windows, progress bar, interrupt), as for embed_df and score_df.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence, Union

from nbgen.dataframe_images import image_cell, image_fingerprint, with_image_part
from nbgen.dataframe_job import JobResult, check_call, check_new_columns, run_job
from nbgen.dataframe_rows import (
    RowError,
    column_key,
    is_messages,
    jsonable,
    output_columns,
    output_record,
    require_column,
    restore_record,
    resolve_param_columns,
    row_key,
    row_params,
    row_prompt,
    split_generate_kwargs,
    template_mode,
)
from nbgen.dataframe_window import PendingRow
from nbgen.engine import default_engine

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
    image_column: Optional[str] = None,
) -> "pd.DataFrame":
    """Generate one completion per row; return a copy of ``df`` with the output columns added.

    The input's index, row order and columns are kept. Added: ``text``, ``finish_reason``,
    ``prompt_tokens``, ``completion_tokens``, ``error`` (plus ``output_token_logprobs`` /
    ``output_top_logprobs`` with ``return_logprob``), each name prefixed by ``prefix``.
    A row that cannot run (missing or non-text prompt, invalid parameters, a failed request) gets
    a message in ``error`` and the others complete; ``on_error="raise"`` stops at the first one.
    ``param_columns`` names columns holding per-row sampling params (a list of names, or a dict
    column -> param name; a ``sampling_params`` column holds dicts; a column mapped to ``lora_path``
    holds LoRA adapter names, one per row, empty cells run the base model). Chat: ``chat="auto"`` sends text
    cells through the chat template when the model has one (``True``: always, ``False``: raw text);
    cells that are message lists always go through it. ``checkpoint="run.parquet"`` (or ``.jsonl``)
    saves rows as they finish; calling again with the same arguments skips finished rows (failed
    rows are retried); the Stop button raises GenerationInterrupted (a KeyboardInterrupt) saying
    how many were kept. ``out.attrs["nbgen"]``: chat, rows, errors, restored, checkpoint.
    ``image_column`` (vision-language models): a column of images (paths, PIL images or bytes; empty
    cells run text-only); each image goes before its row's text in the user turn.
    ``nbgen.show_images(out)`` shows the result with thumbnails.
    """
    import pandas as pd

    spec = _validate(df, prompt_column, sampling_params, param_columns, chat, system_prompt,
                     return_logprob, top_logprobs_num, on_error, batch_size, prefix, image_column)
    # "auto" asks the engine whether it has a chat template; the answer is part of each row's key
    eng = default_engine() if engine is None and not isinstance(chat, bool) else engine
    if eng is not None and _embeds(eng):
        raise ValueError("generate_df needs a generative engine; this one was created with is_embedding=True "
                         "(embed_df embeds a column)")
    spec.template = template_mode(chat, system_prompt, _has_template(eng))
    spec.desc = f"generate_df ({'chat template' if spec.template else 'raw text'})"

    def the_engine() -> Any:
        e = eng if eng is not None else default_engine()
        template_mode(chat, system_prompt, _has_template(e))  # chat=True on a model without one
        return e

    def frame(res: JobResult) -> "pd.DataFrame":
        out_df = df.copy()
        for c in spec.cols:
            vals = res.values.pop(c)
            if c in ("prompt_tokens", "completion_tokens"):
                out_df[column_key(out_df.columns, prefix + c)] = pd.array(vals, dtype="Int64")
            else:
                out_df[column_key(out_df.columns, prefix + c)] = pd.Series(vals, index=df.index, dtype=object)
        out_df.attrs = {**df.attrs, "nbgen": {"chat": spec.template, **res.attrs()}}
        return out_df

    return run_job(spec, checkpoint, the_engine, batch_size, progress, frame)


def _embeds(eng: Any) -> bool:
    """Whether ``eng`` was created with ``is_embedding=True`` (it cannot generate)."""
    info = getattr(eng, "get_model_info", None)
    return info is not None and info().get("is_generation") is False


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
    images: Optional[list[Any]] = None    # image_column's cells
    desc: str = "generate_df"             # the progress bar's title

    def __len__(self) -> int:
        return len(self.prompts)

    def params_and_key(self, pos: int) -> tuple[dict[str, Any], str]:
        """Row ``pos``'s sampling params and checkpoint key (RowError for bad params); the key covers
        whether the chat template is applied, so raw and templated results never mix."""
        params = row_params(self.base, {c: v[pos] for c, v in self.row_values.items()}, self.mapping)
        cell = self.prompts[pos]
        templated = self.template or self.system_prompt is not None or is_messages(cell)
        options = {**self.options, "chat": templated}
        if self.images is not None:
            options["image"] = image_fingerprint(image_cell(self.images[pos]))
        return params, row_key(jsonable(cell), params, options)

    def prompt(self, pos: int) -> Any:
        """Row ``pos``'s prompt: text, or messages for the chat template (RowError for bad cells)."""
        return row_prompt(self.prompts[pos], self.template, self.system_prompt)

    # ---- the RowJob protocol (dataframe_job) ----
    def key(self, pos: int) -> str:
        return self.params_and_key(pos)[1]

    def check(self, pos: int) -> None:
        self.prompt(pos)
        if self.images is not None:
            image_cell(self.images[pos])

    def pending(self, pos: int, engine: Any) -> PendingRow:
        """The row's prompt text (chat-templated where needed) and params."""
        params, key = self.params_and_key(pos)
        p = self.prompt(pos)
        if self.images is not None and image_cell(self.images[pos]) is not None and not isinstance(p, str):
            p = with_image_part(p)          # the image before the text, as Qwen2-VL's template writes it
        try:
            text = p if isinstance(p, str) else engine.apply_chat_template(p)
        except Exception as e:  # a template that rejects these messages
            raise RowError(f"chat template failed: {e}") from e
        return PendingRow(pos, text, params, key)

    def submit(self, engine: Any, rows: list[PendingRow]) -> Iterator[tuple[int, Any]]:
        split = [split_generate_kwargs(r.params) for r in rows]
        lora = [kw.get("lora_path") for _, kw in split]      # param_columns={"adapter": "lora_path"}
        extra = {"lora_path": lora} if any(x is not None for x in lora) else {}
        if self.images is not None:
            imgs = [image_cell(self.images[r.pos]) for r in rows]
            if any(i is not None for i in imgs):
                extra["image_data"] = imgs
        return engine.generate_iter(prompt=[r.prompt for r in rows], sampling_params=[sp for sp, _ in split],
                                    **self.gen_kw, **extra)

    def record(self, out: Any) -> dict[str, Any]:
        return output_record(out, self.cols)

    def restore(self, rec: dict[str, Any]) -> dict[str, Any]:
        return restore_record(rec)

    def tokens(self, rec: dict[str, Any]) -> tuple[int, int]:
        return 0, rec["completion_tokens"] or 0


def _validate(df: Any, prompt_column: str, sampling_params: Optional[Mapping[str, Any]],
              param_columns: Any, chat: Union[str, bool], system_prompt: Optional[str], return_logprob: bool,
              top_logprobs_num: int, on_error: str, batch_size: int, prefix: str,
              image_column: Optional[str] = None) -> _Spec:
    """Check the call's arguments (nothing runs when one is wrong) and gather what the rows share."""
    check_call(df, prompt_column, on_error, batch_size)
    template_mode(chat, None, True)  # chat is "auto", True or False
    if sampling_params is not None and not isinstance(sampling_params, Mapping):
        raise ValueError(f"sampling_params must be a dict or None, got {type(sampling_params).__name__}")
    base = dict(sampling_params or {})
    row_params(base, {}, {})  # invalid call-wide params fail the whole call, before anything runs
    mapping = resolve_param_columns(df, param_columns)
    cols = output_columns(return_logprob, top_logprobs_num)
    check_new_columns(df, cols, prefix, "gen_")
    if image_column is not None:
        require_column(df, image_column, "image_column")
    gen_kw: dict[str, Any] = {"return_logprob": return_logprob}
    if top_logprobs_num:
        gen_kw["top_logprobs_num"] = top_logprobs_num
    return _Spec(base=base, mapping=mapping, cols=cols,
                 options={"return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                          "system_prompt": system_prompt},
                 prompts=df[prompt_column].tolist(), row_values={c: df[c].tolist() for c in mapping},
                 labels=df.index, on_error=on_error, system_prompt=system_prompt, gen_kw=gen_kw,
                 images=df[image_column].tolist() if image_column is not None else None)
