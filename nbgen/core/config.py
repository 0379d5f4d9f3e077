"""Engine configuration: SGLang server-arg names, validated at the edge."""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, fields
from typing import Any, Optional

from nbgen.core.chat_template import check_chat_template
from nbgen.core.config_values import apply_sglang_defaults, check_values
from nbgen.core.scheduler_config import PriorityConfig, is_int
from nbgen.core.spec_config import SpecConfig
from nbgen.core.server_args import no_effect_message, split_engine_kwargs, unknown_key_error

__all__ = ["EngineConfig", "unknown_key_error"]

_LORA_BACKENDS = ("csgmv", "triton", "torch_native")   # all served by nbgen's torch path for now
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PIECEWISE_MAX_TOKENS = 8192   # the largest token bucket of the piecewise prefill graphs by default


@dataclass
class EngineConfig:
    """Every knob of an Engine (names follow SGLang's server args).

    ``None`` means "choose for this device": ``resolved(device_type, gpu_total_memory)`` returns a
    copy with those defaults filled in, once, when the loop knows its device.
    """

    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    quantization: Optional[str] = None     # "fp8": e4m3 weights per output feature (models/fp8_linear.py)
    kv_cache_dtype: str = "auto"           # "fp8_e4m3": the KV pool in e4m3 (attention/kv_quant.py)
    context_length: Optional[int] = None
    mem_fraction_static: float = 0.85     # None (SGLang's default): 0.85
    # GiB of weights kept in pinned host memory, copied in layer by layer each step (models/cpu_offload.py)
    cpu_offload_gb: float = 0
    max_running_requests: Optional[int] = None
    max_queued_requests: Optional[int] = None
    max_total_tokens: Optional[int] = None
    chunked_prefill_size: Optional[int] = None
    # 16 tokens a page: page tables stay 16x shorter than token lists (cheap per-step metadata),
    # a prefix match loses at most 15 tokens, and flashinfer's paged kernels run well at this size.
    page_size: int = 16
    # None: SGLang's "fcfs", except a large model's offline batches on a GPU when chunked_prefill_size is
    # also left to nbgen: longest output first with decode-aware prefill pacing (runtime/prefill_pacing.py)
    schedule_policy: Optional[str] = None
    # priority scheduling (SGLang; runtime/priority.py): generate(..., priority=k) orders the waiting
    # queue, and a waiting request preempts running ones less important by more than the threshold
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    default_priority_value: Optional[int] = None
    abort_on_priority_when_disabled: bool = False
    max_priority_bypass: Optional[int] = 32   # nbgen: the starvation guard; None = strict priority
    disable_radix_cache: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: Optional[int] = None
    # steps with prefill chunks as graph pieces around an eager attention (runtime/prefill_graphs.py)
    disable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: Optional[int] = None   # None: the chunk budget, at most 8192
    disable_overlap_schedule: bool = False
    attention_backend: Optional[str] = None
    random_seed: int = 0                  # None (SGLang's default): a random seed, as SGLang draws
    log_level: str = "warning"           # a logging level name, any case
    skip_tokenizer_init: bool = False
    tp_size: int = 1       # tensor parallelism: ranks sharding the model (runtime/tp_group.py)
    dp_size: int = 1       # data parallelism: replicas behind one Engine (runtime/dp_loop.py)
    disable_custom_all_reduce: bool = False   # tensor parallelism: NCCL for every size (models/all_reduce.py)
    base_gpu_id: int = 0   # the first GPU this engine uses (rank 0 of replica 0)
    enable_custom_logit_processor: bool = False
    allow_context_overflow: bool = False  # truncate instead of raising when prompt+max_new_tokens > context
    # grammar requests append the text their grammar forces next in one chunk (runtime/jump_forward.py)
    enable_jump_forward: bool = False
    trust_remote_code: bool = False
    # an embedding engine: encode() pools the final hidden states (prefill only); generate() is refused
    is_embedding: bool = False
    # SGLang's name for the loaded weights, reported in outputs' meta_info; weight updates may rename it
    weight_version: str = "default"
    # SGLang: generate(return_hidden_states=True) is refused unless the Engine enables it
    enable_return_hidden_states: bool = False
    # SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB: output logprobs without the temperature division
    return_original_logprob: bool = False
    # a streamed request gets a chunk every stream_interval new tokens (its first token and its finish at once)
    stream_interval: int = 1
    chat_template: Optional[str] = None   # a .jinja file, a Jinja string or a tokenizer's named template
    allow_auto_truncate: bool = False     # a prompt past the context keeps its first tokens instead of raising
    max_prefill_tokens: int = 16384       # caps the tokens of one step together with chunked_prefill_size
    served_model_name: Optional[str] = None   # the model name get_server_info / get_model_info report
    enable_torch_compile: bool = False    # nbgen's fused kernels and CUDA graphs stand in (one info log)
    grammar_backend: Optional[str] = None     # None / "xgrammar"; "none": structured output is refused
    # LoRA serving (SGLang's names; docs/lora.md): peft adapters, several in one batch
    enable_lora: Optional[bool] = None           # None: on when lora_paths is given
    # ["path" | "name=path" | {"lora_name", "lora_path", "pinned"}] or {name: path}; normalised to dicts
    lora_paths: Optional[Any] = None
    max_loras_per_batch: int = 8
    max_loaded_loras: Optional[int] = None       # None: no limit (SGLang); a batch's adapters share GPU slots
    max_lora_rank: Optional[int] = None          # None: any rank
    lora_target_modules: Optional[Any] = None    # None: any of LORA_TARGET_MODULES; "all": all of them
    lora_backend: str = "csgmv"
    # speculative decoding (core/spec_config.py, runtime/spec_*.py; SGLang's names): NGRAM or STANDALONE
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_ngram_max_trie_depth: int = 18

    def __post_init__(self) -> None:
        apply_sglang_defaults(self)
        check_values(self)
        check_chat_template(self.chat_template)
        PriorityConfig.of(self)   # validates the priority arguments
        self._check_lora()
        if self.tp_size > 1 and self.enable_lora:
            raise ValueError("enable_lora needs tp_size 1 (LoRA adapters are not sharded over ranks)")
        if self.dp_size > 1 and self.tp_size > 1:
            raise ValueError("dp_size > 1 needs tp_size 1 (a process holds one tensor-parallel group); for "
                             "replicas of a sharded model use nbgen.ray.generate_ray with engine_kwargs={'tp_size': N}")
        if self.dp_size > 1 and self.enable_lora:
            raise ValueError("enable_lora needs dp_size 1 (adapters are loaded into one replica)")
        if self.cpu_offload_gb and (self.enable_lora or self.tp_size > 1):
            raise ValueError("cpu_offload_gb needs tp_size 1 and no enable_lora (offloaded layers share "
                             "their device buffers, which sharding and adapter hooks do not)")
        spec = SpecConfig.of(self)                 # validates the speculative_* arguments
        if spec is not None:
            self.speculative_algorithm = spec.algorithm
            if self.enable_jump_forward:
                raise ValueError("enable_jump_forward cannot be combined with speculative_algorithm "
                                 "(a jump rewrites the tokens a verify step drafts on)")

    def _check_lora(self) -> None:
        """Validate the LoRA arguments; ``lora_paths`` becomes a list of dicts, ``enable_lora`` a bool."""
        self.lora_paths = normalize_lora_paths(self.lora_paths)
        if self.enable_lora is False and self.lora_paths:
            raise ValueError("enable_lora=False contradicts lora_paths (adapters need enable_lora=True)")
        if self.enable_lora not in (None, True, False):
            raise ValueError(f"enable_lora must be None or a bool, got {self.enable_lora!r}")
        self.enable_lora = bool(self.enable_lora or self.lora_paths)
        for name in ("max_loras_per_batch", "max_loaded_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not (v is None and name != "max_loras_per_batch") and not (is_int(v) and v >= 1):
                raise ValueError(f"{name} must be an int >= 1{' or None' if name != 'max_loras_per_batch' else ''}"
                                 f", got {v!r}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"max_loaded_loras={self.max_loaded_loras} must be >= max_loras_per_batch="
                             f"{self.max_loras_per_batch}")
        if self.lora_backend not in _LORA_BACKENDS:
            raise ValueError(f"lora_backend must be one of {_LORA_BACKENDS}, got {self.lora_backend!r}")
        t = self.lora_target_modules
        if t == "all" or t == ["all"]:
            self.lora_target_modules = list(LORA_TARGET_MODULES)
        elif t is not None:
            if isinstance(t, str) or not isinstance(t, (list, tuple, set)) or \
                    not all(m in LORA_TARGET_MODULES for m in t):
                raise ValueError(f"lora_target_modules must be None, 'all' or a list drawn from "
                                 f"{list(LORA_TARGET_MODULES)}, got {t!r}")
            self.lora_target_modules = sorted(t)

    @classmethod
    def from_kwargs(cls, model_path: Optional[str], kwargs: dict[str, Any]) -> "EngineConfig":
        """Build from Engine(**kwargs) by the server-args rule (core/server_args.py): SGLang arguments
        with no effect here are taken with one warning naming them; refused ones and unknown names
        raise ValueError (an unknown name with the closest known one)."""
        own, ignored = split_engine_kwargs(kwargs, [f.name for f in fields(cls)])
        if ignored:
            warnings.warn(no_effect_message(ignored), UserWarning, stacklevel=3)
        return cls(model_path=model_path, **own)

    def resolved(self, device_type: str, gpu_total_memory: Optional[int] = None) -> "EngineConfig":
        """A copy with every device-dependent ``None`` default chosen (``device_type``: "cuda" | "cpu";
        ``gpu_total_memory``: the card's bytes, on cuda):

        - ``max_running_requests``: 256 on cuda, 64 on cpu;
        - ``chunked_prefill_size``: 8192 on cuda, 1024 on cpu;
        - ``cuda_graph_max_bs``: 256 on a card of >= 40 GiB, 128 from 16 GiB, else 64, three times that
          with ``enable_jump_forward``; 0 (no decode graphs) on cpu or with ``disable_cuda_graph``;
        - ``piecewise_cuda_graph_max_tokens``: ``min(step_token_budget, 8192)``;
        - ``schedule_policy``: "fcfs" (the engine may pace a large model instead: runtime/engine_parts.py).
        """
        gpu = device_type == "cuda"
        out = copy.copy(self)   # values below are valid by construction (0 graphs is not a user value)
        if out.max_running_requests is None:
            out.max_running_requests = 256 if gpu else 64
        if out.chunked_prefill_size is None:
            out.chunked_prefill_size = 8192 if gpu else 1024
        if out.schedule_policy is None:
            out.schedule_policy = "fcfs"
        if out.cuda_graph_max_bs is None:
            if not gpu or out.disable_cuda_graph:
                out.cuda_graph_max_bs = 0
            else:
                total = gpu_total_memory or 0
                out.cuda_graph_max_bs = 256 if total >= 40 << 30 else (128 if total >= 16 << 30 else 64)
                if out.enable_jump_forward:   # forced tokens join decode steps as rows (runtime/forced_rows.py)
                    out.cuda_graph_max_bs *= 3   # a batch's decode rows and its waves of forced rows
        if out.speculative_algorithm is not None:   # as SGLang: verify steps run without overlap
            out.disable_overlap_schedule = True
        if out.piecewise_cuda_graph_max_tokens is None:
            out.piecewise_cuda_graph_max_tokens = min(out.step_token_budget, PIECEWISE_MAX_TOKENS)
        return out

    @property
    def step_token_budget(self) -> int:
        """The tokens one step may compute (resolved configs): chunked_prefill_size capped by
        max_prefill_tokens (SGLang's cap on the tokens of one prefill batch)."""
        return min(self.chunked_prefill_size, self.max_prefill_tokens)

    def resolve_device(self) -> str:
        """'cuda' or 'cpu' for device='auto'."""
        if self.device != "auto":
            return self.device
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:  # pragma: no cover - torch is a hard dependency
            return "cpu"


def normalize_lora_paths(paths: Any) -> list[dict[str, Any]]:
    """SGLang's ``lora_paths`` forms -> [{"lora_name", "lora_path", "pinned"}]: a list of "path"
    (named after itself), "name=path" or dicts, or a {name: path} dict; ValueError naming lora_paths."""
    if paths is None:
        return []
    items = [{"lora_name": k, "lora_path": v} for k, v in paths.items()] if isinstance(paths, dict) else paths
    if isinstance(items, str) or not isinstance(items, (list, tuple)):
        raise ValueError(f"lora_paths must be a list (of 'path', 'name=path' or dicts) or a {{name: path}} "
                         f"dict, got {paths!r:.80}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
            item = {"lora_name": name, "lora_path": path}
        if not isinstance(item, dict) or not isinstance(item.get("lora_name"), str) or not item["lora_name"] \
                or not isinstance(item.get("lora_path"), str) or not item["lora_path"] \
                or not isinstance(item.get("pinned", False), bool) \
                or set(item) - {"lora_name", "lora_path", "pinned"}:
            raise ValueError(f"lora_paths[{i}] must be 'path', 'name=path' or {{'lora_name': str, 'lora_path': "
                             f"str, 'pinned': bool}}, got {item!r:.80}")
        out.append({"lora_name": item["lora_name"], "lora_path": item["lora_path"],
                    "pinned": bool(item.get("pinned", False))})
    names = [d["lora_name"] for d in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"lora_paths names adapters more than once: {dup}")
    return out
