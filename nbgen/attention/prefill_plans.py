"""The wrappers a step's prompt chunks are planned on (flashinfer backend), and the verify graphs' wrappers.

A step's rows after its leading decodes (prompt chunks, or a draft tree to verify) are planned once per step
(all layers reuse the plan) on one of:
  * nbgen's Triton chunk attention (kernels/triton_extend.py): causal chunks over e4m3 pages, at most
    ``EXTEND_MAX_TOKENS`` tokens (a paced mixed step's small chunks), where flashinfer's fa2 prefill over e4m3
    pages needs a split-KV merge launch besides; it needs no flashinfer module, so it also takes such steps
    before flashinfer's prefill module is built;
  * flashinfer's causal prefill (``backend="auto"``) for every other causal step, ``causal=True`` aligning
    each chunk's queries to the end of its KV (cached prefixes, chunked prefill);
  * flashinfer's fa2 prefill with a ``custom_mask`` for tree verify steps (attention/tree_mask.py);
  * torch's SDPA (attention/prefill_standin.py) for causal steps while flashinfer's prefill module builds.
flashinfer's plan() stages its scheduling data in a pinned host buffer and copies it asynchronously, so the
next flashinfer plan (prefill, verify or decode) must not overwrite that buffer before the copy ran
(``PlanFence``, matters under overlap scheduling); the Triton wrapper stages its tables in its own buffers.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.prefill_standin import SdpaPrefill
from nbgen.kernels import triton_extend

try:
    import flashinfer
except ImportError:  # pragma: no cover - CPU installs: the runner falls back to the torch backend
    flashinfer = None

EXTEND_MAX_TOKENS = 512     # a step's chunk tokens the Triton chunk attention takes (e4m3 pages)


def pinned(values: Any, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A pinned CPU tensor of ``values`` (list or numpy array); numpy converts lists ~3x faster than torch.
    Plain memory without CUDA (CPU tests of the planning)."""
    t = torch.from_numpy(np.asarray(values, dtype=np.int32 if dtype == torch.int32 else np.int64))
    return t.pin_memory() if torch.cuda.is_available() else t


def extend_wrapper(spec: KVCacheSpec, triton_decode: bool) -> Optional[triton_extend.TritonExtendWrapper]:
    """The Triton chunk attention of a backend: where it runs nbgen's Triton decode kernel
    (``triton_decode``), the pages are e4m3 and the kernel takes the head size; else None."""
    if not triton_decode or spec.cache_dtype == spec.dtype or not triton_extend.supported(spec.head_dim):
        return None
    return triton_extend.TritonExtendWrapper(spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
                                             spec.device)


class PlanFence:
    """An event behind the last flashinfer plan's host-to-device copies: ``wait`` before the next plan
    rewrites flashinfer's pinned host buffer, ``mark`` after it queued its copies (no-op off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._done: Optional[torch.cuda.Event] = None

    def wait(self) -> None:
        """Block until the GPU ran the copies the last marked plan queued."""
        if self._done is not None:
            self._done.synchronize()

    def mark(self) -> None:
        """Record the event behind the copies just queued."""
        if self.cuda:
            self._done = torch.cuda.Event()
            self._done.record()


class PrefillPlans:
    """The prefill wrappers of one backend (sharing its flashinfer ``workspace``) and their plans.
    ``triton_decode``: the backend runs nbgen's Triton decode kernel (``extend_wrapper``)."""

    def __init__(self, spec: KVCacheSpec, workspace: torch.Tensor, kv_layout: str, fence: PlanFence,
                 triton_decode: bool) -> None:
        self.spec, self.workspace, self.kv_layout, self.fence = spec, workspace, kv_layout, fence
        self.causal = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout, backend="auto")
        self.masked: Optional[Any] = None     # tree-verify steps (made at the first one)
        self.standin = SdpaPrefill(spec.device)
        # True once flashinfer's prefill module loads without compiling (runtime/jit_prebuild.py builds it
        # in the background on a fresh host; the model setup sets this)
        self.ready: Callable[[], bool] = lambda: True
        self.extend = extend_wrapper(spec, triton_decode)

    def owns(self, wrapper: Any) -> bool:
        """Whether ``wrapper`` is one of the prefill wrappers (its step's rows after the decodes)."""
        return wrapper is not None and any(wrapper is w for w in (self.causal, self.masked, self.standin, self.extend))

    def takes_extend(self, tokens: int, tree: bool) -> bool:
        """Whether a step's chunks of ``tokens`` rows (``tree``: a draft tree to verify) go to the Triton
        chunk attention."""
        return not tree and self.extend is not None and tokens <= EXTEND_MAX_TOKENS

    def plan(self, qo: list[int], kv_indptr: list[int], kv_indices: list[int], last: list[int],
             custom_mask: Optional[torch.Tensor] = None) -> Any:
        """Plan the wrapper this step's chunks take and return it: causal chunks, or ``custom_mask`` (the
        chunks' [q_len, kv_len] masks flattened, attention/tree_mask.py) when the step verifies a tree."""
        sp = self.spec
        if self.takes_extend(qo[-1], custom_mask is not None):
            self.extend.plan(qo, kv_indptr, kv_indices, last)
            return self.extend
        self.fence.wait()
        mask = {} if custom_mask is None else {"custom_mask": custom_mask.to(sp.device, non_blocking=True)}
        wrapper = self.causal if custom_mask is None else self._masked()
        if custom_mask is None and not self.ready():
            wrapper = self.standin
        wrapper.plan(pinned(qo), pinned(kv_indptr), pinned(kv_indices), pinned(last),
                     sp.num_q_heads, sp.num_kv_heads, sp.head_dim, sp.page_size,
                     causal=custom_mask is None, sm_scale=sp.head_dim ** -0.5, q_data_type=sp.dtype,
                     kv_data_type=sp.cache_dtype, non_blocking=True, **mask)
        self.fence.mark()
        return wrapper

    def _masked(self) -> Any:
        """The wrapper of tree-verify steps: flashinfer's fa2 kernels, since its SM90 (fa3) prefill
        kernels, which ``backend="auto"`` picks on Hopper, take no custom mask."""
        if self.masked is None:
            self.masked = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, self.kv_layout,
                                                                         backend="fa2")
        return self.masked

    def make_verify_wrapper(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                            last_page_len: torch.Tensor) -> Any:
        """A fixed-batch-size prefill wrapper over these GPU buffers for CUDA-graph verify steps
        (runtime/verify_graphs.py), on flashinfer's fa2 kernels (its graph-mode path with the most use)."""
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, self.kv_layout, use_cuda_graph=True, qo_indptr_buf=qo_indptr,
            paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=kv_indices,
            paged_kv_last_page_len_buf=last_page_len, backend="fa2")

    def plan_verify(self, wrapper: Any, qo: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    last: torch.Tensor) -> None:
        """Plan a verify wrapper (causal rows): pinned CPU ``qo`` / ``kv_indptr`` / ``last``; ``kv_indices``
        already on the device (the wrapper's own buffer: flashinfer copies host indices blocking)."""
        sp = self.spec
        self.fence.wait()
        wrapper.plan(qo, kv_indptr, kv_indices, last, sp.num_q_heads, sp.num_kv_heads, sp.head_dim, sp.page_size,
                     causal=True, sm_scale=sp.head_dim ** -0.5, q_data_type=sp.dtype, kv_data_type=sp.dtype,
                     non_blocking=True)
        self.fence.mark()
