"""SGLang's server arguments by one rule (implemented / no effect / refused), the arguments this issue
implements (stream_interval, chat_template, allow_auto_truncate, max_prefill_tokens,
served_model_name, enable_torch_compile, grammar_backend), get_server_info and SGLang's meta_info keys,
on the tiny Llama (CPU)."""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

import nbgen
from nbgen.core.chat_template import apply_chat_template_arg
from nbgen.core.config import EngineConfig
from nbgen.core.server_args import (SERVER_ARGS, STATUS_IMPLEMENTED, STATUS_NO_EFFECT, STATUS_REFUSED,
                                    markdown_table)

GREEDY = {"temperature": 0.0, "ignore_eos": True}
DEVICE = os.environ.get("NBGEN_TEST_DEVICE", "cpu")
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def _nbgen_warnings(records: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in records if "no effect" in str(w.message)]


# ---- the table --------------------------------------------------------------------------------
def test_every_engine_argument_is_an_implemented_sglang_name_or_nbgen_own() -> None:
    own = {f.name for f in fields(EngineConfig)}
    implemented = {n for n, a in SERVER_ARGS.items() if a.status == STATUS_IMPLEMENTED}
    # the SGLang names among EngineConfig's fields are exactly the implemented ones (the rest are nbgen's own)
    assert implemented == own & set(SERVER_ARGS), "update IMPLEMENTED in nbgen/core/server_args_data.py"
    assert {"max_priority_bypass", "allow_context_overflow"} <= own - set(SERVER_ARGS)
    assert {a.status for a in SERVER_ARGS.values()} == {STATUS_IMPLEMENTED, STATUS_NO_EFFECT, STATUS_REFUSED}
    assert all(a.note for a in SERVER_ARGS.values() if a.status != STATUS_IMPLEMENTED)
    for name in ("host", "port", "api_key", "log_requests", "enable_metrics", "tokenizer_worker_num"):
        assert SERVER_ARGS[name].status == STATUS_NO_EFFECT
    for name in ("speculative_token_map", "modelopt_quant", "pp_size", "enable_hierarchical_cache"):
        assert SERVER_ARGS[name].status == STATUS_REFUSED


def test_docs_table_is_the_generated_one() -> None:
    docs = Path(__file__).resolve().parents[1] / "docs" / "server_args.md"
    assert docs.read_text() == markdown_table(), (
        "regenerate: python -c \"from nbgen.core.server_args import markdown_table; "
        "print(markdown_table(), end='')\" > docs/server_args.md")


def test_no_effect_arguments_are_taken_with_one_warning_naming_them() -> None:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cfg = EngineConfig.from_kwargs(None, {"host": "0.0.0.0", "port": 30001, "api_key": "k",
                                              "enable_metrics": True, "max_running_requests": 3})
    msgs = _nbgen_warnings(rec)
    assert len(msgs) == 1 and all(n in msgs[0] for n in ("host", "port", "api_key", "enable_metrics"))
    assert cfg.max_running_requests == 3
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        EngineConfig.from_kwargs(None, {"max_running_requests": 3})
    assert _nbgen_warnings(rec) == []


@pytest.mark.parametrize("name, value", [("enable_hierarchical_cache", True), ("speculative_algorithm", "NEXTN"),
                                         ("pp_size", 2), ("modelopt_quant", "fp8"),
                                         ("cuda_graph_max_bs_decode", 64), ("reasoning_parser", "qwen3")])
def test_refused_arguments_raise_naming_them(tiny_llama_dir: str, name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"{name} is not supported yet by nbgen"):
        nbgen.Engine(tiny_llama_dir, device="cpu", **{name: value})


