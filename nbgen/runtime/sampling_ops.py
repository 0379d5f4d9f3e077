"""The sampler's tensor kernels: seeded hash noise, the Gumbel-max draw and greedy argmax.

The Gumbel noise of (row, token v) is a pure function of (request seed, output index, v) through a
32-bit integer mix hash evaluated with torch int64 ops that never overflow, so a request draws the
same tokens whatever else is in the batch, in any row order, on CPU and CUDA.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

import numpy as np

import torch
from torch import Tensor

from nbgen.kernels import cpu_ops, gpu_argmax

_M32 = 0xFFFFFFFF


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2**32 for x in [0, 2**32) (torch int64 tensor or int), no int64 overflow.

    Split x into 16-bit halves: lo * c < 2**48 and the high half only matters mod 2**16.
    """
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def mix32(x: Any) -> Any:
    """A bijective 32-bit avalanche hash (lowbias32 constants); works on ints and int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@lru_cache(maxsize=1 << 16)
def seed_key(seed: int) -> int:
    """32-bit key of a request seed (Python ints: any size or sign); cached, a request draws many steps."""
    return mix32((seed & _M32) ^ mix32(((seed >> 32) & _M32) ^ 0x9E3779B9))


def row_key(seed: int, step: int) -> int:
    """32-bit stream key of one (seed, step)."""
    return mix32(seed_key(seed) ^ mix32((step & _M32) ^ 0x85EBCA6B))


def row_keys(seeds: list[int], steps: list[int]) -> np.ndarray:
    """``row_key`` of each (seed, step) pair as int64 numpy (one vectorised hash for a batch)."""
    k = np.fromiter((seed_key(s) for s in seeds), dtype=np.int64, count=len(seeds))
    st = np.asarray(steps, dtype=np.int64) & _M32
    return mix32(k ^ mix32(st ^ 0x85EBCA6B))


def gumbel_from_hash(h: Tensor) -> Tensor:
    """Gumbel(0, 1) noise (float32, same shape) from 32-bit hashes h in [0, 2**32) (int64).

    The top 23 bits k give u = (k + 1/2) / 2**23: k + 1/2 needs 24 significant bits, which float32
    holds exactly, so u lies in [2**-24, 1 - 2**-24] for every hash, never 0 or 1. The noise is then
    finite (within [-2.81, 16.64]): a token masked to -inf stays at -inf after the noise is added, so
    it has probability exactly 0.
    """
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


def gumbel_noise(keys: Tensor, vocab_hash: Tensor) -> Tensor:
    """Gumbel(0, 1) noise [b, V] float32 from row keys [b] int64 and hashed vocab ids [V] int64."""
    return gumbel_from_hash(mix32(keys.view(-1, 1) ^ vocab_hash.view(1, -1)))   # hashes [b, V]


# one workspace per GPU: data-parallel replicas on two GPUs sample from two loop threads at once
_ARGMAX_WS: dict[torch.device, gpu_argmax.ArgmaxWorkspace] = {}


def _argmax_ws(device: torch.device) -> gpu_argmax.ArgmaxWorkspace:
    ws = _ARGMAX_WS.get(device)
    return ws if ws is not None else _ARGMAX_WS.setdefault(device, gpu_argmax.ArgmaxWorkspace())


def greedy_argmax(x: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """[B, V] -> [B] long (into ``out`` [B] when given); nbgen's C kernel on a CPU (torch's is a scalar
    loop there, ~8x slower) and its Triton kernel on CUDA (kernels/gpu_argmax)."""
    if x.dim() == 2 and x.stride(1) == 1 and cpu_ops.fused_enabled(x):
        ids = cpu_ops.argmax(x)
        return ids if out is None else out.copy_(ids)
    if gpu_argmax.usable(x):
        return gpu_argmax.argmax(x, _argmax_ws(x.device), out)
    return x.argmax(dim=-1) if out is None else torch.argmax(x, dim=-1, out=out)


def allowed_ids(bitmask: Tensor, vocab: int) -> Tensor:
    """int32 [B, W] token bitmask (xgrammar's layout: bit v % 32 of word v // 32) -> bool [B, vocab]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                      # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def masked_greedy_argmax(x: Tensor, bitmask: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Greedy tokens under a grammar: argmax over each row's allowed ids of x [B, V] (``bitmask``:
    int32 [>= B, >= ceil(V / 32)] on x's device) -> [B] long (into ``out`` when given). On CUDA one
    pass of the argmax kernel reading the bitmask beside the logits (no masked copy); elsewhere a
    torch reference."""
    if gpu_argmax.usable(x):
        return gpu_argmax.masked_argmax(x, bitmask, _argmax_ws(x.device), out)
    ok = allowed_ids(bitmask[: x.shape[0]], x.shape[1])
    ids = x.float().masked_fill(~ok, float("-inf")).argmax(dim=-1)
    return ids if out is None else out.copy_(ids)


# the noise's range (gumbel_from_hash of the smallest and largest hash), widened by 1 against rounding:
# a token more than this below its row's max can never win the draw
_NOISE_SPAN = float(gumbel_from_hash(torch.tensor([(1 << 32) - 1])) - gumbel_from_hash(torch.tensor([0]))) + 1.0


def noisy_argmax(x: Tensor, keys: Tensor, vocab_hash: Tensor) -> Tensor:
    """Gumbel-max draw: argmax over V of x [b, V] plus the rows' noise -> [b] long; on CUDA one
    Triton kernel that hashes the noise in place (kernels/gpu_argmax), elsewhere int64 tensor ops
    over the tokens that can still win (those within the noise's span of their row's max; a [b, V]
    temporary, callers bound b, when most of them can)."""
    if gpu_argmax.usable(x):
        return gpu_argmax.noisy_argmax(x, keys, vocab_hash, _argmax_ws(x.device))
    xf = x.float()
    cand = xf >= xf.max(dim=-1, keepdim=True).values - _NOISE_SPAN       # [b, V]; an all -inf row: all
    rows, cols = cand.nonzero(as_tuple=True)
    if 4 * rows.numel() > cand.numel():        # flat rows: the dense formula
        return (xf + gumbel_noise(keys, vocab_hash)).argmax(dim=-1)
    total = xf[rows, cols] + gumbel_from_hash(mix32(keys[rows] ^ vocab_hash[cols]))
    b, vocab = x.shape
    best = torch.full((b,), float("-inf"), device=x.device).scatter_reduce(0, rows, total, "amax")
    win = total == best[rows]                  # the first index among equal totals, as argmax
    return torch.full((b,), vocab, dtype=torch.long, device=x.device).scatter_reduce(0, rows[win], cols[win], "amin")


def tempered_draw(x: Tensor, temps: Tensor, keys: Tensor, vocab_hash: Tensor) -> Tensor:
    """Per row of x [b, V] (any float dtype): the Gumbel-max draw from x / temps[row] (float32 [b]),
    or the argmax of x where temps[row] is 0 -> [b] long. The same tokens as widening to float32,
    dividing, then ``noisy_argmax`` / ``greedy_argmax``; on CUDA one kernel over the raw logits."""
    if gpu_argmax.usable(x):
        return gpu_argmax.tempered_argmax(x, temps, keys, vocab_hash, _argmax_ws(x.device))
    xf = x.float()
    sampled = temps > 0
    noisy = noisy_argmax(xf / torch.where(sampled, temps, 1.0).view(-1, 1), keys, vocab_hash)
    return torch.where(sampled, noisy, xf.argmax(-1))
