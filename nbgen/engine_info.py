"""Engine information calls (SGLang's): ``get_server_info`` and ``get_model_info``.

``get_server_info()`` is SGLang's dict: every server argument (the resolved ``EngineConfig``, SGLang's
names), ``status``, ``max_total_num_tokens``, ``max_req_input_len``, ``version``, and
``internal_states`` (one dict per scheduler: nbgen has one); nbgen's own facts (``model_name``,
``num_pages``, ``startup_s``, ``cuda_graph_batch_sizes``, ...) sit beside them, and where a name is
both, the engine's resolved value is reported (``device`` is ``"cuda"`` rather than ``"auto"``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from nbgen.core.config import EngineConfig
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.core.version import __version__


def _startup_time(startup_s: dict[str, float]) -> dict[str, Any]:
    """nbgen's start-up phases in the shape of SGLang's ``startup_time``."""
    return {"load_weight": startup_s.get("load_model", 0.0), "kv_cache_allocation": startup_s.get("kv_cache", 0.0),
            "cuda_graph": {"decode": startup_s.get("cuda_graphs", 0.0),
                           "prefill": startup_s.get("prefill_graphs", 0.0)},
            "scheduler_e2e": round(sum(startup_s.values()), 2)}


class InfoMixin:
    """get_server_info / get_model_info for Engine (uses its config, scheduler config, facts and loop)."""

    config: EngineConfig
    resolved_config: EngineConfig
    scheduler_config: SchedulerConfig
    _images: Any   # the vision preprocessing of a vision-language model, else None

    @property
    def served_model_name(self) -> str:
        """The name the engine serves its model under: ``served_model_name``, else the model path
        (SGLang's rule)."""
        return self.config.served_model_name or str(self.config.model_path)

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer comes from: ``tokenizer_path``, else the model path (SGLang's rule)."""
        return self.config.tokenizer_path or str(self.config.model_path)

    def get_server_info(self) -> dict[str, Any]:
        """The server arguments, the engine's resolved facts, ``internal_states`` and ``version``."""
        sc = self.scheduler_config
        args = dataclasses.asdict(self.resolved_config)
        args.update(model_path=self.config.model_path, load_format=self.config.load_format,
                    tokenizer_path=self.tokenizer_path, served_model_name=self.served_model_name,
                    weight_version=self.weight_version)
        runner = self._loop.server_info()
        capacity = (sc.num_pages - 1) * sc.page_size
        facts = {"model_name": self.model_name, "device": self.device, "dtype": str(self.dtype),
                 "context_length": self._facts.context_length, "page_size": sc.page_size,
                 "num_pages": sc.num_pages, "max_total_tokens": capacity,
                 "max_running_requests": sc.max_running_requests, "step_token_budget": sc.chunked_prefill_size,
                 "schedule_policy": sc.schedule_policy, "disable_radix_cache": sc.disable_radix_cache,
                 "prefill_pacing_min_tokens": sc.prefill_pacing_min_tokens, **runner}
        internal = {**args, **facts,
                    "last_gen_throughput": self._loop.stats().get("output_tok_s", 0.0),
                    # SGLang's name for the engine's mean tokens per verify step (speculative engines)
                    "avg_spec_accept_length": self._loop.stats().get("spec_accept_length", 0.0),
                    "effective_max_running_requests_per_dp": sc.max_running_requests, "world_size": 1,
                    "startup_time": _startup_time(runner.get("startup_s", {}))}
        return {**args, **facts, "status": "ready", "max_total_num_tokens": capacity,
                "max_req_input_len": self._facts.context_length - 1,
                "startup_time": internal["startup_time"], "avg_spec_accept_length": internal["avg_spec_accept_length"],
                "internal_states": [internal], "version": __version__}

    def get_model_info(self) -> dict[str, Any]:
        """What the engine serves: SGLang's keys (model and tokenizer paths, generation or embedding,
        model type and architectures, image / audio input) and nbgen's sizes."""
        return {"model_path": self.config.model_path, "served_model_name": self.served_model_name,
                "tokenizer_path": self.tokenizer_path, "is_generation": not self.config.is_embedding,
                "model_type": getattr(self.hf_config, "model_type", None),
                "architectures": list(self.hf_config.architectures or []),
                "has_image_understanding": self._images is not None, "has_audio_understanding": False,
                # SGLang's server-side sampling defaults (preferred_sampling_params): nbgen takes none
                "preferred_sampling_params": None,
                "vocab_size": self._facts.vocab_size, "context_length": self._facts.context_length,
                "weight_version": self.weight_version, "load_format": self.config.load_format,
                # SGLang's parsers of reasoning and tool calls: nbgen has none (the arguments take None only)
                "reasoning_parser": None, "tool_call_parser": None}
