"""embed_df / score_df on tiny random models (fp32): columns, bad rows, checkpoint resume, interrupt."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import nbgen
from nbgen.core.interrupt import GenerationInterrupted
from nbgen.notebook.progress_bar import RowProgress

TEXTS = ["The capital of France is Paris.", "Hello, my name is nbgen.", "def add(a, b): return a + b", "x"]


@pytest.fixture(scope="module")
def emb(tiny_llama_dir):
    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", is_embedding=True)
    yield eng
    eng.shutdown()


class StopAfter:
    """An engine whose encode_iter raises KeyboardInterrupt (the Stop button) after ``n`` rows."""

    def __init__(self, engine: nbgen.Engine, n: int) -> None:
        self.engine, self.n = engine, n

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def encode_iter(self, *a, **kw):
        for k, item in enumerate(self.engine.encode_iter(*a, **kw)):
            if k == self.n:
                raise KeyboardInterrupt
            yield item


def test_embed_df_adds_float32_vectors_equal_to_encode(emb):
    df = pd.DataFrame({"text": TEXTS, "keep": range(4)}, index=[10, 11, 12, 13])
    out = nbgen.embed_df(df, "text", engine=emb, progress=False)
    assert list(out.columns) == ["text", "keep", "embedding", "error"]
    assert list(out.index) == [10, 11, 12, 13] and "embedding" not in df.columns
    ref = emb.encode(TEXTS)
    for vec, r in zip(out["embedding"], ref):
        assert isinstance(vec, np.ndarray) and vec.dtype == np.float32 and vec.shape == (64,)
        np.testing.assert_allclose(vec, np.asarray(r["embedding"], dtype=np.float32), atol=1e-5)
    assert out["error"].isna().all()
    assert out.attrs["nbgen"] == {"rows": 4, "errors": 0, "restored": 0, "checkpoint": None}


def test_embed_df_bad_rows_get_errors_and_others_complete(emb):
    too_long = "The capital of France is Paris. " * 200          # over the 1024-token context
    df = pd.DataFrame({"text": ["ok text", None, 123, "", too_long, "fine too"]})
    out = nbgen.embed_df(df, "text", engine=emb, progress=False)
    err = out["error"].tolist()
    assert err[0] is None and err[5] is None
    assert err[1] == "missing text" and "must be text" in err[2] and err[3] == "empty text"
    assert err[4].startswith("request rejected:") and "context length" in err[4]
    assert out["embedding"][1] is None and out["embedding"][4] is None
    assert out.attrs["nbgen"]["errors"] == 4
    with pytest.raises(ValueError, match=r"row 1 \(position 1\): missing text"):
        nbgen.embed_df(df, "text", engine=emb, progress=False, on_error="raise")


def test_embed_df_checkpoint_resume_after_interrupt(emb, tmp_path):
    ckpt = str(tmp_path / "emb.jsonl")
    df = pd.DataFrame({"text": TEXTS + ["one more", None]})
    with pytest.raises(GenerationInterrupted, match="rows saved to"):
        nbgen.embed_df(df, engine=StopAfter(emb, 2), checkpoint=ckpt, progress=False, batch_size=3)
    out = nbgen.embed_df(df, engine=emb, checkpoint=ckpt, progress=False, batch_size=3)
    assert out.attrs["nbgen"]["restored"] == 2 and out.attrs["nbgen"]["errors"] == 1
    ref = nbgen.embed_df(df, engine=emb, progress=False)
    for a, b in zip(out["embedding"][:5], ref["embedding"][:5]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    again = nbgen.embed_df(df, engine=emb, checkpoint=ckpt, progress=False)
    assert again.attrs["nbgen"]["restored"] == 5                 # the failed row is retried, not restored
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in again["embedding"][:5])


def test_embed_df_parquet_checkpoint_and_dimensions_key(tiny_llama_dir, emb, tmp_path):
    pytest.importorskip("pyarrow")
    ckpt = str(tmp_path / "emb.parquet")
    df = pd.DataFrame({"text": TEXTS})
    first = nbgen.embed_df(df, engine=emb, checkpoint=ckpt, progress=False)
    second = nbgen.embed_df(df, engine=emb, checkpoint=ckpt, progress=False)
    assert second.attrs["nbgen"]["restored"] == 4
    for a, b in zip(first["embedding"], second["embedding"]):
        np.testing.assert_allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="dimensions=8.*matryoshka"):     # checked before any row runs
        nbgen.embed_df(df, engine=emb, checkpoint=ckpt, progress=False, dimensions=8)


def test_embed_df_argument_errors(emb, tiny_engine):
    df = pd.DataFrame({"text": TEXTS, "embedding": 0})
    with pytest.raises(ValueError, match="prefix='emb_'"):
        nbgen.embed_df(df, engine=emb, progress=False)
    out = nbgen.embed_df(df, engine=emb, progress=False, prefix="emb_")
    assert {"emb_embedding", "emb_error"} <= set(out.columns)
    with pytest.raises(KeyError, match="nope"):
        nbgen.embed_df(df, "nope", engine=emb)
    with pytest.raises(ValueError, match="is_embedding=True"):
        nbgen.embed_df(pd.DataFrame({"text": TEXTS}), engine=tiny_engine)


def test_score_df_matches_engine_score(tiny_engine):
    df = pd.DataFrame({"text": ["yes it is", "no", "maybe so"]})
    labels = ["Paris", "Tokyo", 7]
    out = nbgen.score_df(df, "text", labels=labels, engine=tiny_engine, query="Is this good? ", progress=False)
    assert list(out.columns) == ["text", "Paris", "Tokyo", "7", "error"]
    tok = tiny_engine.get_tokenizer()
    ids = [tok.encode("Paris", add_special_tokens=False)[0], tok.encode("Tokyo", add_special_tokens=False)[0], 7]
    ref = tiny_engine.score("Is this good? ", df["text"].tolist(), ids, apply_softmax=True)
    for i, row in enumerate(ref):
        assert [out[c][i] for c in ("Paris", "Tokyo", "7")] == pytest.approx(row, abs=1e-6)
        assert math.isclose(sum(row), 1.0, abs_tol=1e-6)
    raw = nbgen.score_df(df, labels=labels, engine=tiny_engine, apply_softmax=False, progress=False,
                         item_first=True, query=" ok?")
    ref_raw = tiny_engine.score(" ok?", df["text"].tolist(), ids, item_first=True)
    assert raw["Paris"].tolist() == pytest.approx([r[0] for r in ref_raw], abs=1e-6)
    assert out["error"].isna().all()


def test_score_df_errors_and_checkpoint(tiny_engine, emb, tmp_path):
    df = pd.DataFrame({"text": ["good", None, "bad"]})
    ckpt = str(tmp_path / "score.jsonl")
    out = nbgen.score_df(df, labels=[5, 6], engine=tiny_engine, checkpoint=ckpt, progress=False)
    assert out["error"].tolist()[1] == "missing text" and math.isnan(out["5"][1])
    again = nbgen.score_df(df, labels=[5, 6], engine=tiny_engine, checkpoint=ckpt, progress=False)
    assert again.attrs["nbgen"]["restored"] == 2
    assert again["5"].tolist()[::2] == pytest.approx(out["5"].tolist()[::2])
    for bad in (None, [], "ab", [5, 5], [True], ["error"]):
        with pytest.raises(ValueError, match="labels"):
            nbgen.score_df(df, labels=bad, engine=tiny_engine)
    with pytest.raises(ValueError, match="is_embedding=True"):
        nbgen.score_df(df, labels=[5, 6], engine=emb)
    with pytest.raises(ValueError, match="same token"):
        nbgen.score_df(df, labels=["Paris", "Paris."], engine=tiny_engine)


def test_row_progress_counts_input_tokens_for_prompt_only_rows():
    bar = RowProgress(3, "embed_df", enabled=False)
    bar.settle(in_tokens=40)
    assert bar.in_tokens == 40 and bar.settled == 1


def test_helpers_refuse_the_wrong_engine_kind_up_front(emb):
    with pytest.raises(ValueError, match="generate_df needs a generative engine"):
        nbgen.generate_df(pd.DataFrame({"prompt": TEXTS}), engine=emb, progress=False)
    with pytest.raises(ValueError, match="generate_df needs a generative engine"):
        nbgen.generate_df(pd.DataFrame({"prompt": TEXTS}), engine=emb, progress=False, chat=False)


def test_score_df_labels_from_arrays_and_checked_up_front(tiny_engine):
    df = pd.DataFrame({"text": TEXTS[:2]})
    ref = nbgen.score_df(df, labels=["Paris", 7], engine=tiny_engine, progress=False)
    for labels in (np.array(["Paris", "7"], dtype=object), pd.Series(["Paris", np.int64(7)]), ("Paris", 7),
                   pd.Index(["Paris", 7], dtype=object)):
        if isinstance(labels, np.ndarray):
            labels[1] = np.int64(7)
        out = nbgen.score_df(df, labels=labels, engine=tiny_engine, progress=False)
        assert list(out.columns) == ["text", "Paris", "7", "error"]
        assert out["Paris"].tolist() == pytest.approx(ref["Paris"].tolist(), abs=1e-6)
    vocab = tiny_engine.get_model_info()["vocab_size"]
    for bad in ([vocab, 7], [-1, 7]):        # not one row runs: the call fails naming labels
        with pytest.raises(ValueError, match="labels: token ids .* outside the vocabulary"):
            nbgen.score_df(df, labels=bad, engine=tiny_engine, progress=False)
    for reserved in ("prompt_tokens", "_row", "error"):  # names the row's record uses
        with pytest.raises(ValueError, match="labels must be distinct"):
            nbgen.score_df(df, labels=[reserved, 7], engine=tiny_engine, progress=False)
    with pytest.raises(ValueError, match="empty one"):
        nbgen.score_df(df, labels=np.array([]), engine=tiny_engine, progress=False)


def test_embed_and_score_interrupt_keep_finished_rows_in_partial(emb, tiny_engine):
    df = pd.DataFrame({"text": TEXTS}, index=[10, 20, 30, 40])
    with pytest.raises(GenerationInterrupted, match=r"2/4 rows done \(kept in this exception's .partial\)") as info:
        nbgen.embed_df(df, engine=StopAfter(emb, 2), progress=False)
    part = info.value.partial
    ref = nbgen.embed_df(df, engine=emb, progress=False)
    done = part["error"].isna()
    assert list(part.index) == [10, 20, 30, 40] and done.sum() == 2
    for a, b in zip(part["embedding"][done], ref["embedding"][done]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert part["embedding"][~done].isna().all()

    class StopScore(StopAfter):
        def score_iter(self, *a, **kw):
            for k, item in enumerate(self.engine.score_iter(*a, **kw)):
                if k == self.n:
                    raise KeyboardInterrupt
                yield item

    with pytest.raises(GenerationInterrupted) as info:
        nbgen.score_df(df, labels=["Paris", 7], engine=StopScore(tiny_engine, 1), progress=False)
    part = info.value.partial
    assert part["error"].notna().sum() == 3 and part["Paris"].notna().sum() == 1
    assert math.isclose(float(part["Paris"].sum() + part["7"].sum()), 1.0, abs_tol=1e-6)
