"""nbgen.ray on a local Ray (2 CPUs): the actor pool gives generate_df's texts and errors, written by
Ray's parquet writer; arguments are checked before anything runs; no process is left behind."""
from __future__ import annotations

import os

import pandas as pd
import psutil
import pytest

import nbgen

ray = pytest.importorskip("ray")
from nbgen.ray import generate_ray  # noqa: E402 - after the skip when Ray is missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP = {"max_new_tokens": 8, "temperature": 0}
EK = {"dtype": "float32", "device": "cpu"}


def cells(values: list) -> list:
    """Missing values as None (parquet and pandas spell them differently)."""
    return [None if v is None or (isinstance(v, float) and v != v) else v for v in values]


@pytest.fixture(scope="module")
def local_ray():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # the actors import this checkout's nbgen (the editable install may point elsewhere)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield
    ray.shutdown()
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _gone, alive = psutil.wait_procs(started, timeout=60)
    assert alive == [], [p.cmdline() for p in alive]


def test_generate_ray_matches_generate_df(local_ray, tiny_llama_dir, tmp_path):
    df = pd.DataFrame({"prompt": ["Hello there", "def add(a, b):", "", "The quick brown fox", None, "Once"],
                       "id": range(6)})
    ds = generate_ray(ray.data.from_pandas(df), "prompt", model_path=tiny_llama_dir, engine_kwargs=EK,
                      sampling_params=SP, chat=False, prefix="gen_", batch_size=3)
    ds.write_parquet(str(tmp_path / "out"))          # Ray's own writer
    out = pd.read_parquet(tmp_path / "out").sort_values("id").reset_index(drop=True)
    with nbgen.Engine(tiny_llama_dir, **EK) as eng:
        ref = nbgen.generate_df(df, "prompt", engine=eng, sampling_params=SP, chat=False, prefix="gen_",
                                progress=False)
    assert list(out.columns) == list(ref.columns)
    for col in ("gen_text", "gen_error", "gen_finish_reason"):
        assert cells(out[col].tolist()) == cells(ref[col].tolist()), col
    assert cells(out["gen_error"].tolist())[2] is not None        # the empty prompt's message


def test_generate_ray_checks_arguments_first(local_ray, tiny_llama_dir):
    ds = ray.data.from_pandas(pd.DataFrame({"prompt": ["a"]}))
    with pytest.raises(ValueError, match="prompt_column"):
        generate_ray(ds, "text", model_path=tiny_llama_dir)
    with pytest.raises(ValueError, match="max_new_token"):
        generate_ray(ds, model_path=tiny_llama_dir, sampling_params={"max_new_token": 3})
    with pytest.raises(ValueError, match="concurrency"):
        generate_ray(ds, model_path=tiny_llama_dir, concurrency=0)
    with pytest.raises(ValueError, match="tp_sise"):
        generate_ray(ds, model_path=tiny_llama_dir, engine_kwargs={"tp_sise": 2})
