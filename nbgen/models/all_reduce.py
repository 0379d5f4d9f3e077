"""The tensor-parallel all-reduce: small tensors by a one-shot peer-to-peer sum, the rest by NCCL.

A decode step of a tensor-parallel model all-reduces two activations per layer (rows x hidden: 8 KB
at batch 1 for a 4096-wide model). NCCL spends most of its ~15 µs per call on protocol latency;
GPUs that map each other's memory (NVLink) can sum such a tensor in one kernel: every rank pushes its
part into every rank's peer-visible buffer and sums what arrived in its own, polling the data itself
(``kernels/peer_all_reduce.py``; buffers shared by CUDA IPC, ``kernels/cuda_ipc.py``). The kernel is a
plain launch with its epochs on the device, so the decode CUDA graphs capture it as they capture NCCL.

``all_reduce_add`` adds the sum into the residual stream in the same kernel (folded layers' o_proj and
down_proj, ``models/norm_fold.py``: no separate add+RMSNorm launch after the all-reduce).

``setup`` runs on every rank right after the process group forms (the handles are exchanged through
the group: a collective); any failure (GPUs without peer access, an unknown runtime) leaves NCCL in
place on every rank, since all ranks must take the same path for every tensor. ``close`` frees the
buffers (before the process group is destroyed). SGLang's ``disable_custom_all_reduce`` keeps NCCL
for every size.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from nbgen.kernels import cuda_ipc
from nbgen.kernels import peer_all_reduce as kernel

logger = logging.getLogger("nbgen")

MAX_BYTES = 512 * 1024      # larger tensors (prefill chunks, big decode batches) go through NCCL
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PeerAllReduce:
    """This rank's peer buffers: its own allocation and the peers' mapped into this process. ``ok``
    says whether this rank has all of them (the handle exchange happens on every rank regardless, so a
    failing rank never leaves the others waiting in it)."""

    def __init__(self, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.max_bytes = max_bytes
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._own: Optional[int] = None
        self._opened: list[int] = []
        self.ok = False
        mine = bytes(cuda_ipc.HANDLE_BYTES)           # all zeros: this rank has no buffer
        try:
            if self.world > kernel.MAX_WORLD:
                raise ValueError(f"at most {kernel.MAX_WORLD} ranks, got {self.world}")
            nbytes = kernel.buffer_bytes(self.world, max_bytes)
            self._own = cuda_ipc.malloc(self._index, nbytes)
            # every slot empty (int16 0x8000, the kernel's sentinel) before the handle goes to any peer
            cuda_ipc.fill_high_bytes(self._index, self._own, nbytes, 0x80)
            mine = cuda_ipc.handle(self._own)
        except Exception as e:  # noqa: BLE001 - reported; the exchange below still happens
            logger.warning("peer all-reduce: no buffer on rank %d (%s: %s)", self.rank, type(e).__name__, e)
        every = torch.empty(self.world * cuda_ipc.HANDLE_BYTES, dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(every, torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device))
        raw = every.view(self.world, cuda_ipc.HANDLE_BYTES).cpu().numpy()
        if self._own is None or not raw.any(axis=1).all():
            return
        bases = []
        try:
            for q in range(self.world):
                if q == self.rank:
                    bases.append(self._own)
                else:
                    self._opened.append(cuda_ipc.open_handle(self._index, raw[q].tobytes()))
                    bases.append(self._opened[-1])
        except Exception as e:  # noqa: BLE001 - no peer access between these GPUs
            logger.warning("peer all-reduce: rank %d cannot map a peer's buffer (%s)", self.rank, e)
            return
        # [world] addresses in this process: each rank's buffer (two sections of world slots)
        self.ptrs = torch.tensor(bases, dtype=torch.int64, device=device)
        self.counter = torch.zeros(kernel.NPROG, dtype=torch.int64, device=device)   # epochs, per program
        self.ok = True

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the peer kernel (the same answer on every rank for the same call)."""
        return x.is_cuda and x.dtype in DTYPES and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return kernel.peer_all_reduce_(x, self.ptrs, self.counter, self.max_bytes, self.rank, self.world, residual)

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (after the GPU finished with them)."""
        if self._own is None:
            return
        torch.cuda.synchronize(self.device)
        for ptr in self._opened:
            cuda_ipc.close_handle(self._index, ptr)
        self._opened = []
        cuda_ipc.free(self._index, self._own)
        self._own = None


def _everyone(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank (a collective)."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


_PEER: Optional[PeerAllReduce] = None


def setup(device: torch.device, enabled: bool, max_bytes: int = MAX_BYTES) -> bool:
    """Give this rank the peer path (every rank calls it after ``init_process_group``, in the same
    order as its other collectives). True when it is in use, which is then so on every rank."""
    global _PEER
    close()
    if not enabled or device.type != "cuda" or dist.get_world_size() < 2:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    first = index - dist.get_rank()       # ranks sit on consecutive GPUs (runtime/tp_group.rank_device)
    reach = all(torch.cuda.can_device_access_peer(index, first + q)
                for q in range(dist.get_world_size()) if first + q != index)
    if not _everyone(reach, device):
        logger.warning("peer all-reduce: GPUs without peer access; tensor parallelism uses NCCL for every size")
        return False
    peer = PeerAllReduce(device, max_bytes)
    ok = _everyone(peer.ok, device)
    if ok:      # one sum through the kernel on every rank (a collective), checked everywhere
        probe = torch.full((8,), float(dist.get_rank() + 1), device=device)
        n = dist.get_world_size()
        try:    # a compile error is the same on every rank, and raised before the launch
            peer(probe)
            good = bool(torch.equal(probe, torch.full_like(probe, n * (n + 1) / 2)))
        except Exception as e:  # noqa: BLE001 - this Triton cannot build the kernel: NCCL everywhere
            logger.warning("peer all-reduce kernel failed (%s: %s)", type(e).__name__, e)
            good = False
        ok = _everyone(good, device)
    if ok:
        _PEER = peer
    else:
        logger.warning("peer all-reduce unavailable; tensor parallelism uses NCCL for every size")
        peer.close()
    return ok


def close() -> None:
    """Free the peer buffers (the process group is going away); NCCL for every size afterwards."""
    global _PEER
    peer, _PEER = _PEER, None
    if peer is not None:
        peer.close()


def active() -> bool:
    """Whether small tensors go through the peer kernel in this process."""
    return _PEER is not None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks, in place."""
    peer = _PEER
    if peer is not None and peer.fits(x):
        return peer(x)
    dist.all_reduce(x)
    return x


def all_reduce_add(x: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """``into += `` the sum of ``x`` over the tensor-parallel ranks -> into (x [T, H] partial products,
    into [T, H] the residual stream, the same bits on every rank). The peer kernel adds in its epilogue
    (one launch, one rounding); elsewhere x is summed in place and added."""
    peer = _PEER
    if peer is not None and peer.fits(x) and into.is_contiguous() and into.dtype == x.dtype:
        return peer(x, into)
    dist.all_reduce(x)
    return into.add_(x)
