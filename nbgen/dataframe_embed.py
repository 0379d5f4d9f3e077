"""embed_df: a DataFrame of texts in, the same DataFrame plus an ``embedding`` column out.

Rows go through ``Engine.encode_iter`` of an embedding engine (``Engine(is_embedding=True)``) with
the checkpoint, error column, progress bar and Stop-button handling every DataFrame helper shares
(``dataframe_job.run_job``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

from nbgen.core.scheduler_config import is_integral
from nbgen.dataframe_job import JobResult, TextRows, check_call, check_new_columns, run_job
from nbgen.dataframe_rows import abort_message, column_key, jsonable, row_key
from nbgen.dataframe_window import PendingRow
from nbgen.engine import default_engine
from nbgen.models.pooling_config import check_dimensions

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

COLUMNS = ("embedding", "error")


def embed_df(df: "pd.DataFrame", text_column: str = "text", engine: Any = None, *,
             dimensions: Optional[int] = None, checkpoint: Optional[str] = None, on_error: str = "skip",
             batch_size: int = 1024, progress: bool = True, prefix: str = "") -> "pd.DataFrame":
    """Embed one text per row; return a copy of ``df`` with ``embedding`` (a float32 numpy array per
    row, None where the row failed) and ``error`` added, each name prefixed by ``prefix``.

    ``engine``: an ``Engine(..., is_embedding=True)``; None uses one process-wide embedding engine on
    the embedded model. ``dimensions`` truncates Matryoshka embeddings (see ``Engine.encode``).
    A row that cannot run (missing or non-text cell, a failed request) gets a message in ``error``;
    ``on_error="raise"`` stops at the first one. ``checkpoint="emb.parquet"`` (or ``.jsonl``) saves
    rows as they finish and a later call with the same arguments skips them; the Stop button
    raises GenerationInterrupted. ``out.attrs["nbgen"]``: rows, errors, restored, checkpoint.
    """
    import numpy as np
    import pandas as pd

    check_call(df, text_column, on_error, batch_size, "text_column")
    check_new_columns(df, COLUMNS, prefix, "emb_")
    if dimensions is not None and not is_integral(dimensions):
        raise ValueError(f"dimensions must be an int or None, got {dimensions!r:.60}")
    dimensions = None if dimensions is None else int(dimensions)  # np.int64(8) -> 8 (the checkpoint key)
    if engine is not None:
        require_embedding(engine, dimensions)
    job = _EmbedRows(texts=df[text_column].tolist(), labels=df.index, on_error=on_error, dimensions=dimensions)

    def frame(res: JobResult) -> "pd.DataFrame":
        out = df.copy()
        vecs = [None if v is None else np.asarray(v, dtype=np.float32) for v in res.values["embedding"]]
        out[column_key(out.columns, prefix + "embedding")] = pd.Series(vecs, index=df.index, dtype=object)
        out[column_key(out.columns, prefix + "error")] = pd.Series(res.values["error"], index=df.index, dtype=object)
        out.attrs = {**df.attrs, "nbgen": res.attrs()}
        return out

    return run_job(job, checkpoint,
                   lambda: require_embedding(engine or default_engine(is_embedding=True), dimensions),
                   batch_size, progress, frame)


def require_embedding(engine: Any, dimensions: Optional[int]) -> Any:
    """``engine`` when it embeds (and takes ``dimensions``); a ValueError before any row runs otherwise."""
    if engine.get_model_info().get("is_generation", True):
        raise ValueError("embed_df needs an embedding engine: pass engine=nbgen.Engine(model_path, "
                         "is_embedding=True) (or engine=None for the embedded model)")
    check_dimensions(dimensions, engine.pooling, engine.model_name)
    return engine


@dataclass
class _EmbedRows(TextRows):
    """embed_df's RowJob (dataframe_job): one text per row through ``Engine.encode_iter``."""

    texts: list[Any]
    labels: Any
    on_error: str
    dimensions: Optional[int]
    cols: tuple[str, ...] = COLUMNS
    desc: str = "embed_df"

    def key(self, pos: int) -> str:
        return row_key(jsonable(self.texts[pos]), {}, {"embed": True, "dimensions": self.dimensions})

    def submit(self, engine: Any, rows: list[PendingRow]) -> Iterator[tuple[int, Any]]:
        return engine.encode_iter([r.prompt for r in rows], dimensions=self.dimensions)

    def record(self, out: Any) -> dict[str, Any]:
        err = abort_message(out)
        if err is None and out.get("embedding") is None:
            err = "no embedding returned"
        return {"embedding": None if err else out["embedding"], "error": err,
                "prompt_tokens": int(out.get("meta_info", {}).get("prompt_tokens", 0))}

    def tokens(self, rec: dict[str, Any]) -> tuple[int, int]:
        return rec.get("prompt_tokens") or 0, 0