@pytest.mark.parametrize("name, value", [("kv_cache_dtype", "fp8_e5m2"), ("quantization", "awq")])
def test_unsupported_quantization_values_raise_naming_the_parameter(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_kwargs(None, {name: value})


def test_refused_arguments_with_sglang_default_are_accepted_silently() -> None:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        EngineConfig.from_kwargs(None, {"pp_size": 1, "kv_cache_dtype": "auto", "quantization": None,
                                        "enable_hierarchical_cache": False, "schedule_conservativeness": 1.0,
                                        "radix_eviction_policy": "lru", "speculative_algorithm": None,
                                        "grammar_backend": "xgrammar"})
    assert _nbgen_warnings(rec) == []
    with pytest.raises(ValueError, match="pp_size is not supported yet"):
        EngineConfig.from_kwargs(None, {"pp_size": True})   # a bool is not SGLang's default 1


def test_unknown_names_suggest_the_closest(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="did you mean 'stream_interval'"):
        nbgen.Engine(tiny_llama_dir, stream_intervall=2)
    with pytest.raises(ValueError, match="did you mean 'enable_hierarchical_cache'"):
        EngineConfig.from_kwargs(None, {"enable_hierarchical_cach": True})


@pytest.mark.parametrize("kw, match", [({"stream_interval": 0}, "stream_interval"),
                                       ({"max_prefill_tokens": 0}, "max_prefill_tokens"),
                                       ({"served_model_name": 3}, "served_model_name"),
                                       ({"allow_auto_truncate": "yes"}, "allow_auto_truncate"),
                                       ({"enable_torch_compile": 1}, "enable_torch_compile"),
                                       ({"grammar_backend": "outlines"}, "grammar_backend='outlines' is not supported"),
                                       ({"grammar_backend": "llguidance"}, "llguidance"),
                                       ({"grammar_backend": "xgrammar2"}, "grammar_backend"),
                                       ({"chat_template": "missing/tpl.jinja"}, "chat_template file"),
                                       ({"chat_template": 5}, "chat_template")])
def test_bad_values_raise_before_loading(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(None, kw)


# ---- one engine with the implemented arguments -------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def eng(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory):
    tpl = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    tpl.write_text(TEMPLATE + "\n")
    logs = _Records()
    logging.getLogger("nbgen").addHandler(logs)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            e = nbgen.Engine(tiny_llama_dir, dtype="float32", device=DEVICE, random_seed=0, log_level="info",
                             host="0.0.0.0", port=30001, log_requests=True, stream_interval=3,
                             chat_template=str(tpl), served_model_name="tiny-served", enable_torch_compile=True,
                             context_length=64, allow_auto_truncate=True, max_prefill_tokens=48,
                             chunked_prefill_size=256, grammar_backend="none", kv_cache_dtype="auto")
    finally:
        logging.getLogger("nbgen").removeHandler(logs)
    e.test_warnings = _nbgen_warnings(rec)
    e.test_logs = logs.lines
    yield e
    e.shutdown()


def test_engine_warns_once_and_logs_torch_compile_once(eng) -> None:
    assert len(eng.test_warnings) == 1
    assert "host, port" in eng.test_warnings[0] and "log_requests" in eng.test_warnings[0]
    assert sum("enable_torch_compile" in line for line in eng.test_logs) == 1


def test_stream_interval(eng, tiny_engine) -> None:
    p = {**GREEDY, "max_new_tokens": 10}
    chunks = list(eng.generate("hello there", p, stream=True))
    # the first token at once, then every 3 new tokens; the finish at once (its chunk has every id)
    assert [len(c["output_ids"]) for c in chunks[:-1]] == [1, 3, 3]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    full = eng.generate("hello there", p)
    assert "".join(c["text"] for c in chunks) == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    per_request = list(eng.generate("hello there", {**p, "stream_interval": 1}, stream=True))
    assert [len(c["output_ids"]) for c in per_request[:-1]] == [1] * 9
    default = list(tiny_engine.generate("hello there", p, stream=True))   # the engine default is 1
    assert len(default) == 10
    with pytest.raises(ValueError, match="stream_interval"):
        eng.generate("hello", {"stream_interval": 0})
    stop = list(eng.generate("hello there", {**p, "stop": [full["text"][-3:]]}, stream=True))
    assert "".join(c["text"] for c in stop) == eng.generate("hello there", {**p, "stop": [full["text"][-3:]]})["text"]


def test_chat_template_file(eng, tiny_engine) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    assert eng.apply_chat_template(msgs) == "[user] Hi\n[assistant]"
    assert tiny_engine.apply_chat_template(msgs).startswith("<|im_start|>user")   # the model's own
    out = eng.chat(msgs, {**GREEDY, "max_new_tokens": 3})
    assert out["output_ids"] == eng.generate("[user] Hi\n[assistant]", {**GREEDY, "max_new_tokens": 3})["output_ids"]


class _Tok:
    chat_template: Any = None


def test_chat_template_string_and_names() -> None:
    tok = _Tok()
    tok.chat_template = "{{ 'x' }}"
    apply_chat_template_arg(tok, TEMPLATE)
    assert tok.chat_template == TEMPLATE
    tok.chat_template = {"default": "{{ 'd' }}", "tool_use": "{{ 't' }}"}
    apply_chat_template_arg(tok, "tool_use")
    assert tok.chat_template == "{{ 't' }}"
    tok.chat_template = "{{ 'only' }}"
    apply_chat_template_arg(tok, "default")
    assert tok.chat_template == "{{ 'only' }}"
    with pytest.raises(ValueError, match="chat_template 'chatml' is not a file.*'default'"):
        apply_chat_template_arg(tok, "chatml")


def test_chat_template_unknown_name_fails_at_start(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="chat_template 'llama-3-instruct'"):
        nbgen.Engine(tiny_llama_dir, device="cpu", chat_template="llama-3-instruct")


def test_allow_auto_truncate(eng, tiny_engine) -> None:
    ids = [5 + i % 300 for i in range(100)]                       # past the context of 64
    out = eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 10})
    assert out["meta_info"]["prompt_tokens"] == 63 and out["meta_info"]["completion_tokens"] == 1
    assert out["output_ids"] == tiny_engine.generate(input_ids=ids[:63],
                                                     sampling_params={**GREEDY, "max_new_tokens": 1})["output_ids"]
    short = eng.generate(input_ids=ids[:50], sampling_params={**GREEDY, "max_new_tokens": 30})
    assert short["meta_info"]["completion_tokens"] == 14          # cut at the context length
    with pytest.raises(ValueError, match="context length"):
        tiny_engine.generate(input_ids=[5] * 1100, sampling_params={"max_new_tokens": 1})


