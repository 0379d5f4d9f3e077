"""Building an engine's loop-side parts: device, resolved config, model runner, scheduler, tokenizer.

``build_engine_parts(cfg)`` runs on the loop thread (it loads the model and sizes the KV cache);
the loop keeps the parts, the Engine facade gets ``EngineParts.info()``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from nbgen.core.config import EngineConfig
from nbgen.core.scheduler_config import PriorityConfig, SchedulerConfig
from nbgen.runtime.forced_rows import forced_token_rows
from nbgen.runtime.prefill_pacing import pacing_tokens
from nbgen.runtime.runner import ModelRunner
from nbgen.models.parallel_state import tp_scope
from nbgen.models.cpu_offload import OffloadPlan
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.tp_group import TPGroup, start_tp

logger = logging.getLogger("nbgen")


@dataclass
class EngineParts:
    """What the loop thread owns once the model is loaded."""

    cfg: EngineConfig                 # resolved: no device-dependent None left
    device: torch.device
    runner: ModelRunner
    scheduler_config: SchedulerConfig
    scheduler: Scheduler
    tokenizer: Optional[Any]          # None with skip_tokenizer_init
    tp: Optional[TPGroup] = None      # tensor parallelism (tp_size > 1): the worker ranks

    def info(self) -> dict[str, Any]:
        """What ``LoopThread.start()`` hands the Engine: device, scheduler config, loaded model, and
        the resolved config."""
        return {"device": str(self.device), "scheduler": self.scheduler_config, "loaded": self.runner.loaded,
                "config": self.cfg}


def build_engine_parts(cfg: EngineConfig, on_stage: Optional[Callable[[str], None]] = None) -> EngineParts:
    """Resolve the config for its device, load the model, size the KV pool, make the scheduler;
    ``on_stage`` hears the start-up stages (see ``setup_model``)."""
    device = torch.device(cfg.resolve_device())
    if device.type == "cuda" and cfg.base_gpu_id:
        device = torch.device("cuda", cfg.base_gpu_id)   # a data-parallel replica's GPU, or the user's
        torch.cuda.set_device(device)   # this loop thread's kernels launch there
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    rcfg = cfg.resolved(device.type, total)
    if rcfg.enable_torch_compile:
        logger.info("enable_torch_compile: nbgen runs its own fused kernels and CUDA graphs in the place of "
                    "torch.compile; the model is not compiled and outputs are unchanged")
    tp = start_tp(rcfg, device)
    try:
        with tp_scope(rcfg.tp_size, 0):
            runner = ModelRunner(rcfg, device, on_stage)
        if tp is not None:
            tp.wait_ready()
            tp.attach(runner)
    except BaseException:
        if tp is not None:
            tp.shutdown()
        raise
    # neither set by the user: a large model on a GPU paces its prefill, longest outputs first
    pacing = pacing_tokens(int(memory_usage(runner)["weight"] * (1 << 30)), device.type == "cuda") \
        if cfg.schedule_policy is None and cfg.chunked_prefill_size is None else 0
    sc = SchedulerConfig(
        page_size=rcfg.page_size, num_pages=runner.num_pages,
        max_running_requests=rcfg.max_running_requests, chunked_prefill_size=rcfg.step_token_budget,
        schedule_policy="lof" if pacing else rcfg.schedule_policy, prefill_pacing_min_tokens=pacing,
        disable_radix_cache=rcfg.disable_radix_cache,
        context_length=runner.loaded.context_length, max_queued_requests=rcfg.max_queued_requests,
        priority=PriorityConfig.of(rcfg), forced_token_rows=forced_token_rows(rcfg))
    return EngineParts(cfg=rcfg, device=device, runner=runner, scheduler_config=sc,
                       scheduler=Scheduler(sc, runner.lora.batch_limit if runner.lora is not None else None),
                       tokenizer=runner.loaded.tokenizer, tp=tp)


def runner_info(runner: Optional[ModelRunner]) -> dict[str, Any]:
    """The runner's part of ``get_server_info()`` (empty values once the runner is gone)."""
    return {"attention_backend": runner.attention_backend_name if runner else None,
            "cuda_graph_batch_sizes": list(getattr(runner, "cuda_graph_batch_sizes", []) or []),
            "piecewise_cuda_graph_tokens": list(getattr(runner, "piecewise_cuda_graph_tokens", []) or []),
            "startup_s": dict(getattr(runner, "startup_s", {}) or {}),
            "norms_folded": bool(getattr(runner, "norms_folded", False)),
            "cpu_offload": offload_info(getattr(runner, "cpu_offload", None)),
            # CPU linears with a 4-bit copy for steps of a few rows (models/cpu_int4.py: GGUF Q4 weights)
            "int4_linears": sum(getattr(m, "int4", None) is not None for m in runner.model.modules()) if runner else 0,
            # the LM head's int8 copy for steps of a few rows (models/cpu_int8.py: a GGUF Q8_0 output matrix)
            "int8_linears": sum(getattr(m, "int8", None) is not None for m in runner.model.modules()) if runner else 0,
            "memory_usage": memory_usage(runner) if runner else {},
            # an fp8 KV pool's per-layer [k_scale, v_scale] (the checkpoint's, else 1.0; models/kv_scales.py)
            "kv_scales": [list(runner.kv_spec.scales(i)) for i in range(runner.kv_spec.num_layers)]
            if runner and runner.kv_spec.kv_dtype is not None else []}


def offload_info(plan: Optional[OffloadPlan]) -> dict[str, Any]:
    """The offloaded layers and their host / device-staging GiB ({} without cpu_offload_gb)."""
    if plan is None:
        return {}
    return {"layers": list(plan.layers), "host_gb": round(plan.host_bytes / (1 << 30), 6),
            "staging_gb": round(plan.staging_bytes / (1 << 30), 6)}


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of the model's parameters and buffers on the runner's device (each storage once)."""
    model = runner.model
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers()) if t.device.type == runner.device.type}
    return sum(storages.values())


def memory_usage(runner: ModelRunner) -> dict[str, Any]:
    """SGLang's ``memory_usage`` of the internal state: weights (on the device; each storage once) and KV
    pool in GB, KV capacity in tokens."""
    weights = weight_bytes(runner)
    spec = runner.kv_spec
    return {"weight": round(weights / (1 << 30), 2),
            "kvcache": round(spec.bytes_per_page() * spec.num_pages / (1 << 30), 2),
            "token_capacity": (spec.num_pages - 1) * spec.page_size}
