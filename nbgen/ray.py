"""Ray Data: nbgen engines as an actor pool over a ``ray.data.Dataset`` (``pip install nbgen[ray]``).

``generate_ray(ds, "prompt", model_path=..., concurrency=4, num_gpus=1)`` returns a lazy Dataset
with generate_df's output columns added to every row; write it with Ray's own writers
(``.write_parquet(path)``, ``.write_json(path)``) or pull it with ``.to_pandas()``. Each actor
holds one Engine (``tp_size`` GPUs when ``engine_kwargs`` asks for tensor parallelism) and runs
each batch of rows through ``generate_df`` (same sampling params, chat template, per-row
parameter columns, error column and column prefix), so a row that cannot run gets its message in
``error`` and the others complete.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from nbgen.core.config import EngineConfig
from nbgen.core.sampling import SamplingParams
from nbgen.dataframe import generate_df
from nbgen.engine import Engine

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    import ray.data

# generate_df's options an actor passes on for every batch (the rest are the actor's own)
_ROW_OPTIONS = ("param_columns", "chat", "system_prompt", "return_logprob", "top_logprobs_num", "on_error", "prefix")


class NbgenGenerator:
    """A Ray Data actor: one Engine, built once, generating each batch (a pandas DataFrame)."""

    def __init__(self, model_path: Optional[str], engine_kwargs: dict[str, Any], prompt_column: str,
                 sampling_params: Optional[dict[str, Any]], options: dict[str, Any]) -> None:
        self.engine = Engine(model_path, **engine_kwargs)
        self.prompt_column = prompt_column
        self.sampling_params = sampling_params
        self.options = options

    def __call__(self, batch: "pd.DataFrame") -> "pd.DataFrame":
        out = generate_df(batch, self.prompt_column, engine=self.engine, sampling_params=self.sampling_params,
                          progress=False, batch_size=max(1, len(batch)), **self.options)
        out.attrs = {}     # per-batch facts; Ray concatenates the rows
        return out


def _check_count(name: str, value: Any, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ValueError(f"{name} must be a number >= {minimum}, got {value!r}")


def generate_ray(
    ds: "ray.data.Dataset",
    prompt_column: str = "prompt",
    *,
    model_path: Optional[str] = None,
    engine_kwargs: Optional[Mapping[str, Any]] = None,
    sampling_params: Optional[Mapping[str, Any]] = None,
    param_columns: Union[None, Sequence[str], Mapping[str, str]] = None,
    chat: Union[str, bool] = "auto",
    system_prompt: Optional[str] = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    on_error: str = "skip",
    prefix: str = "",
    concurrency: Union[int, tuple[int, int]] = 1,
    num_gpus: Optional[float] = None,
    num_cpus: float = 1,
    batch_size: int = 256,
) -> "ray.data.Dataset":
    """``ds`` with generate_df's columns added (``text``, ``finish_reason``, ``prompt_tokens``,
    ``completion_tokens``, ``error``, logprob columns with ``return_logprob``; each name prefixed
    by ``prefix``), computed by ``concurrency`` actors (an int, or Ray's ``(min, max)`` autoscaling
    pair), each an ``Engine(model_path, **engine_kwargs)`` on ``num_gpus`` GPUs (default:
    ``engine_kwargs["tp_size"]`` on a GPU engine, 0 on ``device="cpu"``) and ``num_cpus`` CPUs.
    ``batch_size`` rows go to an actor at a time. Nothing runs until the Dataset is consumed
    (written, iterated or converted)."""
    kwargs = dict(engine_kwargs or {})
    if "model_path" in kwargs:
        raise ValueError("pass model_path as generate_ray's argument, not in engine_kwargs")
    EngineConfig.from_kwargs(model_path, dict(kwargs))   # every Engine argument checked here, not in an actor
    SamplingParams.from_dict(dict(sampling_params) if sampling_params is not None else None)
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    names = ds.schema().names if ds.schema() is not None else []
    if prompt_column not in names:
        raise ValueError(f"prompt_column {prompt_column!r} is not a column of the dataset (columns: {names})")
    if isinstance(concurrency, tuple):
        if len(concurrency) != 2 or not all(isinstance(c, int) and c >= 1 for c in concurrency) \
                or concurrency[0] > concurrency[1]:
            raise ValueError(f"concurrency must be an int >= 1 or a (min, max) pair, got {concurrency!r}")
    else:
        _check_count("concurrency", concurrency, 1)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    _check_count("num_cpus", num_cpus, 0)
    if num_gpus is None:
        num_gpus = 0 if kwargs.get("device") == "cpu" else int(kwargs.get("tp_size", 1))
    _check_count("num_gpus", num_gpus, 0)
    options = {"param_columns": param_columns, "chat": chat, "system_prompt": system_prompt,
               "return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num, "on_error": on_error,
               "prefix": prefix}
    assert tuple(options) == _ROW_OPTIONS
    from ray.data import ActorPoolStrategy   # Ray is optional: imported when a pipeline is built

    pool = (ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1]) if isinstance(concurrency, tuple)
            else ActorPoolStrategy(size=concurrency))
    return ds.map_batches(
        NbgenGenerator,
        fn_constructor_kwargs={"model_path": model_path, "engine_kwargs": kwargs, "prompt_column": prompt_column,
                               "sampling_params": dict(sampling_params) if sampling_params is not None else None,
                               "options": options},
        batch_format="pandas", batch_size=batch_size, compute=pool,
        num_gpus=num_gpus, num_cpus=num_cpus)

