"""Greedy decoding's argmax over the vocabulary as one Triton kernel (CUDA), and the sampled
draw's Gumbel-max argmax in the same kernel.

torch's argmax over [B, V] bf16 logits runs one block per row and reads at ~1.1-1.4 TB/s on an H100
(36 us at B 128, 54 us at B 256 for Qwen3's 151 936 columns, every decode step). Here each row is
cut into chunks of BLOCK columns, one program per (row, chunk): it writes its chunk's max and
first index of the max, counts itself in through an atomic, and the row's last program to arrive
reduces the partials and re-arms the counter (the same last-one-merges pattern as the decode
attention kernel). Ties resolve to the first index, as torch's argmax (NaN logits are not ordered
as torch orders them: a row with NaN has no meaningful greedy token either way).

``noisy_argmax`` adds each (row, token)'s Gumbel noise inside the kernel: the 32-bit mix hash of
the row key and the token's hashed id in native uint32 arithmetic, then -log(-log(u)) with
libdevice's log (the CUDA logf torch uses), the same values as ``runtime/sampling_ops`` computes
with int64 tensor ops, without a [B, V] temporary. ``tempered_argmax`` also divides each row by its
temperature first (IEEE division, as torch's ``x / t``; temperature 0: that row's plain argmax), so a
batch of temperature-only rows reads the raw bf16 logits once and writes no fp32 copies.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from nbgen.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use torch's argmax
    triton = None

BLOCK = 4096

if triton is not None:
    from triton.language.extra import libdevice

    if os.environ.get("TRITON_INTERPRET") == "1":   # Triton's CPU interpreter (tests) has no libdevice
        @triton.jit
        def _log(x):
            return tl.log(x)
    else:
        @triton.jit
        def _log(x):
            return libdevice.log(x)                     # CUDA's logf, as torch's log (tl.log is approximate)

    @triton.jit
    def _mix32(x):
        """sampling_ops.mix32 on uint32 (multiplications wrap mod 2**32 natively)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _argmax_kernel(x_ptr, out_ptr, pmax_ptr, pidx_ptr, count_ptr, key_ptr, vhash_ptr, temp_ptr, m_ptr, V, sx, sm,
                       S, SP: tl.constexpr, BLOCK: tl.constexpr, NOISY: tl.constexpr, TEMPERED: tl.constexpr,
                       MASKED: tl.constexpr, USE_PDL: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        if USE_PDL:
            pdl.gdc_wait()                                  # the logits are the previous kernel's output
            pdl.gdc_launch_dependents()
        x = tl.load(x_ptr + r.to(tl.int64) * sx + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if MASKED:                                          # a grammar's token bitmask: bit v of word v // 32
            w = tl.load(m_ptr + r.to(tl.int64) * sm + cols // 32, mask=cols < V, other=0)
            x = tl.where(((w >> (cols % 32)) & 1) != 0, x, float("-inf"))
        if NOISY:                                           # Gumbel(0, 1) noise of (row key, token)
            key = tl.load(key_ptr + r).to(tl.uint32)
            vh = tl.load(vhash_ptr + cols, mask=cols < V, other=0).to(tl.uint32)
            h = _mix32(key ^ vh)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)   # in [2**-24, 1 - 2**-24]
            if TEMPERED:                                    # temperature 0: the row's plain argmax
                t = tl.load(temp_ptr + r)
                if t > 0.0:
                    x = tl.math.div_rn(x, t) - _log(-_log(u))
            else:
                x = x - _log(-_log(u))
        cell = r * SP + c
        tl.store(pmax_ptr + cell, tl.max(x, 0))
        tl.store(pidx_ptr + cell, c * BLOCK + tl.argmax(x, 0, tie_break_left=True))
        tl.debug_barrier()                                  # all stores before the release below
        if tl.atomic_add(count_ptr + r, 1, sem="acq_rel", scope="gpu") == S - 1:
            j = tl.arange(0, SP)
            pm = tl.load(pmax_ptr + r * SP + j, mask=j < S, other=float("-inf"), cache_modifier=".cg")
            best = tl.argmax(pm, 0, tie_break_left=True)    # first chunk holding the max
            tl.store(out_ptr + r, tl.load(pidx_ptr + r * SP + best, cache_modifier=".cg").to(tl.int64))
            tl.store(count_ptr + r, 0)                      # re-arm for the next launch


class ArgmaxWorkspace:
    """Per-row partials and counters, grown on demand. Its users must launch in one stream order (the
    engines' loop threads all queue on the device's default stream); a counter is re-armed by the
    launch that used it, so consecutive launches can share them."""

    def __init__(self) -> None:
        self.rows = self.sp = 0
        self.pmax = self.pidx = self.count = None

    def get(self, rows: int, sp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Partials for ``rows`` rows of ``sp`` chunk slots each (a later, wider vocabulary grows them too)."""
        if rows > self.rows or sp > self.sp or self.count is None or self.count.device != device:
            self.rows, self.sp = max(rows, 2 * self.rows, 64), max(sp, self.sp)
            n = self.rows * self.sp
            self.pmax = torch.empty(n, dtype=torch.float32, device=device)
            self.pidx = torch.empty(n, dtype=torch.int32, device=device)
            self.count = torch.zeros(self.rows, dtype=torch.int32, device=device)
        return self.pmax, self.pidx, self.count


def usable(x: torch.Tensor) -> bool:
    """The kernel serves these logits: CUDA, 2-D with unit column stride, a float dtype."""
    return (triton is not None and x.is_cuda and x.dim() == 2 and x.stride(1) == 1
            and x.shape[0] > 0 and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def argmax(x: torch.Tensor, ws: ArgmaxWorkspace, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [B, V] -> [B] long: the first index of each row's maximum (into ``out`` when given)."""
    return _launch(x, ws, out, None, None)


def masked_argmax(x: torch.Tensor, bitmask: torch.Tensor, ws: ArgmaxWorkspace,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [B, V] -> [B] long: each row's argmax over the ids its row of ``bitmask`` allows (int32
    [>= B, >= ceil(V / 32)] on x's device, xgrammar's layout: bit v % 32 of word v // 32), in one
    pass over x (no masked copy of the logits). A row allowing nothing gets index 0."""
    assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1 and bitmask.shape[1] * 32 >= x.shape[1]
    return _launch(x, ws, out, None, None, bitmask=bitmask)


def noisy_argmax(x: torch.Tensor, keys: torch.Tensor, vocab_hash: torch.Tensor, ws: ArgmaxWorkspace) -> torch.Tensor:
    """Gumbel-max draw: argmax over V of x [B, V] plus each row's noise -> [B] long. keys [B] int64
    row keys, vocab_hash [>= V] int64 hashed token ids, both in [0, 2**32) (``sampling_ops``)."""
    return _launch(x, ws, None, keys, vocab_hash)


def tempered_argmax(x: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, vocab_hash: torch.Tensor,
                    ws: ArgmaxWorkspace) -> torch.Tensor:
    """Per row: argmax over V of x / temps[row] plus the row's Gumbel noise, or of x itself where
    temps[row] is 0 -> [B] long. temps [B] float32; keys and vocab_hash as ``noisy_argmax``."""
    return _launch(x, ws, None, keys, vocab_hash, temps)


def _launch(x: torch.Tensor, ws: ArgmaxWorkspace, out: Optional[torch.Tensor], keys: Optional[torch.Tensor],
            vocab_hash: Optional[torch.Tensor], temps: Optional[torch.Tensor] = None,
            bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    B, V = x.shape
    S = triton.cdiv(V, BLOCK)
    sp = triton.next_power_of_2(S)
    pmax, pidx, count = ws.get(B, sp, x.device)
    if out is None:
        out = torch.empty(B, dtype=torch.long, device=x.device)
    noisy, masked = keys is not None, bitmask is not None
    pdl.launch(_argmax_kernel, (B, S), (x, out, pmax, pidx, count, keys if noisy else out,
                                        vocab_hash if noisy else out, out if temps is None else temps,
                                        bitmask if masked else out, V, x.stride(0),
                                        bitmask.stride(0) if masked else 0, S), x.device,
               SP=ws.sp, BLOCK=BLOCK, NOISY=noisy, TEMPERED=temps is not None, MASKED=masked, num_warps=4)
    return out
