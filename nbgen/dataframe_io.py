"""Checkpoint files for generate_df: finished rows survive interrupts and kernel restarts.

A checkpoint is a set of records ``{"_row": position, "_key": fingerprint, <output columns>}``.
While a run is going every finished row is appended as one JSON line and flushed to the OS at
once, so a KeyboardInterrupt or a killed kernel loses nothing that finished.

- ``*.jsonl`` (no extra dependency): the journal *is* the checkpoint.
- ``*.parquet`` (needs pyarrow): rows are journaled to ``<path>.partial.jsonl`` during the run and
  merged into the parquet file when the run ends (also on interrupt); a journal left behind by a
  killed kernel is read and merged on the next run.
"""
from __future__ import annotations

import json
import os
from typing import IO, Any, Iterator, Optional

_JSON_COLS_META = b"nbgen_json_columns"


def _require_pyarrow() -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("a .parquet checkpoint needs pyarrow: `pip install pyarrow` "
                          "(or use checkpoint='run.jsonl', which needs nothing)") from e
    return pq


def _read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                # a torn last line from a process killed mid-write: that row was never finished
                continue


def _read_parquet(path: str) -> Iterator[dict[str, Any]]:
    pq = _require_pyarrow()
    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    json_cols = set(json.loads(meta.get(_JSON_COLS_META, b"[]")))
    for rec in table.to_pylist():
        for c in json_cols:
            if rec.get(c) is not None:
                rec[c] = json.loads(rec[c])
        yield rec


def _write_parquet(path: str, records: list[dict[str, Any]]) -> None:
    """Write records atomically; columns holding lists/dicts are stored as JSON text."""
    pq = _require_pyarrow()
    import pyarrow as pa

    cols: list[str] = []
    for r in records:
        cols.extend(k for k in r if k not in cols)
    json_cols = [c for c in cols if any(isinstance(r.get(c), (list, dict, tuple)) for r in records)]
    rows = [{c: (json.dumps(r.get(c)) if c in json_cols and r.get(c) is not None else r.get(c))
             for c in cols} for r in records]
    table = pa.Table.from_pylist(rows)
    table = table.replace_schema_metadata({_JSON_COLS_META: json.dumps(json_cols).encode()})
    tmp = path + ".tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half


class Checkpoint:
    """Append-as-you-go record store behind generate_df's ``checkpoint=`` argument."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"checkpoint must be a path (str or os.PathLike), got {type(path).__name__}")
        self.path = os.path.expanduser(os.fspath(path))  # "~/runs/x.jsonl", as pandas' writers take it
        suffix = self.path.lower()
        if suffix.endswith(".parquet"):
            _require_pyarrow()  # fail before any generation, not at the end
            self.journal = self.path + ".partial.jsonl"
        elif suffix.endswith(".jsonl") or suffix.endswith(".json"):
            self.journal = self.path
        else:
            raise ValueError(f"checkpoint must end in .parquet or .jsonl, got {self.path!r}")
        self._f: Optional[IO[str]] = None

    @property
    def is_parquet(self) -> bool:
        return self.journal != self.path

    def load(self) -> Iterator[dict[str, Any]]:
        """All saved records, oldest first (a later record for the same row wins)."""
        if self.is_parquet and os.path.exists(self.path):
            yield from _read_parquet(self.path)
        if os.path.exists(self.journal):
            yield from _read_jsonl(self.journal)

    def append(self, record: dict[str, Any]) -> None:
        """Save one finished row now (flushed to the OS: survives a killed process)."""
        if self._f is None:
            d = os.path.dirname(os.path.abspath(self.journal))
            os.makedirs(d, exist_ok=True)
            self._f = open(self.journal, "a", encoding="utf-8")
        self._f.write(json.dumps(record, default=_json_default) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Sync the journal; for parquet, merge it into the parquet file and remove it."""
        if self._f is not None:
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None
        if self.is_parquet and os.path.exists(self.journal):
            latest: dict[int, dict[str, Any]] = {}
            for rec in self.load():
                latest[int(rec["_row"])] = rec
            _write_parquet(self.path, [latest[k] for k in sorted(latest)])
            os.remove(self.journal)


def _json_default(o: Any) -> Any:
    """numpy scalars and tuples inside outputs -> plain JSON values."""
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"cannot save {type(o).__name__} in a checkpoint")
