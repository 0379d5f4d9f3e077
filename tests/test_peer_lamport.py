"""The flag-free (Lamport) peer all-reduce kernel (``kernels/peer_lamport.py``), on the CPU: two
processes run it under Triton's interpreter over shared-memory buffers, each with the pointer table of
its own mappings: plain sums and sums added into a residual, bf16 and fp32 calls interleaved (the
sentinel covers both), sizes from 3 elements to two rounds of the grid; the ranks agree bit for bit,
inputs equal to the sentinel arrive as zeros, and every slot is empty (the sentinel) after the calls."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp

SLOT_BYTES = 1 << 18
CASES = [(torch.bfloat16, 4096, False), (torch.float32, 5, True), (torch.bfloat16, 3, True),
         (torch.float32, 16001, False), (torch.bfloat16, 131000, True), (torch.bfloat16, 4096, True)]


def _rank(rank: int, world: int, bufs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
          residuals: list[torch.Tensor], out) -> None:
    from nbgen.kernels import peer_lamport as pl

    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)      # this process's mappings
    counter = torch.zeros(pl.NPROG, dtype=torch.int64)
    results = []
    for (dt, n, res), x, r in zip(CASES, inputs[rank], residuals):
        y, rr = x.clone(), r.clone()
        got = pl.lamport_all_reduce_(y, ptrs, counter, SLOT_BYTES, rank, world, rr if res else None)
        results.append(got.float().numpy())
    out.put((rank, results))


def test_lamport_kernel_two_processes_interpreted(monkeypatch):
    from nbgen.kernels import peer_lamport as pl

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    world = 2
    bufs = [torch.full((pl.buffer_bytes(world, SLOT_BYTES) // 2,), pl.SENTINEL16, dtype=torch.int16).share_memory_()
            for _ in range(world)]
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(n, generator=gen).to(dt) for dt, n, _ in CASES] for _ in range(world)]
    inputs[0][0][:7] = -0.0                    # the bf16 sentinel's bits, sent as +0.0
    inputs[1][0][:3] = 1.5
    residuals = [(torch.randn(n, generator=gen) * 4).to(dt) for dt, n, _ in CASES]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, bufs, inputs, residuals, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for i, (dt, n, res) in enumerate(CASES):
        ref = inputs[0][i].float() + inputs[1][i].float()
        if res:
            ref = (residuals[i].float() + inputs[0][i].float()) + inputs[1][i].float()
        a, b = torch.from_numpy(got[0][i]), torch.from_numpy(got[1][i])
        assert torch.equal(a, b), f"ranks differ for case {i}"
        tol = 0.0 if dt == torch.float32 else 2.0 ** -7 * ref.abs().max().item()   # interpreter: truncation
        assert (a - ref).abs().max().item() <= tol, i
    assert torch.equal(torch.from_numpy(got[0][0])[:3], torch.full((3,), 1.5))
    for b in bufs:
        assert (b == pl.SENTINEL16).all(), "a slot was left holding data"
