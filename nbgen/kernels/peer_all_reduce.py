"""The one-shot all-reduce over GPUs that map each other's memory, without flags: each rank pushes its
part into every rank's buffer, and the readers poll the data itself (a "Lamport" protocol: an empty
element holds a sentinel value). One Triton kernel per call, graph-capturable (epochs on the device).

Every rank owns one peer-visible buffer of two sections (section = call parity), each with one slot
per rank:

    [section 0: slot 0 | slot 1 | ... ][section 1: slot 0 | slot 1 | ...]     (WORLD x slot_elems each)

filled with the sentinel once (int16 0x8000 everywhere: -0.0 in bf16 / fp16, and 0x80008000, a
negative fp32 denormal, in fp32). Per program and call:
1. its share of the input, sentinels replaced by +0.0, stored into slot RANK of the section in every
   rank's buffer (remote stores over NVLink, no fence, no flag);
2. loads its own buffer's slots of all ranks at once until no element holds the sentinel, adds them
   in fp32 in rank order (the residual first where given), and writes the sentinel back (cleared for
   the call two later);
3. writes the sum over the input, or adds it into a residual stream (``residual += sum``, one rounding:
   a folded layer's o_proj / down_proj output entering the stream, ``models/norm_fold.py``).
Every rank adds the same parts in the same order, so every rank holds the same bits. A program
without data in a call (a decode row of 4096 elements needs two) counts the call and returns: every
program's epoch is the number of calls, so all programs of a call use the same section (a slot's
bytes belong to other programs in a bf16 call than in an fp32 one). Empty tensors never launch.

Why two sections suffice: a peer writes section ``e % 2`` of this rank's buffer at call ``e + 2`` only
after its call ``e + 1`` finished, and there its program 0 (every call has data) read this rank's part
of ``e + 1``, which this rank pushes only after its call ``e`` (its reads and clears of section
``e % 2`` included) finished, kernels on a stream running in order (PDL: every program waits for the
kernel before). Consecutive calls use different sections. One latency over NVLink a call (the pushes),
where a protocol with flags needs a flag's trip and then a read's round trip.

The sentinel never arrives as data: an input element with its bits (-0.0; in fp32 a denormal) is
sent as +0.0, which changes no sum but a zero's sign. Only the parts travel: residuals and sums may
hold any bits.

Launched with PDL (``kernels/pdl.py``): the programs wait for the previous kernel before reading the
input and let the next kernel start launching at once, so its weight loads overlap the exchange.
``NPROG`` programs of 8 warps are co-resident on any GPU this runs on (they spin).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from nbgen.kernels import pdl

NPROG = 32                   # programs per launch, on every rank and for every size
BLOCK = 2048                 # elements per program per round
MAX_WORLD = 8
SENTINEL16 = -32768          # int16 0x8000: -0.0 in bf16 / fp16
SENTINEL32 = -2147450880     # int32 0x80008000: two int16 sentinels (a negative fp32 denormal)


@triton.jit
def take_parts(acc, mine, slot_elems, offs, m, ref_ptr, WORLD: tl.constexpr, WP2: tl.constexpr, SENT: tl.constexpr):
    """acc (fp32, offs' shape) + every rank's part at offs of this rank's buffer (slot q at mine + q *
    slot_elems, int bits) in rank order, once all arrived -> the sum; the slots are emptied again.
    All WORLD slots are loaded at once (one memory latency, not one per rank, when the parts are there);
    ref_ptr: a pointer of the parts' dtype."""
    ranks = tl.arange(0, WP2)
    src = mine + ranks[:, None] * slot_elems + offs[None, :]
    mm = (ranks < WORLD)[:, None] & m[None, :]
    bits = tl.load(src, mask=mm, other=0, volatile=True)                   # [WP2, B]; masked lanes are 0
    while tl.max(tl.max((bits == SENT).to(tl.int32), axis=1), axis=0) > 0:
        bits = tl.load(src, mask=mm, other=0, volatile=True)
    vals = bits.to(ref_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    for q in tl.static_range(WORLD):          # rank order (a row picked out exactly: the others add zeros)
        acc += tl.sum(tl.where(ranks[:, None] == q, vals, 0.0), axis=0)
    tl.store(src, tl.full(bits.shape, SENT, bits.dtype), mask=mm)         # empty again for the call two later
    return acc


@triton.jit
def _peer_all_reduce(x_ptr, n, data_ptrs, counter_ptr, slot_elems, res_ptr,
                        RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, NPROG: tl.constexpr,
                        RESIDUAL: tl.constexpr, SENT: tl.constexpr, WP2: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    itype = tl.int16 if dtype.primitive_bitwidth == 16 else tl.int32
    if USE_PDL:   # launched early: x (and the residual) are the previous kernels' outputs
        pdl.gdc_wait()
        pdl.gdc_launch_dependents()
    # every program counts every call (the section is the call's parity, the same for all programs: a
    # byte of a slot belongs to different programs in bf16 and in fp32 calls)
    epoch = tl.load(counter_ptr + pid) + 1
    tl.store(counter_ptr + pid, epoch)
    if pid * BLOCK >= n:    # no data for this program: it sits the call out, as on every rank
        return
    section = (epoch % 2) * WORLD * slot_elems
    # 1. this rank's share into slot RANK of the section on every rank (sentinels sent as +0.0)
    for start in range(pid * BLOCK, n, NPROG * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        bits = tl.load(x_ptr + offs, mask=m).to(itype, bitcast=True)
        bits = tl.where(bits == SENT, tl.zeros_like(bits), bits)
        for q in tl.static_range(WORLD):
            dst = tl.load(data_ptrs + q).to(tl.pointer_type(itype)) + section + RANK * slot_elems
            tl.store(tl.multiple_of(dst, 8) + offs, bits, mask=m)
    # 2. every rank's part from this rank's own buffer, in rank order, once it has arrived
    mine = tl.multiple_of(tl.load(data_ptrs + RANK).to(tl.pointer_type(itype)) + section, 8)
    for start in range(pid * BLOCK, n, NPROG * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        if RESIDUAL:
            acc = tl.load(res_ptr + offs, mask=m, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK], tl.float32)
        acc = take_parts(acc, mine, slot_elems, offs, m, x_ptr, WORLD, WP2, SENT)
        if RESIDUAL:
            tl.store(res_ptr + offs, acc.to(dtype), mask=m)
        else:
            tl.store(x_ptr + offs, acc.to(dtype), mask=m)


def buffer_bytes(world: int, slot_bytes: int) -> int:
    """One rank's buffer: two sections of ``world`` slots."""
    return 2 * world * slot_bytes


def peer_all_reduce_(x: torch.Tensor, data_ptrs: torch.Tensor, counter: torch.Tensor, slot_bytes: int,
                        rank: int, world: int, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum contiguous ``x`` over the ranks in place, or with ``residual`` add the sum into it -> the result.

    data_ptrs: [world] int64, each rank's buffer (``buffer_bytes``, filled with int16 0x8000 before the
    first call) in this process's address space; counter: [NPROG] int64 (each the number of calls),
    zero at the first call; slot_bytes: one slot's size (``x`` must fit)."""
    assert x.is_contiguous() and x.numel() * x.element_size() <= slot_bytes and x.element_size() in (2, 4)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    if x.numel() == 0:      # no launch: a call without data in program 0 would not sync the ranks
        return x if residual is None else residual
    args = (x, x.numel(), data_ptrs, counter, slot_bytes // x.element_size(), x if residual is None else residual)
    kw = dict(RANK=rank, WORLD=world, BLOCK=BLOCK, NPROG=NPROG, RESIDUAL=residual is not None,
              SENT=SENTINEL16 if x.element_size() == 2 else SENTINEL32, WP2=triton.next_power_of_2(world),
              num_warps=8)
    if x.is_cuda:
        pdl.launch(_peer_all_reduce, (NPROG,), args, x.device, **kw)
    else:   # Triton's interpreter (the CPU tests)
        _peer_all_reduce[(NPROG,)](*args, USE_PDL=False, **kw)
    return x if residual is None else residual
