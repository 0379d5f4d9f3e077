"""The peer-to-peer all-reduce kernel (``kernels/peer_all_reduce.py``).

CPU: two processes run the kernel under Triton's interpreter over shared-memory buffers, each with the
pointer table of its own mappings (as CUDA IPC gives each GPU process): sums of several sizes and
dtypes in sequence (both data slots, grid-strided programs), then the same adding into a residual
stream, equal on both ranks, epochs and flags advanced once per call. GPU (2 GPUs): the same against
NCCL's ``dist.all_reduce`` (and with a residual stream), 1 .. 256 rows, eagerly and replayed inside a
CUDA graph (``nbgen.bench.all_reduce``)."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

SLOT_BYTES = 1 << 18
CASES = [(torch.float32, 5), (torch.bfloat16, 4096), (torch.float32, 16001), (torch.bfloat16, 3),
         (torch.bfloat16, 131000)]    # the last nearly fills a slot: 2 rounds of the grid-strided programs


def _rank(rank: int, world: int, bufs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
          residuals: list[torch.Tensor], out) -> None:
    from nbgen.kernels import peer_all_reduce as par

    flag_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)   # this process's mappings
    data_ptrs = flag_ptrs + par.FLAG_BYTES
    counter = torch.zeros(par.NPROG, dtype=torch.int64)
    sums, added, untouched = [], [], []
    for x in inputs[rank]:
        y = x.clone()
        par.peer_all_reduce_(y, data_ptrs, flag_ptrs, counter, SLOT_BYTES, rank, world)
        sums.append(y.float().numpy())      # by value (a shared tensor would need this process alive)
    for x, res in zip(inputs[rank], residuals):     # the same calls adding into a residual stream
        y, r = x.clone(), res.clone()
        got = par.peer_all_reduce_(y, data_ptrs, flag_ptrs, counter, SLOT_BYTES, rank, world, residual=r)
        assert got is r
        added.append(r.float().numpy())
        untouched.append(bool(torch.equal(y, x)))
    out.put((rank, sums, counter.numpy(), bufs[rank][: par.FLAG_BYTES].view(torch.int64).numpy().copy(),
             added, untouched))


def test_peer_kernel_two_processes_interpreted(monkeypatch):
    from nbgen.kernels import peer_all_reduce as par

    monkeypatch.setenv("TRITON_INTERPRET", "1")      # the spawned ranks import Triton in interpreter mode
    world = 2
    bufs = [torch.zeros(par.FLAG_BYTES + 2 * SLOT_BYTES, dtype=torch.uint8).share_memory_() for _ in range(world)]
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(n, generator=gen).to(dt) for dt, n in CASES] for _ in range(world)]
    residuals = [(torch.randn(n, generator=gen) * 4).to(dt) for dt, n in CASES]     # the same on every rank
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, bufs, inputs, residuals, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (out.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for i, (dt, n) in enumerate(CASES):
        ref = (inputs[0][i].float() + inputs[1][i].float())
        a, b = torch.from_numpy(got[0][0][i]), torch.from_numpy(got[1][0][i])
        assert torch.equal(a, b), f"ranks differ for {dt} x {n}"
        # the interpreter narrows fp32 to bf16 by truncation: one bf16 step off the rounded sum at most
        tol = 0.0 if dt == torch.float32 else 2.0 ** -7 * ref.abs().max().item()
        assert (a - ref).abs().max().item() <= tol, (dt, n)
        # residual + sum in fp32 (residual first, then the ranks in order), rounded once; the input kept
        ref = (residuals[i].float() + inputs[0][i].float()) + inputs[1][i].float()
        a, b = torch.from_numpy(got[0][3][i]), torch.from_numpy(got[1][3][i])
        assert torch.equal(a, b), f"ranks' residuals differ for {dt} x {n}"
        tol = 0.0 if dt == torch.float32 else 2.0 ** -7 * ref.abs().max().item()
        assert (a - ref).abs().max().item() <= tol, (dt, n)
        assert (a - residuals[i].float()).abs().max().item() > 0.1     # the sum was added, not dropped
        assert got[0][4][i] and got[1][4][i], "the residual call overwrote its input"
    # a program takes part in a call only where it has data: its epoch counts those calls
    calls = torch.tensor([2 * sum(p * par.BLOCK < n for _, n in CASES) for p in range(par.NPROG)])
    assert calls.min() < calls.max() == 2 * len(CASES)      # some programs sat some calls out
    for r in range(world):
        counter, flags = torch.from_numpy(got[r][1]), torch.from_numpy(got[r][2])
        assert torch.equal(counter, calls)
        # flags [program][rank]: every rank's last epoch, in every program's row
        rows = flags[: par.NPROG * par.world_pow2(world)].view(par.NPROG, -1)[:, :world]
        assert torch.equal(rows, calls[:, None].expand(-1, world))


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")
def test_peer_all_reduce_matches_nccl_two_gpus():
    from nbgen.bench.all_reduce import run

    for hidden in (512, 4096):     # 512: every row count on the peer path; 4096: above 64 rows, NCCL inside
        reports = run(2, check=True, time=False, hidden=hidden)
        for rank, rep in enumerate(reports):
            assert rep["peer"], f"rank {rank}: the peer path was not set up"
            # two ranks: both sum a + b once, rounded once (fp32 exact); a wrong or stale slot is off by O(1)
            # (adding into a residual: the reference sums in another order, a few fp32 steps of ~5 apart)
            bad = {k: v for k, v in rep["check"].items()
                   if v > (0.07 if "bfloat16" in k else 1e-5 if " add " in k else 1e-6)}
            assert not bad, (rank, bad)


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
