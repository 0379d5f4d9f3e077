"""Odd inputs to the DataFrame helpers: each is a clear ValueError naming the argument, or works."""
from __future__ import annotations

import os
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from nbgen.dataframe import generate_df
from nbgen.dataframe_rows import ColumnError

sys.path.insert(0, os.path.dirname(__file__))
from nb_fakes import FakeEngine  # noqa: E402


def _gen(df: pd.DataFrame, *a, **kw) -> pd.DataFrame:
    return generate_df(df, *a, engine=FakeEngine(), progress=False, chat=False, **kw)


def test_missing_column_is_a_value_error_naming_the_argument() -> None:
    df = pd.DataFrame({"p": ["a b"]})
    with pytest.raises(ValueError, match=r"prompt_column='prompt' is not a column .*\['p'\]") as info:
        _gen(df)
    assert isinstance(info.value, KeyError)  # still caught by `except KeyError`, as in pandas
    with pytest.raises(ValueError, match="prompt_column=\\['p'\\]"):
        _gen(df, ["p"])                      # a list of names is not a column either
    with pytest.raises(ValueError, match="param_columns='temp' is not a column"):
        _gen(df, "p", param_columns={"temp": "temperature"})
    with pytest.raises(ColumnError, match="image_column='img'"):
        _gen(df, "p", image_column="img")


def test_duplicate_column_labels_are_a_value_error() -> None:
    df = pd.DataFrame([["a b", "c d"]], columns=["prompt", "prompt"])
    with pytest.raises(ValueError, match="prompt_column='prompt' names 2 columns"):
        _gen(df)
    df = pd.DataFrame([["a b", 0.1, 0.2]], columns=["prompt", "temperature", "temperature"])
    with pytest.raises(ValueError, match="param_columns='temperature' names 2 columns"):
        _gen(df, param_columns=["temperature"])
    df = pd.DataFrame([["a b", 1]], columns=pd.MultiIndex.from_tuples([("in", "prompt"), ("in", "x")]))
    with pytest.raises(ValueError, match="prompt_column='in' names 2 columns"):
        _gen(df, "in")
    with warnings.catch_warnings():
        warnings.simplefilter("error")         # pandas deprecates adding a column by a partial key
        out = _gen(df, ("in", "prompt"))      # a full label of MultiIndex columns names one
    assert out[("text", "")].tolist() == ["b a"] and out[("in", "x")].tolist() == [1]


def test_param_columns_may_be_one_name() -> None:
    df = pd.DataFrame({"prompt": ["a b c", "d e f"], "max_new_tokens": [1, 2]})
    out = _gen(df, param_columns="max_new_tokens")
    assert out["text"].tolist() == ["c", "f e"]
    assert out["completion_tokens"].tolist() == [1, 2]


def test_a_series_gets_a_hint_and_bad_argument_types_are_named() -> None:
    with pytest.raises(TypeError, match=r"Series; pass series.to_frame\(\) \(its column is then 'prompt'\)"):
        _gen(pd.Series(["a"], name="prompt"))
    df = pd.DataFrame({"prompt": ["a b"]})
    with pytest.raises(ValueError, match="sampling_params must be a dict or None, got int"):
        _gen(df, sampling_params=5)
    with pytest.raises(ValueError, match="prefix must be a str"):
        _gen(df, prefix=1)
    with pytest.raises(ValueError, match="batch_size must be an int"):
        _gen(df, batch_size=True)
    out = _gen(df, batch_size=np.int64(1))  # a numpy int is an int
    assert out["text"].tolist() == ["b a"]


def test_default_engines_warn_only_about_the_users_own(monkeypatch) -> None:
    import nbgen.engine as E

    live: list[SimpleNamespace] = []

    class Started:  # Engine's constructor as far as the warning goes
        def __init__(self, is_embedding: bool = False) -> None:
            E.warn_others_running([e.model_name for e in E.running_engines()])
            self.config, self.model_name, self.is_shutdown = SimpleNamespace(is_embedding=is_embedding), "dflt", False
            live.append(self)

    monkeypatch.setattr(E, "Engine", Started)
    monkeypatch.setattr(E, "running_engines", lambda: list(live))
    monkeypatch.setattr(E, "_default_engines", {})

    def said(**kw) -> list[str]:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            E.default_engine(**kw)
        return [str(w.message) for w in rec]

    assert said() == [] and said(is_embedding=True) == []   # generate_df then embed_df: both nbgen's own
    live[:] = [SimpleNamespace(config=SimpleNamespace(is_embedding=False), model_name="mine", is_shutdown=False)]
    monkeypatch.setattr(E, "_default_engines", {})          # a fresh process with the user's own Engine
    assert said(is_embedding=True) == []                     # the user's engine cannot embed
    msgs = said()
    assert len(msgs) == 1 and "beside your running mine: pass engine=<your Engine>" in msgs[0]
