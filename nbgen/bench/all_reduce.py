"""The tensor-parallel all-reduce on N GPUs: the peer-to-peer kernel (``models/all_reduce.py``) against
NCCL, checked and timed inside CUDA graphs, one process per GPU; also ``all_reduce_add`` (the sum
added into a residual stream, folded layers' o_proj / down_proj).

    python -m nbgen.bench.all_reduce --world 2                 # µs per all-reduce at 8 / 64 / 512 KB
    python -m nbgen.bench.all_reduce --world 2 --check         # sums against dist.all_reduce only

Timing: a graph of ``--calls`` back-to-back all-reduces of one tensor (as a decode graph holds them),
replayed ``--replays`` times between CUDA events on each rank; reported per all-reduce, rank 0's and
the slowest rank's. Check: rows x hidden tensors of 1 .. 256 rows (bf16 and fp32) summed eagerly and
by a replayed graph, against NCCL's sum of the same inputs (``all_reduce_add``: against NCCL's fp32 sum
plus the residual, relative to the largest value).
"""
from __future__ import annotations

import argparse
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nbgen.models import all_reduce

SIZES_KB = (8, 64, 512)
CHECK_ROWS = (1, 2, 3, 8, 16, 64, 128, 256)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def _graph_of(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x)                      # warm-up (Triton compile, NCCL's first use of the size)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(calls):
            fn(x)
    torch.cuda.synchronize()
    return g


def _time(fn: Callable[[torch.Tensor], torch.Tensor], nbytes: int, calls: int, replays: int) -> float:
    """µs per all-reduce of an ``nbytes`` bf16 tensor, from graph replays."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda") * 1e-3
    g = _graph_of(fn, x, calls)
    g.replay()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    g.reset()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def _check(hidden: int) -> dict[str, float]:
    """Max |peer - NCCL| per case (0 expected: both sum in the ranks' order exactly at 2 ranks)."""
    out: dict[str, float] = {}
    rank = dist.get_rank()
    for dtype in (torch.bfloat16, torch.float32):
        for rows in CHECK_ROWS:
            gen = torch.Generator("cuda").manual_seed(1000 * rank + rows)
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=gen)
            ref = _nccl(x.clone())
            eager = all_reduce.all_reduce(x.clone())
            static = x.clone()
            g = _graph_of(all_reduce.all_reduce, static, 1)
            for k in range(3):                    # replays on fresh inputs: the graph reads its buffer
                static.copy_(x * (k + 1))
                g.replay()
                want = _nccl(x.clone() * (k + 1))
                torch.cuda.synchronize()
                out[f"{dtype} {rows}x{hidden} graph{k}"] = (static.float() - want.float()).abs().max().item()
            g.reset()
            out[f"{dtype} {rows}x{hidden} eager"] = (eager.float() - ref.float()).abs().max().item()
            out.update(_check_add(x, rows, hidden))
    return out


def _check_add(x: torch.Tensor, rows: int, hidden: int) -> dict[str, float]:
    """``all_reduce_add`` (the sum added into a residual stream, as folded layers call it) eagerly and
    replayed in a graph, against NCCL's fp32 sum of the same inputs plus the residual in fp32: the
    largest |difference| relative to the largest |expected value| (one rounding of the model dtype is
    ~2^-8 of it; above the peer limit the NCCL path rounds the sum and the add, two)."""
    out: dict[str, float] = {}
    gen = torch.Generator("cuda").manual_seed(rows)            # the same residual on every rank
    res = torch.randn(rows, hidden, device="cuda", dtype=x.dtype, generator=gen)

    def rel(got: torch.Tensor, part: torch.Tensor) -> float:
        want = res.float() + _nccl(part.float())
        return ((got.float() - want).abs().max() / want.abs().max()).item()

    eager = all_reduce.all_reduce_add(x.clone(), res.clone())
    out[f"{x.dtype} {rows}x{hidden} add eager"] = rel(eager, x)
    part, into = x.clone(), res.clone()
    g = _graph_of(lambda t: all_reduce.all_reduce_add(t, into), part, 1)
    for k in range(3):
        part.copy_(x * (k + 1))          # rounded to the dtype: the reference sums these very values
        into.copy_(res)
        g.replay()
        torch.cuda.synchronize()
        out[f"{x.dtype} {rows}x{hidden} add graph{k}"] = rel(into, part)
    g.reset()
    return out


def rank_main(rank: int, world: int, port: int, args: dict[str, Any], results: Any) -> None:
    """One rank: join, set the peer path up, check and / or time; puts (rank, report) on ``results``."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    report: dict[str, Any] = {"peer": all_reduce.setup(torch.device("cuda", rank), True)}
    try:
        if report["peer"] and args["check"]:
            report["check"] = _check(args["hidden"])
        if report["peer"] and args["time"]:
            for kb in SIZES_KB:
                nbytes = kb * 1024
                # a tensor above the peer limit goes to NCCL inside all_reduce: time the kernel's own limit
                report[f"peer {kb} KB"] = _time(all_reduce.all_reduce, nbytes, args["calls"], args["replays"]) \
                    if nbytes <= all_reduce.MAX_BYTES else float("nan")
                report[f"nccl {kb} KB"] = _time(_nccl, nbytes, args["calls"], args["replays"])
                into = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
                report[f"add {kb} KB"] = _time(lambda t: all_reduce.all_reduce_add(t, into), nbytes,
                                               args["calls"], args["replays"])
    finally:
        all_reduce.close()
        dist.destroy_process_group()
    results.put((rank, report))


def run(world: int, check: bool, time: bool, hidden: int = 4096, calls: int = 64, replays: int = 50) -> list[dict]:
    """Reports of every rank (rank order)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    args = {"check": check, "time": time, "hidden": hidden, "calls": calls, "replays": replays}
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    reports = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"rank process {p.pid} exited with {p.exitcode}")
    return [reports[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="only the sums against NCCL")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=64, help="all-reduces per graph")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    reports = run(args.world, True, not args.check, args.hidden, args.calls, args.replays)
    print(f"peer path in use: {[r['peer'] for r in reports]}")
    if "check" in reports[0]:
        worst = max(v for r in reports for v in r["check"].values())
        print(f"check against NCCL: {len(reports[0]['check'])} cases per rank, max |difference| {worst:g}")
    for kb in SIZES_KB if not args.check else ():
        peer = [r.get(f"peer {kb} KB", float("nan")) for r in reports]
        nccl = [r.get(f"nccl {kb} KB", float("nan")) for r in reports]
        add = [r.get(f"add {kb} KB", float("nan")) for r in reports]
        print(f"{kb:>4} KB in a graph: peer {peer[0]:6.2f} µs (slowest rank {max(peer):6.2f}), "
              f"NCCL {nccl[0]:6.2f} µs (slowest rank {max(nccl):6.2f}), "
              f"adding into a residual {add[0]:6.2f} µs (slowest rank {max(add):6.2f})")


if __name__ == "__main__":
    main()
