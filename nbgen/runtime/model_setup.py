"""Model setup for the runner: load, size the KV cache, choose the attention backend, fold norms,
capture the CUDA graphs and warm the logits path — once, at engine start, into a ``ModelParts``.

Stepping (``runtime/runner.py``) only reads the parts; nothing here runs per step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from nbgen.attention import kv_quant
from nbgen.attention.base import AttentionBackend, KVCacheSpec
from nbgen.attention.flashinfer_backend import FlashInferBackend
from nbgen.attention.torch_backend import TorchAttentionBackend
from nbgen.core.config import EngineConfig
from nbgen.kernels import gpu_ops
from nbgen.kernels.batch_sizes import graph_batch_sizes
from nbgen.kernels.triton_precompile import Precompile
from nbgen.models.linear import get_tp
from nbgen.models import norm_fold
from nbgen.models.cpu_offload import OffloadPlan, offload_layers
from nbgen.models.kv_scales import read_kv_scales
from nbgen.models.loader import LoadedModel, load_model
from nbgen.models.model_config import model_dims
from nbgen.models.parallel_state import agree_min, local_heads
from nbgen.runtime import prefill_graphs as pg
from nbgen.runtime.cuda_graphs import CudaGraphRunner, GraphVariant
from nbgen.runtime.jit_prebuild import start_for_config
from nbgen.runtime.lora import LoRAManager
from nbgen.runtime.lora_setup import load_initial, make_lora_manager
from nbgen.runtime.sampler import Sampler
from nbgen.runtime.spec_memory import DraftShare, draft_share

logger = logging.getLogger("nbgen")

# CPU default KV budget when max_total_tokens is not given: enough for a notebook's batches while
# keeping the embedded model's resident memory well under 1.5 GB (its KV is ~23 KB/token in bf16).
CPU_DEFAULT_TOTAL_TOKENS = 16384
# GPU memory kept out of the KV pool besides (1 - mem_fraction_static): flashinfer workspace, graph pool
GPU_RESERVE_BYTES = 1 << 30


@dataclass
class ModelParts:
    """Everything the runner steps with, built once by ``setup_model``."""

    cfg: EngineConfig                              # resolved: no device-dependent None left
    device: torch.device
    loaded: LoadedModel
    kv_spec: KVCacheSpec
    backend: AttentionBackend
    sampler: Sampler
    graphs: Optional[CudaGraphRunner]              # decode graphs (flashinfer backend on CUDA)
    prefill_graphs: Optional[pg.PrefillGraphRunner]  # piecewise graphs for steps with prefill chunks
    norms_folded: bool
    startup_s: dict[str, float]                    # start-up phases in seconds (get_server_info)
    lora: Optional[LoRAManager] = None             # enable_lora: adapters, hooks, the GPU slot pool
    offload: Optional[OffloadPlan] = None          # cpu_offload_gb: the layers whose weights live on the host


def kv_spec_of(loaded: LoadedModel, page_size: int, device: torch.device,
               kv_cache_dtype: str = "auto", checkpoint_scales: bool = True) -> KVCacheSpec:
    """The KV cache's per-layer geometry (num_pages 0: sized by ``num_pages``); with tensor
    parallelism this rank's heads (``local_heads``); an fp8 pool for ``kv_cache_dtype="fp8_e4m3"``,
    with the checkpoint's per-layer K / V scales where it has them and ``checkpoint_scales`` (else 1.0)."""
    layers, hq, hkv, hd = model_dims(loaded.hf_config)
    hq, hkv = local_heads(hq, hkv, get_tp()[0])
    cache = kv_quant.storage_dtype(kv_cache_dtype, loaded.dtype)
    fp8 = kv_quant.is_fp8(cache)
    scales = read_kv_scales(loaded.model_dir, layers) if fp8 and checkpoint_scales else ()
    if fp8 and not scales:
        logger.info("fp8 KV cache: the checkpoint has no k_scale / v_scale; K and V are stored with scale 1.0")
    return KVCacheSpec(layers, 0, page_size, hq, hkv, hd, loaded.dtype, device,
                       kv_dtype=cache if cache != loaded.dtype else None, layer_scales=scales)


