"""A one-shot all-reduce over GPUs that map each other's memory: one Triton kernel per call.

Every rank owns one peer-visible buffer (``kernels/cuda_ipc.py`` maps the others' into this process):

    [flags: NPROG x WPOW int64][slot 0: data][slot 1: data]

One launch of ``NPROG`` programs (the same on every rank, for every size) does, per program:
1. its share of the input into this rank's data slot (slot = call parity);
2. ``bar.sync``, then a release store of the call's epoch into the flag [program][this rank] of every
   rank's buffer (the data before the flag, at system scope, over NVLink);
3. spins on its own flags [program][*] with acquire loads until every rank's epoch reached this call's;
4. reads its share of every rank's slot in rank order and sums in fp32 (so every rank computes
   bit-identical sums), writing the result over the input; or, given a residual stream, adds the sum
   into it instead (``residual += sum``, one rounding: a folded layer's o_proj / down_proj output
   entering the stream, ``models/norm_fold.py``), the input left as it was.

Launched with PDL (``kernels/pdl.py``): the programs wait for the previous kernel (whose output is the
input) before step 1 and let the next kernel start launching right away, so its weight loads overlap
the flag exchange.

Why two slots and no barrier at the end (vLLM's one-shot kernel ends with a second barrier): a rank
writes slot ``e % 2`` at call ``e`` only after its call ``e - 1`` passed its barrier, which every peer
enters only after its call ``e - 2`` (the last reader of that slot) finished, kernels on a stream running
in order. Epochs live on the device (one counter per program, incremented by the kernel), so the
launches replay unchanged inside CUDA graphs. A program without data in a call (a decode row of 4096
elements needs two) returns at once, its epoch unchanged: each program's epoch counts the calls it
took part in, the same on every rank since every rank makes the same calls; the argument above holds
per program, since a program always handles the same offsets of the slots. Flags only grow, and a waiting program accepts any
epoch >= its own: a fast peer may already have signalled the next call.

``NPROG`` programs are co-resident on any GPU this runs on (they spin on each other).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from nbgen.kernels import pdl

NPROG = 32          # programs per launch, on every rank and for every size
BLOCK = 2048        # elements per program per round
FLAG_BYTES = 4096   # the flags' region at the start of each buffer (NPROG x WPOW int64 <= 4 KiB)
MAX_WORLD = 8


@triton.jit
def _peer_all_reduce(x_ptr, n, data_ptrs, flag_ptrs, counter_ptr, slot_elems, res_ptr,
                     RANK: tl.constexpr, WORLD: tl.constexpr, WPOW: tl.constexpr,
                     BLOCK: tl.constexpr, NPROG: tl.constexpr, RESIDUAL: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    if USE_PDL:   # launched early: x (and the residual) are the previous kernels' outputs
        pdl.gdc_wait()
        pdl.gdc_launch_dependents()      # the next kernel waits for this one's writes itself
    if pid * BLOCK >= n:    # no data for this program: it sits the call out, as the same program on every rank does
        return
    epoch = tl.load(counter_ptr + pid) + 1
    tl.store(counter_ptr + pid, epoch)
    slot_off = (epoch % 2) * slot_elems
    # slots start 16-byte aligned (allocation + 4 KiB + slot size): vector loads and stores
    own = tl.multiple_of(tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype)) + slot_off, 16)
    # 1. this rank's share into its own slot
    for start in range(pid * BLOCK, n, NPROG * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(own + offs, tl.load(x_ptr + offs, mask=m), mask=m)
    tl.debug_barrier()
    # 2. the epoch into flag [pid][RANK] of every rank (release: the stores above first)
    w = tl.arange(0, WPOW)
    wm = w < WORLD
    bases = tl.load(flag_ptrs + w, mask=wm, other=0).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(bases + pid * WPOW + RANK, tl.zeros([WPOW], tl.int64) + epoch, mask=wm, sem="release", scope="sys")
    # 3. wait until every rank's flag [pid][q] here reached this epoch (one scalar spin per rank: a
    #    loop carrying a [WPOW] tensor through a reduction does not compile with every Triton release)
    mine = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int64)) + pid * WPOW
    for q in tl.static_range(WORLD):
        seen = tl.atomic_add(mine + q, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(mine + q, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    # 4. the sum over ranks, in rank order on every rank
    for start in range(pid * BLOCK, n, NPROG * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        if RESIDUAL:
            acc = tl.load(res_ptr + offs, mask=m, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK], tl.float32)
        for q in tl.static_range(WORLD):
            src = tl.multiple_of(tl.load(data_ptrs + q).to(tl.pointer_type(dtype)) + slot_off, 16)
            acc += tl.load(src + offs, mask=m, other=0.0, volatile=True).to(tl.float32)
        if RESIDUAL:
            tl.store(res_ptr + offs, acc.to(dtype), mask=m)
        else:
            tl.store(x_ptr + offs, acc.to(dtype), mask=m)


def world_pow2(world: int) -> int:
    """The flags' row width for ``world`` ranks (a power of two for ``tl.arange``)."""
    return triton.next_power_of_2(world)


def peer_all_reduce_(x: torch.Tensor, data_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, counter: torch.Tensor,
                     slot_bytes: int, rank: int, world: int, residual: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
    """Sum contiguous ``x`` over the ranks in place (every rank calls it with the same size and dtype);
    with ``residual`` (contiguous, x's shape and dtype) add the sum into it instead -> residual.

    data_ptrs / flag_ptrs: [world] int64 device tensors, each rank's data slot 0 and flags in this
    process's address space; counter: [NPROG] int64 on this GPU, zero at the first call; slot_bytes: one
    data slot's size (``x`` must fit)."""
    assert x.is_contiguous() and x.numel() * x.element_size() <= slot_bytes
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    args = (x, x.numel(), data_ptrs, flag_ptrs, counter, slot_bytes // x.element_size(),
            x if residual is None else residual)
    kw = dict(RANK=rank, WORLD=world, WPOW=world_pow2(world), BLOCK=BLOCK, NPROG=NPROG,
              RESIDUAL=residual is not None, num_warps=8)
    if x.is_cuda:
        pdl.launch(_peer_all_reduce, (NPROG,), args, x.device, **kw)
    else:   # Triton's interpreter (the CPU tests)
        _peer_all_reduce[(NPROG,)](*args, USE_PDL=False, **kw)
    return x if residual is None else residual