def test_max_prefill_tokens_caps_the_step_budget(eng, tiny_engine) -> None:
    info = eng.get_server_info()
    assert info["max_prefill_tokens"] == 48 and info["chunked_prefill_size"] == 256
    assert info["step_token_budget"] == 48 == eng.scheduler_config.chunked_prefill_size
    assert tiny_engine.get_server_info()["step_token_budget"] == 1024      # CPU default, under 16384
    ids = [7 + i % 200 for i in range(60)]                         # two prefill chunks of at most 48
    p = {**GREEDY, "max_new_tokens": 3}
    assert eng.generate(input_ids=ids, sampling_params=p)["output_ids"] == \
        tiny_engine.generate(input_ids=ids, sampling_params=p)["output_ids"]


def test_served_model_name(eng, tiny_engine) -> None:
    assert eng.model_name == "tiny-served" == eng.get_server_info()["served_model_name"]
    assert eng.get_model_info()["served_model_name"] == "tiny-served"
    board = nbgen.dashboard(eng, widget=False, display=False)
    try:
        assert board.title.startswith("nbgen · tiny-served")
    finally:
        board.stop()
    assert tiny_engine.get_model_info()["served_model_name"] == tiny_engine.config.model_path   # SGLang's rule


def test_grammar_backend_none_refuses_structured_output(eng) -> None:
    for key, value in (("json_schema", '{"type": "object"}'), ("regex", "[ab]+"), ("ebnf", 'root ::= "a"')):
        with pytest.raises(ValueError, match="grammar_backend='none'"):
            eng.generate("x", {key: value, "max_new_tokens": 2})
    assert eng.generate("x", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


# ---- get_server_info and meta_info ------------------------------------------------------------
def test_get_server_info_as_sglang(eng) -> None:
    info = eng.get_server_info()
    for f in fields(EngineConfig):
        assert f.name in info
    assert info["version"] == nbgen.__version__ and info["status"] == "ready"
    assert info["max_req_input_len"] == 63 and info["max_total_num_tokens"] == info["max_total_tokens"]
    assert info["device"] == "cpu" and info["stream_interval"] == 3 and info["grammar_backend"] == "none"
    for key in ("model_name", "num_pages", "page_size", "attention_backend", "startup_s", "norms_folded",
                "cuda_graph_batch_sizes", "weight_version", "random_seed"):
        assert key in info
    (state,) = info["internal_states"]
    assert state["stream_interval"] == 3 and state["world_size"] == 1
    assert state["effective_max_running_requests_per_dp"] == info["max_running_requests"]
    assert isinstance(state["last_gen_throughput"], float)
    assert set(state["memory_usage"]) == {"weight", "kvcache", "token_capacity"}
    assert state["memory_usage"]["token_capacity"] == info["max_total_tokens"]
    assert set(info["startup_time"]) == {"load_weight", "kv_cache_allocation", "cuda_graph", "scheduler_e2e"}


def test_meta_info_keys(tiny_engine) -> None:
    meta = tiny_engine.generate("hello", {**GREEDY, "max_new_tokens": 2})["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens",
                "num_retractions", "weight_version", "e2e_latency"):
        assert key in meta
    assert meta["reasoning_tokens"] == 0 and meta["num_retractions"] == 0


def test_num_retractions_counts_preemptions(tiny_llama_dir: str) -> None:
    """Two requests of 40 tokens in a 64-token KV cache: the newer one is preempted, then resumes."""
    prompts = [[5 + i for i in range(10)], [50 + i for i in range(10)]]
    p = {**GREEDY, "max_new_tokens": 30}
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", max_total_tokens=64,
                      max_running_requests=2) as e:
        outs = e.generate(input_ids=prompts, sampling_params=p, use_tqdm=False)
        assert sorted(o["meta_info"]["num_retractions"] for o in outs) == [0, 1]
        alone = [e.generate(input_ids=ids, sampling_params=p)["output_ids"] for ids in prompts]
        assert [o["output_ids"] for o in outs] == alone


def test_skip_tokenizer_init_outputs_have_no_text(tiny_llama_dir: str) -> None:
    p = {**GREEDY, "max_new_tokens": 4}
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", skip_tokenizer_init=True) as e:
        out = e.generate(input_ids=[5, 6, 7], sampling_params=p)
        assert set(out) == {"output_ids", "meta_info"} and len(out["output_ids"]) == 4
        chunks = list(e.generate(input_ids=[5, 6, 7], sampling_params=p, stream=True))
        assert all("text" not in c for c in chunks) and chunks[-1]["output_ids"] == out["output_ids"]
