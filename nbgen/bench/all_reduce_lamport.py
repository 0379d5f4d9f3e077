"""The flag-free (Lamport) peer all-reduce (``kernels/peer_lamport.py``) against the engine's flag
kernel and NCCL on N GPUs, one process each, in the same run.

    python -m nbgen.bench.all_reduce_lamport --world 2

Check: rows x 4096 bf16 (1 .. 64 rows) and fp32 (1, 8 rows) summed eagerly and by a replayed graph, plain
and added into a residual, against NCCL's fp32 sum (max |difference|). Timing as ``bench/all_reduce.py``:
a graph of ``--calls`` back-to-back all-reduces of one bf16 tensor, µs per call, slowest rank.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nbgen.bench.all_reduce import _free_port, _graph_of, _nccl, _time
from nbgen.models import all_reduce

SLOT_BYTES = all_reduce.MAX_BYTES
SIZES_KB = (8, 64, 512)


def _check(lam: all_reduce.PeerAllReduce) -> dict[str, float]:
    out: dict[str, float] = {}
    rank = dist.get_rank()
    for dtype, rows_list in ((torch.bfloat16, (1, 2, 8, 64)), (torch.float32, (1, 8))):
        for rows in rows_list:
            gen = torch.Generator("cuda").manual_seed(1000 * rank + rows)
            x = torch.randn(rows, 4096, device="cuda", dtype=dtype, generator=gen)
            res = torch.randn(rows, 4096, device="cuda", dtype=dtype,
                              generator=torch.Generator("cuda").manual_seed(rows))     # the same on every rank
            want = _nccl(x.float())
            out[f"{dtype} {rows} eager"] = (lam(x.clone()).float() - want).abs().max().item()
            got = lam(x.clone(), res.clone()).float()
            out[f"{dtype} {rows} add eager"] = (got - (res.float() + want)).abs().max().item()
            static, into = x.clone(), res.clone()
            g = _graph_of(lambda t: lam(t, into), static, 1)     # the warm-up call adds once more
            for k in range(3):
                static.copy_(x * (k + 1))
                into.copy_(res)
                g.replay()
                ref = res.float() + _nccl(x.float() * (k + 1))
                torch.cuda.synchronize()
                out[f"{dtype} {rows} add graph{k}"] = (into.float() - ref).abs().max().item()
            g.reset()
    return out


def rank_main(rank: int, world: int, port: int, args: dict[str, Any], results: Any) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    report: dict[str, Any] = {"peer": all_reduce.setup(torch.device("cuda", rank), True)}
    lam = all_reduce.PeerAllReduce(torch.device("cuda", rank), SLOT_BYTES, lamport=True)
    assert lam.ok, "no Lamport buffers"
    try:
        report["check"] = _check(lam)
        for kb in SIZES_KB:
            nbytes = kb * 1024
            into = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
            fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
                "lamport": lam, "lamport add": lambda t: lam(t, into), "nccl": _nccl}
            if report["peer"]:
                fns["flags"] = all_reduce.all_reduce
                fns["flags add"] = lambda t: all_reduce.all_reduce_add(t, into)
            for name, fn in fns.items():
                report[f"{name} {kb}"] = _time(fn, nbytes, args["calls"], args["replays"])
    finally:
        lam.close()
        all_reduce.close()
        dist.destroy_process_group()
    results.put((rank, report))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, vars(args), results))
             for r in range(args.world)]
    for p in procs:
        p.start()
    reports = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    worst = {k: max(r["check"][k] for r in reports.values()) for k in reports[0]["check"]}
    print("check against NCCL (max |difference| over ranks):",
          ", ".join(f"{k}: {v:.3g}" for k, v in worst.items()))
    for kb in SIZES_KB:
        cells = []
        for name in ("lamport", "lamport add", "flags", "flags add", "nccl"):
            vals = [r.get(f"{name} {kb}", float("nan")) for r in reports.values()]
            cells.append(f"{name} {max(vals):6.2f}")
        print(f"{kb:>4} KB in a graph, µs per call (slowest rank): " + ", ".join(cells))


if __name__ == "__main__":
    main()
