"""The peer-to-peer all-reduce kernel (``kernels/peer_all_reduce.py``).

CPU: two (and three) processes run the kernel under Triton's interpreter over shared-memory buffers, each with the
pointer table of its own mappings (as CUDA IPC gives each GPU process): plain sums and sums added into
a residual, bf16 and fp32 calls interleaved (the sentinel covers both), sizes from 3 elements to two
rounds of the grid; the ranks agree bit for bit, inputs equal to the sentinel arrive as zeros, every
slot is empty (the sentinel) after the calls, and every program's epoch counts every call. GPU (2 and
4 GPUs): ``nbgen.bench.all_reduce``'s check, every result against the exact sum of all ranks' inputs
within a bound from the arithmetic and the same bits on every rank (1 .. 256 rows, eagerly, replayed
in a CUDA graph, added into a residual, back-to-back chains of mixed dtypes and sizes)."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

SLOT_BYTES = 1 << 18
CASES = [(torch.bfloat16, 4096, False), (torch.float32, 5, True), (torch.bfloat16, 3, True),
         (torch.float32, 16001, False), (torch.bfloat16, 131000, True), (torch.bfloat16, 4096, True)]


def _rank(rank: int, world: int, bufs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
          residuals: list[torch.Tensor], out) -> None:
    from nbgen.kernels import peer_all_reduce as par

    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)      # this process's mappings
    counter = torch.zeros(par.NPROG, dtype=torch.int64)
    results, kept = [], []
    for (dt, n, res), x, r in zip(CASES, inputs[rank], residuals):
        y, rr = x.clone(), r.clone()
        got = par.peer_all_reduce_(y, ptrs, counter, SLOT_BYTES, rank, world, rr if res else None)
        results.append(got.float().numpy())      # by value (a shared tensor would need this process alive)
        kept.append(not res or torch.equal(y, x))     # adding into the residual leaves the input alone
    out.put((rank, (results, kept, counter.numpy())))


@pytest.mark.parametrize("world", [2, 3])
def test_peer_kernel_processes_interpreted(monkeypatch, world):
    """world 3: the ranks' slots are read as one [4, B] block with a masked row."""
    from nbgen.kernels import peer_all_reduce as par

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bufs = [torch.full((par.buffer_bytes(world, SLOT_BYTES) // 2,), par.SENTINEL16, dtype=torch.int16).share_memory_()
            for _ in range(world)]
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(n, generator=gen).to(dt) for dt, n, _ in CASES] for _ in range(world)]
    inputs[0][0][:7] = -0.0                    # the bf16 sentinel's bits, sent as +0.0
    inputs[1][0][:3] = 1.5
    for r in range(2, world):
        inputs[r][0][:3] = 0.0
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
    # every program counts every call, with data or without (the section is the call's parity)
    assert min(sum(p * par.BLOCK < n for _, n, _ in CASES) for p in range(par.NPROG)) < len(CASES)
    for r in range(world):
        assert all(got[r][1]), f"rank {r}: an input changed"
        assert got[r][2].tolist() == [len(CASES)] * par.NPROG
    got = {r: v[0] for r, v in got.items()}
    for i, (dt, n, res) in enumerate(CASES):
        ref = residuals[i].float() if res else torch.zeros(n)
        for r in range(world):                     # rank order, as the kernel adds
            ref = ref + inputs[r][i].float()
        a = torch.from_numpy(got[0][i])
        assert all(torch.equal(a, torch.from_numpy(got[r][i])) for r in range(world)), f"ranks differ for case {i}"
        tol = 0.0 if dt == torch.float32 else 2.0 ** -7 * ref.abs().max().item()   # interpreter: truncation
        assert (a - ref).abs().max().item() <= tol, i
    assert torch.equal(torch.from_numpy(got[0][0])[:3], torch.full((3,), 1.5))
    for b in bufs:
        assert (b == par.SENTINEL16).all(), "a slot was left holding data"


def _gpus(n: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= n


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.skipif(not _gpus(4), reason="needs 4 GPUs"))])
@pytest.mark.skipif(not _gpus(2), reason="needs 2 GPUs")
def test_peer_all_reduce_matches_exact_sum_gpus(world):
    """Every case of ``nbgen.bench.all_reduce``'s check within its arithmetic bound on every rank, and
    every rank's result the same bits as rank 0's (512 wide: every row count on the peer path; 4096:
    NCCL above 64 rows); the failing cases by name and value otherwise."""
    from nbgen.bench.all_reduce import check_summary, failures, run

    reports = run(world, check=True, time=False, hiddens=(512, 4096))
    assert all(rep["peer"] for rep in reports), "the peer path was not set up on every rank"
    assert len(reports[0]["check"]) > 100
    assert not any(failures(rep) for rep in reports), check_summary(reports)


def test_ipc_handle_bytes_keep_zero_bytes():
    """A CUDA IPC handle is 64 raw bytes with zeros inside: every rank's exchanged handle must keep all
    of them (a C-string read cuts it at the first zero, and the ranks' gathers then disagree in size)."""
    from nbgen.kernels import cuda_ipc

    raw = bytes([7, 0, 0, 9] + [0] * 30 + [255] * 30)
    h = cuda_ipc.handle_from_bytes(raw)
    assert cuda_ipc.handle_bytes(h) == raw
    assert cuda_ipc.handle_bytes(cuda_ipc.handle_from_bytes(bytes(64))) == bytes(64)
    with pytest.raises(ValueError, match="64 bytes"):
        cuda_ipc.handle_from_bytes(raw[:10])
