"""score_df: zero-shot classification of a DataFrame's texts, one probability column per label.

Each row's text (after an optional ``query``, or before it with ``item_first``) is scored with
``Engine.score_iter`` (SGLang's ``score``): the probability of each label's token right after the
prompt, renormalised over the labels with ``apply_softmax``. A label given as text stands for its
first token (tokenized without special tokens); an int is a token id. Checkpoint, error column,
progress bar and the Stop button are ``dataframe_job.run_job``'s, as for generate_df.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

from nbgen.dataframe_job import JobResult, TextRows, check_call, check_new_columns, run_job
from nbgen.dataframe_rows import abort_message, column_key, jsonable, row_key
from nbgen.dataframe_window import PendingRow
from nbgen.engine import default_engine

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

Label = Union[str, int]


def score_df(df: "pd.DataFrame", text_column: str = "text", labels: Optional[Sequence[Label]] = None,
             engine: Any = None, *, query: Optional[str] = None, item_first: bool = False,
             apply_softmax: bool = True, checkpoint: Optional[str] = None, on_error: str = "skip",
             batch_size: int = 1024, progress: bool = True, prefix: str = "") -> "pd.DataFrame":
    """Score every row's text against ``labels``; return a copy of ``df`` with one float column per
    label (named ``prefix + str(label)``) and ``error``.

    ``query``: text put before each row's text (after it with ``item_first=True``); ``apply_softmax``
    (default True) makes each row's label probabilities sum to 1. ``engine``: a generative Engine
    (None: the process-wide one on the embedded model). Bad rows, ``on_error``, ``checkpoint`` and
    ``out.attrs["nbgen"]`` work as in generate_df.
    """
    import pandas as pd

    check_call(df, text_column, on_error, batch_size, "text_column")
    values = _label_values(labels)
    names = tuple(str(lab) for lab in values)
    check_new_columns(df, list(names) + ["error"], prefix, "p_")
    if query is not None and not isinstance(query, str):
        raise ValueError(f"query must be a str or None, got {type(query).__name__}")
    job = _ScoreRows(texts=df[text_column].tolist(), labels=df.index, on_error=on_error, label_values=values,
                     names=names, query=query or "", item_first=bool(item_first), apply_softmax=bool(apply_softmax))
    if engine is not None:
        job.resolve_labels(engine)

    def the_engine() -> Any:
        eng = engine if engine is not None else default_engine()
        job.resolve_labels(eng)
        return eng

    def frame(res: JobResult) -> "pd.DataFrame":
        out = df.copy()
        for name in names:
            out[column_key(out.columns, prefix + name)] = pd.Series(res.values[name], index=df.index, dtype="float64")
        out[column_key(out.columns, prefix + "error")] = pd.Series(res.values["error"], index=df.index, dtype=object)
        out.attrs = {**df.attrs, "nbgen": res.attrs()}
        return out

    return run_job(job, checkpoint, the_engine, batch_size, progress, frame)


_RESERVED = ("error", "prompt_tokens", "_row", "_key")   # keys of a row's record and checkpoint line


def _label_values(labels: Any) -> list[Label]:
    """The labels as plain str / int values (a list, tuple, array or Series of them); a ValueError
    naming ``labels`` when they are not usable."""
    if labels is None or isinstance(labels, (str, bytes, dict)) or not hasattr(labels, "__iter__"):
        raise ValueError(f"labels must be a non-empty list of label texts or token ids, got {labels!r:.80}")
    values = [lab.item() if hasattr(lab, "item") and not isinstance(lab, str) else lab for lab in labels]
    if not values:
        raise ValueError("labels must be a non-empty list of label texts or token ids, got an empty one")
    for lab in values:
        if isinstance(lab, bool) or not isinstance(lab, (str, int)) or lab == "":
            raise ValueError(f"labels must be non-empty strings or token ids, got {lab!r:.60}")
    names = [str(lab) for lab in values]
    if len(set(names)) != len(names) or set(names) & set(_RESERVED):
        raise ValueError(f"labels must be distinct (and none named {', '.join(map(repr, _RESERVED))}), "
                         f"got {values}")
    return values


@dataclass
class _ScoreRows(TextRows):
    """score_df's RowJob (dataframe_job): one text per row through ``Engine.score_iter``."""

    texts: list[Any]
    labels: Any
    on_error: str
    label_values: list[Label]
    names: tuple[str, ...]
    query: str
    item_first: bool
    apply_softmax: bool
    label_ids: list[int] = field(default_factory=list)   # set by resolve_labels
    desc: str = "score_df"

    @property
    def cols(self) -> tuple[str, ...]:
        return self.names + ("error",)

    def resolve_labels(self, engine: Any) -> None:
        """Token ids of the labels with ``engine``'s tokenizer (text labels: their first token)."""
        if engine.get_model_info().get("is_generation") is False:
            raise ValueError("score_df needs a generative engine; this one was created with is_embedding=True")
        ids = []
        for lab in self.label_values:
            if isinstance(lab, int):
                ids.append(lab)
                continue
            tok = engine.get_tokenizer()
            if tok is None:
                raise ValueError("text labels need the engine's tokenizer; pass token ids as labels")
            first = tok.encode(lab, add_special_tokens=False)[:1]
            if not first:
                raise ValueError(f"labels: {lab!r} encodes to no token")
            ids.append(first[0])
        vocab = engine.get_model_info().get("vocab_size")
        bad = [i for i in ids if vocab and not 0 <= i < vocab]
        if bad:
            raise ValueError(f"labels: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        same = [n for n, i in zip(self.names, ids) if ids.count(i) > 1]
        if same:
            raise ValueError(f"labels {same} start with the same token, so their scores would be equal; "
                             "use labels that differ in their first token")
        self.label_ids = ids

    def key(self, pos: int) -> str:
        opts = {"score": list(self.names), "query": self.query, "item_first": self.item_first,
                "apply_softmax": self.apply_softmax}
        return row_key(jsonable(self.texts[pos]), {}, opts)

    def submit(self, engine: Any, rows: list[PendingRow]) -> Iterator[tuple[int, Any]]:
        return engine.score_iter(self.query, [r.prompt for r in rows], self.label_ids,
                                 apply_softmax=self.apply_softmax, item_first=self.item_first)

    def record(self, out: Any) -> dict[str, Any]:
        err = abort_message(out)
        scores = out.get("scores") if err is None else None
        if err is None and scores is None:
            err = "no scores returned"
        rec: dict[str, Any] = {n: (None if scores is None else scores[k]) for k, n in enumerate(self.names)}
        rec["error"] = err
        rec["prompt_tokens"] = int(out.get("meta_info", {}).get("prompt_tokens", 0))
        return rec

    def tokens(self, rec: dict[str, Any]) -> tuple[int, int]:
        return rec.get("prompt_tokens") or 0, 0