def num_pages(cfg: EngineConfig, spec: KVCacheSpec, context_length: int, draft: DraftShare = DraftShare()) -> int:
    """KV pages (page 0, the scratch page, included): max_total_tokens, else on a GPU what
    mem_fraction_static leaves after the weights (at most every running request at the full
    context; a STANDALONE ``draft``'s weights and pool of as many pages inside it), else the CPU
    default."""
    P = cfg.page_size
    if cfg.max_total_tokens is not None:
        return max(2, -(-cfg.max_total_tokens // P) + 1)
    if spec.device.type == "cuda":
        # weights are resident now; KV gets mem_fraction_static of the card minus what is in use,
        # minus a reserve for the attention workspace and the decode graphs (captured after the
        # KV pool exists, since they bake its addresses in); the rest is for activations.
        torch.cuda.synchronize(spec.device)
        free, total = torch.cuda.mem_get_info(spec.device)
        used = total - free
        budget = total * cfg.mem_fraction_static - used - GPU_RESERVE_BYTES - draft.weight_bytes
        if budget <= 0:
            raise RuntimeError(f"no GPU memory left for the KV cache (mem_fraction_static="
                               f"{cfg.mem_fraction_static}, {used / 2**30:.1f} GiB in use)")
        # never more KV than the engine can use: every running request at the full context
        # (keeps a tiny model from taking the card, so several engines share one GPU)
        useful = cfg.max_running_requests * int(context_length)
        return max(2, min(int(budget // (spec.bytes_per_page() + draft.bytes_per_page)), -(-useful // P) + 1))
    return -(-CPU_DEFAULT_TOTAL_TOKENS // P) + 1


def make_backend(cfg: EngineConfig, spec: KVCacheSpec) -> AttentionBackend:
    """flashinfer on CUDA in half precision (torch when it is missing, unless asked for by name),
    torch elsewhere; sets the calling (loop) thread's fused GPU ops switch with it (kernels/gpu_ops.py)."""
    on_gpu = spec.device.type == "cuda"
    # flashinfer's kernels are half-precision only: fp32 on a GPU (parity runs) uses the torch backend
    half = spec.dtype in (torch.bfloat16, torch.float16)
    name = cfg.attention_backend or ("flashinfer" if on_gpu and half else "torch")
    if name == "flashinfer" and not half:
        raise ValueError(f"attention_backend='flashinfer' needs dtype bfloat16 or float16, got {spec.dtype}")
    if name == "flashinfer":
        try:
            backend = FlashInferBackend(spec)
        except ImportError as e:
            if cfg.attention_backend == "flashinfer":
                raise
            logger.warning("flashinfer unavailable (%s); using the torch attention backend", e)
        else:
            gpu_ops.enable_fused(True)
            return backend
    if on_gpu:
        gpu_ops.enable_fused(False)
    return TorchAttentionBackend(spec)


def graphs_enabled(cfg: EngineConfig, backend: AttentionBackend) -> bool:
    """Decode graphs are captured: the flashinfer backend (CUDA), unless disabled."""
    return isinstance(backend, FlashInferBackend) and bool(cfg.cuda_graph_max_bs) and not cfg.disable_cuda_graph


def make_decode_graphs(cfg: EngineConfig, model: torch.nn.Module, backend: AttentionBackend,
                       context_length: int, variant: Optional[GraphVariant] = None,
                       precompile: Optional[Precompile] = None) -> Optional[CudaGraphRunner]:
    """Decode graphs at the padded batch sizes (``graphs_enabled``), or None; ``variant``: a second
    graph per batch size (LoRA's, for the steps with adapter rows); ``precompile``: the start's Triton
    precompile (kernels/triton_precompile.py)."""
    return CudaGraphRunner(model, backend, cfg.cuda_graph_max_bs, context_length, variant, precompile) \
        if graphs_enabled(cfg, backend) else None


def make_prefill_graphs(cfg: EngineConfig, model: torch.nn.Module, backend: AttentionBackend,
                        context_length: int, variant: Optional[GraphVariant] = None,
                        precompile: Optional[Precompile] = None) -> Optional[pg.PrefillGraphRunner]:
    """Piecewise graphs for steps with prefill chunks (with the decode graphs; None when off, or when
    the model or memory does not allow them: then those steps run eagerly); ``variant``: a second set
    of pieces per bucket (LoRA's, for the steps with adapter rows); ``precompile`` as above."""
    if cfg.disable_piecewise_cuda_graph or not pg.supported(model):
        return None
    try:
        return pg.PrefillGraphRunner(model, backend, cfg.piecewise_cuda_graph_max_tokens, context_length, variant,
                                     precompile)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        logger.warning("piecewise prefill graphs unavailable (%s); prefill steps run eagerly", e)
        torch.cuda.empty_cache()
        return None


@torch.inference_mode()
def warm_logits(model: torch.nn.Module, sampler: Sampler, batch_sizes: list[int], hidden_size: int,
                dtype: torch.dtype, device: torch.device, precompile: Optional[Precompile] = None) -> None:
    """Run the LM head and the sampler's argmax and draws once at every graph batch size (CUDA).

    Logits are computed outside the decode graphs, over rows padded to a graph batch size. The first
    call at a row count picks cuBLAS's kernel on the host (~4 ms for the LM head on an H100) or, at
    1-16 rows, loads or compiles a Triton variant of the streaming matmul (0.63 s measured at one
    row); a shrinking decode batch meets every size once, so without this the first big generate
    paid that in the middle of its run. With ``precompile`` the variants compile in its worker processes
    first (one dry run)."""
    def heads() -> None:
        for bs in batch_sizes:
            hidden = torch.zeros(bs, hidden_size, dtype=dtype, device=device)
            sampler.warm(model.compute_logits(hidden))
    if precompile is not None:
        precompile.wait(precompile.record([heads])[0])
    heads()
    torch.cuda.synchronize(device)


def setup_model(cfg: EngineConfig, device: torch.device,
                on_stage: Optional[Callable[[str], None]] = None) -> ModelParts:
    """Load the model and build everything stepping needs (see the module docstring). ``cfg`` must be
    resolved (``EngineConfig.resolved``): every device-dependent default chosen. ``on_stage`` hears
    each phase as it starts: "loading weights", "sizing the KV cache", and on CUDA with graphs
    "capturing CUDA graphs" and "warming up"."""
    report = on_stage or (lambda stage: None)
    assert None not in (cfg.max_running_requests, cfg.chunked_prefill_size, cfg.cuda_graph_max_bs,
                        cfg.piecewise_cuda_graph_max_tokens), "setup_model needs a resolved EngineConfig"
    t0 = time.perf_counter()
    report("loading weights")
    prebuild = start_for_config(cfg, device)   # flashinfer's JIT modules compile meanwhile (runtime/jit_prebuild.py)
    loaded = load_model(cfg, device)
    # before the KV cache is sized: the offloaded layers' device memory goes to it
    offload = offload_layers(loaded.model, cfg.cpu_offload_gb)
    if cfg.cpu_offload_gb and offload is None:
        logger.warning("cpu_offload_gb has no effect on the %s: the weights already live in host memory", device.type)
    t1 = time.perf_counter()
    # LoRA's slot pool before the KV cache takes the free memory; hooks before graph capture
    # (its static row layout holds a decode graph's rows or a piecewise prefill bucket's tokens)
    graph_rows = max(graph_batch_sizes(cfg.cuda_graph_max_bs)[-1],
                     0 if cfg.disable_piecewise_cuda_graph else cfg.piecewise_cuda_graph_max_tokens)
    lora = make_lora_manager(cfg, loaded.model, loaded.dtype, device,
                             graph_rows=graph_rows if device.type == "cuda" else 0)
    report("sizing the KV cache")
    spec = kv_spec_of(loaded, cfg.page_size, device, cfg.kv_cache_dtype, checkpoint_scales=cfg.load_format != "dummy")
    # tensor parallelism: every rank's pool the same size (one page table for all)
    draft = draft_share(cfg, loaded.dtype) if device.type == "cuda" else DraftShare()
    spec = replace(spec, num_pages=agree_min(num_pages(cfg, spec, loaded.context_length, draft), device))
    backend = make_backend(cfg, spec)
    if isinstance(backend, FlashInferBackend):   # prefill on torch's SDPA until flashinfer's module is built
        backend.prefill.ready = prebuild.ready
    # two norm launches a layer fewer; before graph capture, which bakes the weights in
    # adapters loaded after the fold: their A of qkv / gate|up are folded alike (runtime/lora.py);
    # (not with offloaded layers: their device weights are buffers the layers share)
    folded = not (offload and offload.layers) and norm_fold.should_fold(loaded.model, device) \
        and norm_fold.fold_norms(loaded.model)
    load_initial(lora, cfg)
    sampler = Sampler(int(loaded.hf_config.vocab_size), device, original_logprobs=cfg.return_original_logprob)
    t2 = time.perf_counter()
    if graphs_enabled(cfg, backend):
        report("capturing CUDA graphs")
    variant = lora.graph_variant() if lora is not None else None     # LoRA's graphs beside the plain ones
    # on an empty Triton cache the variants the graphs and the warm-up need compile in worker processes
    with Precompile(device) as pre:
        graphs = make_decode_graphs(cfg, loaded.model, backend, loaded.context_length, variant, pre)
        t3 = time.perf_counter()
        prefill = make_prefill_graphs(cfg, loaded.model, backend, loaded.context_length, variant, pre) \
            if graphs is not None else None
        t4 = time.perf_counter()
        if graphs is not None:
            report("warming up")
            warm_logits(loaded.model, sampler, list(graphs.batch_sizes), loaded.hf_config.hidden_size,
                        loaded.dtype, device, pre)
    startup = {"load_model": round(t1 - t0, 2), "kv_cache": round(t2 - t1, 2), "cuda_graphs": round(t3 - t2, 2),
               "prefill_graphs": round(t4 - t3, 2), "warm_logits": round(time.perf_counter() - t4, 2)}
    return ModelParts(cfg, device, loaded, spec, backend, sampler, graphs, prefill, folded, startup, lora, offload)
