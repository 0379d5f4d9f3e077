"""Building an engine's loop-side parts: device, resolved config, model runner, scheduler, tokenizer.

``build_engine_parts(cfg)`` runs on the loop thread (it loads the model and sizes the KV cache);
the loop keeps the parts, the Engine facade gets ``EngineParts.info()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from nbgen.core.config import EngineConfig, PriorityConfig, SchedulerConfig
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.scheduler import Scheduler


@dataclass
class EngineParts:
    """What the loop thread owns once the model is loaded."""

    cfg: EngineConfig                 # resolved: no device-dependent None left
    device: torch.device
    runner: ModelRunner
    scheduler_config: SchedulerConfig
    scheduler: Scheduler
    tokenizer: Optional[Any]          # None with skip_tokenizer_init

    def info(self) -> dict[str, Any]:
        """What ``LoopThread.start()`` hands the Engine: device, scheduler config, loaded model."""
        return {"device": str(self.device), "scheduler": self.scheduler_config, "loaded": self.runner.loaded}


def build_engine_parts(cfg: EngineConfig, on_stage: Optional[Callable[[str], None]] = None) -> EngineParts:
    """Resolve the config for its device, load the model, size the KV pool, make the scheduler;
    ``on_stage`` hears the start-up stages (see ``setup_model``)."""
    device = torch.device(cfg.resolve_device())
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    rcfg = cfg.resolved(device.type, total)
    runner = ModelRunner(rcfg, device, on_stage)
    sc = SchedulerConfig(
        page_size=rcfg.page_size, num_pages=runner.num_pages,
        max_running_requests=rcfg.max_running_requests, chunked_prefill_size=rcfg.chunked_prefill_size,
        schedule_policy=rcfg.schedule_policy, disable_radix_cache=rcfg.disable_radix_cache,
        context_length=runner.loaded.context_length, priority=PriorityConfig.of(rcfg))
    return EngineParts(cfg=rcfg, device=device, runner=runner, scheduler_config=sc, scheduler=Scheduler(sc),
                       tokenizer=runner.loaded.tokenizer)


def runner_info(runner: Optional[ModelRunner]) -> dict[str, Any]:
    """The runner's part of ``get_server_info()`` (empty values once the runner is gone)."""
    return {"attention_backend": runner.attention_backend_name if runner else None,
            "cuda_graph_batch_sizes": list(getattr(runner, "cuda_graph_batch_sizes", []) or []),
            "piecewise_cuda_graph_tokens": list(getattr(runner, "piecewise_cuda_graph_tokens", []) or []),
            "startup_s": dict(getattr(runner, "startup_s", {}) or {}),
            "norms_folded": bool(getattr(runner, "norms_folded", False))}
