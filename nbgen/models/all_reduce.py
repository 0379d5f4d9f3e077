"""Tensor-parallel all-reduce: a one-shot peer-to-peer sum for small tensors, NCCL for the rest.

A decode step of a tensor-parallel model all-reduces two small activations per layer (batch x
hidden: 8 KB at batch 1 for a 4096-wide model). NCCL's ring costs ~15-25 us of latency for each,
which at batch 1 is a large share of the step. On GPUs that can read each other's memory
(NVLink), torch's symmetric memory gives every rank a buffer its peers map: a rank copies its
tensor into its own buffer and one kernel reads all peers' buffers and sums them (one shot: no
ring, no reduce-scatter), synchronised by signal pads in the same memory. The kernels are plain
CUDA launches, so the decode CUDA graphs capture them like any other.

``setup`` runs on every rank right after the process group forms (the buffer's rendezvous is a
collective); a failure (no peer access, an older torch) leaves NCCL in place. SGLang's
``disable_custom_all_reduce`` keeps NCCL for every size.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("nbgen")

ONE_SHOT_MAX_BYTES = 512 * 1024     # larger tensors (prefill chunks) go through NCCL


class _PeerSum:
    """One rank's symmetric buffer and the group it was rendezvoused with."""

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(self.group_name)
        self.max_bytes = max_bytes
        # bytes, viewed as the caller's dtype per call (bf16 / fp16 / fp32)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        staged = self.buffer[: n * x.element_size()].view(x.dtype)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out=x.view(-1))
        return x


_PEER: Optional[_PeerSum] = None


def setup(device: torch.device, enabled: bool, max_bytes: int = ONE_SHOT_MAX_BYTES) -> bool:
    """Give this rank the one-shot path (call on every rank, after ``init_process_group``, in the
    same order as the other collectives). True when it is in use."""
    global _PEER
    _PEER = None
    if not enabled or device.type != "cuda" or dist.get_world_size() < 2:
        return False
    try:
        peer = _PeerSum(device, max_bytes)
        probe = torch.ones(8, dtype=torch.float32, device=device)
        peer(probe)                                   # every rank runs it: a collective
        ok = bool(torch.allclose(probe, torch.full_like(probe, float(dist.get_world_size()))))
    except Exception as e:  # noqa: BLE001 - no P2P between these GPUs, a torch without symmetric memory
        logger.warning("one-shot all-reduce unavailable (%s: %s); tensor parallelism uses NCCL for every size",
                       type(e).__name__, e)
        return False
    # every rank must take the same path for every tensor: agree on the probe's outcome
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()):
        _PEER = peer
    return _PEER is not None


def reset() -> None:
    """Drop the buffer (the process group is going away)."""
    global _PEER
    _PEER = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks, in place."""
    peer = _PEER
    if peer is not None and peer.fits(x):
        return peer(x)
    dist.all_reduce(x)
    return x
