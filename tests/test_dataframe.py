"""generate_df: pure row logic, checkpoint files, and whole runs (fake engine + real tiny model)."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from nbgen.dataframe import generate_df
from nbgen.dataframe_io import Checkpoint
from nbgen.dataframe_rows import (RowError, is_missing, output_record, resolve_param_columns, row_key,
                                  row_params, row_prompt)
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from nb_fakes import FakeEngine  # noqa: E402


# ---- pure row logic ---------------------------------------------------------------------------
def test_is_missing_covers_pandas_holes() -> None:
    assert all(is_missing(v) for v in (None, float("nan"), pd.NA, pd.NaT, np.nan))
    assert not any(is_missing(v) for v in ("", "x", 0, [1], {"a": 1}))


def test_row_prompt_rules() -> None:
    assert row_prompt("hi", False, None) == "hi"
    assert row_prompt("hi", True, None) == [{"role": "user", "content": "hi"}]
    assert row_prompt("hi", False, "be brief")[0] == {"role": "system", "content": "be brief"}
    msgs = [{"role": "user", "content": "q"}]
    assert row_prompt(msgs, False, None) == msgs  # a conversation is one whatever the text mode
    assert row_prompt(np.array(msgs, dtype=object), False, "sys")[1] == msgs[0]
    for bad, word in ((None, "missing"), (float("nan"), "missing"), (3, "int"), ("", "empty"),
                      ([{"role": "user"}], "role"), ([], "non-empty")):
        with pytest.raises(RowError, match=word):
            row_prompt(bad, False, None)


def test_row_params_merge_coerce_and_validate() -> None:
    mapping = resolve_param_columns(pd.DataFrame(columns=["t", "mx", "sp"]),
                                    {"t": "temperature", "mx": "max_new_tokens", "sp": "sampling_params"})
    p = row_params({"top_p": 0.9}, {"t": np.float64(0.5), "mx": 16.0, "sp": {"top_k": np.int64(5)}}, mapping)
    assert p == {"top_p": 0.9, "temperature": 0.5, "max_new_tokens": 16, "top_k": 5}
    assert type(p["max_new_tokens"]) is int and type(p["top_k"]) is int
    # a missing cell keeps the call's value
    assert row_params({"temperature": 0.1}, {"t": float("nan"), "mx": None, "sp": None}, mapping) == {"temperature": 0.1}
    with pytest.raises(RowError, match="top_p"):
        row_params({"top_p": 1.5}, {}, {})
    with pytest.raises(RowError, match="max_new_tokens"):
        row_params({}, {"t": 1.0, "mx": 2.5, "sp": None}, mapping)
    with pytest.raises(RowError, match="dicts"):
        row_params({}, {"t": 1.0, "mx": 3, "sp": "x"}, mapping)
    with pytest.raises(KeyError):
        resolve_param_columns(pd.DataFrame(columns=["a"]), ["b"])
    with pytest.raises(ValueError, match="tempurature"):
        resolve_param_columns(pd.DataFrame(columns=["tempurature"]), ["tempurature"])


def test_row_key_changes_with_prompt_and_params() -> None:
    k = row_key("a", {"temperature": 0}, {})
    assert k == row_key("a", {"temperature": 0}, {})
    assert k != row_key("b", {"temperature": 0}, {})
    assert k != row_key("a", {"temperature": 1}, {})


def test_output_record_single_n_and_abort() -> None:
    out = {"text": "x", "meta_info": {"prompt_tokens": 3, "completion_tokens": 2,
                                      "finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 5, None]]}}
    rec = output_record(out, ("text", "output_token_logprobs"))
    assert rec["text"] == "x" and rec["finish_reason"] == "length" and rec["error"] is None
    assert rec["output_token_logprobs"] == [[-1.0, 5, None]]
    two = output_record([out, dict(out, text="y")], ("text",))
    assert two["text"] == ["x", "y"] and two["completion_tokens"] == 4
    ab = {"text": "", "meta_info": {"prompt_tokens": 3, "completion_tokens": 0,
                                    "finish_reason": {"type": "abort", "message": "boom"}}}
    assert output_record(ab, ("text",))["error"] == "boom"


# ---- checkpoint files -------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_checkpoint_roundtrip_and_torn_line(tmp_path, suffix) -> None:
    if suffix == "parquet":
        pytest.importorskip("pyarrow")
    path = str(tmp_path / f"run.{suffix}")
    ck = Checkpoint(path)
    ck.append({"_row": 0, "_key": "k0", "text": "a", "output_token_logprobs": [[-0.5, 1, "x"]]})
    ck.append({"_row": 1, "_key": "k1", "text": ["b", "c"]})
    with open(ck.journal, "a") as f:
        f.write('{"_row": 2, "_ke')  # a process killed mid-write
    recs = list(Checkpoint(path).load())  # readable before close: a killed kernel never closes
    assert [r["_row"] for r in recs] == [0, 1]
    ck.close()
    recs = list(Checkpoint(path).load())
    assert recs[0]["output_token_logprobs"] == [[-0.5, 1, "x"]] and recs[1]["text"] == ["b", "c"]
    if suffix == "parquet":
        assert not (tmp_path / "run.parquet.partial.jsonl").exists()


def test_checkpoint_rejects_unknown_suffix(tmp_path) -> None:
    with pytest.raises(ValueError, match="parquet or .jsonl"):
        Checkpoint(str(tmp_path / "run.csv"))
    with pytest.raises(ValueError, match="checkpoint must be a path"):
        Checkpoint(True)


def test_checkpoint_path_expands_home_and_takes_any_case(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    df = pd.DataFrame({"prompt": ["a b", "c d"]})
    out = generate_df(df, engine=FakeEngine(), checkpoint="~/runs/r.JSONL", progress=False, chat=False)
    assert out.attrs["nbgen"]["checkpoint"] == str(tmp_path / "runs" / "r.JSONL")
    assert len((tmp_path / "runs" / "r.JSONL").read_text().splitlines()) == 2
    again = generate_df(df, engine=FakeEngine(), checkpoint="~/runs/r.JSONL", progress=False, chat=False)
    assert again.attrs["nbgen"]["restored"] == 2 and again["text"].tolist() == ["b a", "d c"]


# ---- whole runs on the fake engine (logic: ordering, errors, resume) ---------------------------
def _frame() -> pd.DataFrame:
    return pd.DataFrame({"prompt": ["one two three", None, 42, "a b c d e f", "REJECT me", "FAIL here", "x y"],
                         "temperature": [0.0, 0.5, 0.5, float("nan"), 0.0, 0.0, -1.0],
                         "keep": list("abcdefg")}, index=[10, 11, 12, 13, 14, 15, 16])


def test_generate_df_keeps_frame_and_reports_bad_rows() -> None:
    df = _frame()
    before = df.copy()
    out = generate_df(df, "prompt", engine=FakeEngine(), sampling_params={"max_new_tokens": 4},
                      param_columns=["temperature"], progress=False, batch_size=3, chat=False)
    pd.testing.assert_frame_equal(df, before)  # input untouched
    assert list(out.index) == list(df.index) and list(out.columns[:3]) == ["prompt", "temperature", "keep"]
    assert out.loc[10, "text"] == "three two one" and out.loc[10, "finish_reason"] == "stop"
    assert out.loc[13, "text"] == "f e d c" and out.loc[13, "finish_reason"] == "length"
    assert out.loc[13, "completion_tokens"] == 4 and out.loc[13, "prompt_tokens"] == 6
    assert out.loc[16, "text"] is None and "temperature" in out.loc[16, "error"]
    assert "missing prompt" in out.loc[11, "error"] and "int" in out.loc[12, "error"]
    assert "context length" in out.loc[14, "error"]  # rejected by the engine, found by splitting
    assert out.loc[15, "error"] == "simulated engine failure"
    assert out["error"].isna().sum() == 2 and str(out["prompt_tokens"].dtype) == "Int64"


def test_generate_df_on_error_raise_and_column_clash() -> None:
    with pytest.raises(ValueError, match="row 11"):
        generate_df(_frame(), engine=FakeEngine(), on_error="raise", progress=False)
    df = pd.DataFrame({"prompt": ["a"], "text": ["x"]})
    with pytest.raises(ValueError, match="prefix"):
        generate_df(df, engine=FakeEngine(), progress=False)
    out = generate_df(df, engine=FakeEngine(), progress=False, prefix="gen_", chat=False)
    assert out.loc[0, "text"] == "x" and out.loc[0, "gen_text"] == "a"
    with pytest.raises(ValueError, match="top_p"):
        generate_df(df, engine=FakeEngine(), sampling_params={"top_p": 3}, prefix="g_")


def test_generate_df_chat_and_n() -> None:
    df = pd.DataFrame({"prompt": ["hello there", [{"role": "user", "content": "hi"}]]})
    out = generate_df(df, engine=FakeEngine(), system_prompt="sys", progress=False)
    assert out.loc[0, "text"] == "<assistant> there hello <user> sys <system>"
    assert out.loc[1, "text"] == "<assistant> hi <user> sys <system>"
    out = generate_df(pd.DataFrame({"prompt": ["a b", "c"]}), engine=FakeEngine(),
                      sampling_params={"n": 2}, progress=False, chat=False)
    assert out.loc[0, "text"] == ["b a", "b a s1"] and out.loc[1, "text"] == ["c", "c s1"]
    assert out.loc[0, "completion_tokens"] == 5


class _Interrupting(FakeEngine):
    """Raises KeyboardInterrupt after ``after`` rows finished (a user pressing Stop)."""

    def __init__(self, after: int) -> None:
        super().__init__(complete_in_reverse=False)
        self.after = after

    def generate_iter(self, prompt=None, sampling_params=None, **kw):
        for k, item in enumerate(super().generate_iter(prompt, sampling_params, **kw)):
            if self.finished > self.after:
                raise KeyboardInterrupt
            yield item


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_generate_df_resume_after_interrupt(tmp_path, suffix) -> None:
    if suffix == "parquet":
        pytest.importorskip("pyarrow")
    df = pd.DataFrame({"prompt": [f"w{i} v{i}" for i in range(20)] + [None]})
    path = str(tmp_path / f"run.{suffix}")
    with pytest.raises(KeyboardInterrupt):
        generate_df(df, engine=_Interrupting(after=7), checkpoint=path, progress=False, batch_size=5,
                    chat=False)
    saved = {r["_row"] for r in Checkpoint(path).load() if not r.get("error")}
    assert saved == set(range(7))  # every row that finished before the interrupt is on disk
    eng = FakeEngine()
    out = generate_df(df, engine=eng, checkpoint=path, progress=False, batch_size=5, chat=False)
    assert sum(len(c) for c in eng.calls) == 20 - 7  # only the rest ran
    assert [out.loc[i, "text"] for i in range(20)] == [f"v{i} w{i}" for i in range(20)]
    eng2 = FakeEngine()
    out2 = generate_df(df, engine=eng2, checkpoint=path, progress=False, chat=False)
    assert eng2.calls == [] and out2["text"].tolist() == out["text"].tolist()
    # a changed prompt is recomputed, the others are reused
    df.loc[3, "prompt"] = "new prompt"
    eng3 = FakeEngine()
    out3 = generate_df(df, engine=eng3, checkpoint=path, progress=False, chat=False)
    assert eng3.calls == [["new prompt"]] and out3.loc[3, "text"] == "prompt new"


# ---- the real engine on a tiny random model (tests/conftest.py's shared fixture) -----------------
def test_generate_df_real_engine_matches_generate(tiny_engine, tmp_path) -> None:
    prompts = ["hello world", "the cat sat", None, "a b c d e", "one"] * 3
    df = pd.DataFrame({"prompt": prompts, "max_new_tokens": [4, 6, 3, 8, 5] * 3})
    sp = {"temperature": 0.0, "ignore_eos": True}
    out = generate_df(df, engine=tiny_engine, sampling_params=sp, param_columns=["max_new_tokens"], chat=False,
                      progress=False, batch_size=4, checkpoint=str(tmp_path / "r.jsonl"), return_logprob=True)
    ok = [i for i, p in enumerate(prompts) if p is not None]
    refs = tiny_engine.generate([prompts[i] for i in ok],
                                [{**sp, "max_new_tokens": int(df.loc[i, "max_new_tokens"])} for i in ok])
    assert all(out.loc[i, "error"] == "missing prompt" for i, p in enumerate(prompts) if p is None)
    for i, ref in zip(ok, refs):
        assert out.loc[i, "text"] == ref["text"] and out.loc[i, "error"] is None
        assert out.loc[i, "completion_tokens"] == int(df.loc[i, "max_new_tokens"])
        assert out.loc[i, "finish_reason"] == "length"
        assert len(out.loc[i, "output_token_logprobs"]) == out.loc[i, "completion_tokens"]
        assert all(math.isfinite(t[0]) for t in out.loc[i, "output_token_logprobs"])
    lines = [json.loads(x) for x in open(tmp_path / "r.jsonl")]
    assert len([r for r in lines if not r.get("error")]) == 12


def test_generate_df_real_engine_n_samples_and_chat(tiny_engine) -> None:
    df = pd.DataFrame({"prompt": ["hello", "the cat"]})
    sp = {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "n": 2, "sampling_seed": 11}
    out = generate_df(df, engine=tiny_engine, sampling_params=sp, progress=False, chat=False)
    ref = tiny_engine.generate(["hello", "the cat"], sp)  # prompt-major: 2 samples per prompt
    assert out["text"].tolist() == [[ref[0]["text"], ref[1]["text"]], [ref[2]["text"], ref[3]["text"]]]
    assert out["completion_tokens"].tolist() == [10, 10]
    chat = generate_df(df, engine=tiny_engine, system_prompt="be brief", progress=False,
                       sampling_params={"temperature": 0.0, "max_new_tokens": 4})
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert chat.loc[0, "text"] == tiny_engine.chat(msgs, {"temperature": 0.0, "max_new_tokens": 4})["text"]
    # chat="auto" (the default) on a tokenizer with a template: text cells become user messages
    auto = generate_df(df, engine=tiny_engine, progress=False, sampling_params={"temperature": 0.0, "max_new_tokens": 4})
    assert tiny_engine.has_chat_template and auto.attrs["nbgen"]["chat"] is True
    assert auto.loc[1, "text"] == tiny_engine.chat([{"role": "user", "content": "the cat"}],
                                                   {"temperature": 0.0, "max_new_tokens": 4})["text"]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_restored_logprobs_equal_fresh_ones(tiny_engine, tmp_path, suffix) -> None:
    if suffix == "parquet":
        pytest.importorskip("pyarrow")
    df = pd.DataFrame({"prompt": ["hello world", "the cat"]})
    kw = dict(engine=tiny_engine, sampling_params={"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
              chat=False, progress=False, return_logprob=True, top_logprobs_num=2,
              checkpoint=str(tmp_path / f"lp.{suffix}"))
    fresh = generate_df(df, **kw)
    again = generate_df(df, **kw)
    assert again.attrs["nbgen"]["restored"] == 2
    assert isinstance(fresh.loc[0, "output_token_logprobs"][0], tuple)  # (logprob, token_id, text)
    for c in ("output_token_logprobs", "output_top_logprobs", "text"):
        assert again[c].tolist() == fresh[c].tolist(), c
