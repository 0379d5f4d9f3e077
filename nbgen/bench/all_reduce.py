"""The tensor-parallel all-reduce on N GPUs: the peer-to-peer kernel (``models/all_reduce.py``) against
NCCL, checked and timed inside CUDA graphs, one process per GPU; also ``all_reduce_add`` (the sum
added into a residual stream, folded layers' o_proj / down_proj).

    python -m nbgen.bench.all_reduce --world 2                 # µs per all-reduce at 8 / 64 / 512 KB
    python -m nbgen.bench.all_reduce --world 2 --check         # the check only (sums against the exact sum)

Timing: a graph of ``--calls`` back-to-back all-reduces of one tensor (as a decode graph holds them),
replayed ``--replays`` times between CUDA events on each rank; reported per all-reduce, rank 0's and
the slowest rank's. Check: rows x hidden tensors of 1 .. 256 rows (bf16 and fp32) summed eagerly and
by a replayed graph, also added into a residual, and chains of back-to-back calls of mixed dtypes and
sizes; each result against the exact sum of every rank's inputs (gathered) within a bound from the
arithmetic (``score``), and every rank's result against rank 0's bits. Failing cases are printed
by name, per rank.
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


# unit roundoff of each dtype (round to nearest): the relative error of one rounding
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def _gathered(x: torch.Tensor) -> torch.Tensor:
    """[world, *x.shape]: every rank's ``x``, exact copies (a collective)."""
    out = torch.empty(dist.get_world_size() * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous().view(-1))
    return out.view(dist.get_world_size(), *x.shape)


def score(got: torch.Tensor, parts: torch.Tensor, residual: torch.Tensor | None = None) -> dict[str, float]:
    """``got`` (this rank's result) against the exact sum of ``parts`` [world, ...] (+ ``residual``), in
    float64 (a collective: every rank's ``got`` is gathered too). Keys: ``diff`` max |got - exact|;
    ``ratio`` max of |got - exact| / bound, above 1 a failure; ``disagree`` elements where some rank's
    result differs from rank 0's bits. bound = (world + 2) u (|residual| + sum |part|) per element, u the
    dtype's unit roundoff: the peer kernel sums in fp32 (world roundings of 2^-24 of at most that) and
    rounds once to the dtype; NCCL sums in its own order with a rounding to the dtype after each of
    world - 1 adds, and adding into the residual rounds once more. Rank order, NCCL's order or its
    precision all stay inside it; a stale, lost or doubled part is off by a whole part."""
    world = parts.shape[0]
    p = parts.double()
    exact, mag = p.sum(0), p.abs().sum(0)
    if residual is not None:
        exact, mag = exact + residual.double(), mag + residual.double().abs()
    diff = (got.double() - exact).abs()
    bound = (world + 2) * UNIT[got.dtype] * mag
    everyone = _gathered(got)
    return {"diff": diff.max().item(), "ratio": (diff / bound.clamp_min(1e-300)).max().item(),
            "disagree": float((everyone != everyone[:1]).any(0).sum().item())}


def _check(hiddens: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Every case's ``score``: eager calls, graph replays on fresh inputs, sums added into a residual,
    and chains of back-to-back calls (no NCCL between them to line the ranks up)."""
    out: dict[str, dict[str, float]] = {}
    rank = dist.get_rank()
    for hidden, dtype, rows in ((h, d, r) for h in hiddens for d in (torch.bfloat16, torch.float32)
                                for r in CHECK_ROWS):
        name = f"{str(dtype)[6:]} {rows}x{hidden}"
        gen = torch.Generator("cuda").manual_seed(1000 * rank + rows)
        x = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=gen)
        out[f"{name} eager"] = score(all_reduce.all_reduce(x.clone()), _gathered(x))
        static = x.clone()
        g = _graph_of(all_reduce.all_reduce, static, 1)
        for k in range(3):                    # replays on fresh inputs: the graph reads its buffer
            static.copy_(x * (k + 1))
            parts = _gathered(static)
            g.replay()
            out[f"{name} graph{k}"] = score(static, parts)
        g.reset()
        out.update(_check_add(x, name))
    for hidden in hiddens:
        out.update(_check_chain(hidden))
    return out


def _check_add(x: torch.Tensor, name: str) -> dict[str, dict[str, float]]:
    """``all_reduce_add`` (the sum added into a residual stream, as folded layers call it) eagerly and
    replayed in a graph; the parts are gathered before the call (NCCL sums them in place)."""
    out: dict[str, dict[str, float]] = {}
    gen = torch.Generator("cuda").manual_seed(x.shape[0])            # the same residual on every rank
    res = torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=gen) * 4
    out[f"{name} add eager"] = score(all_reduce.all_reduce_add(x.clone(), res.clone()), _gathered(x), res)
    part, into = x.clone(), res.clone()
    g = _graph_of(lambda t: all_reduce.all_reduce_add(t, into), part, 1)
    for k in range(3):
        part.copy_(x * (k + 1))
        into.copy_(res)
        parts = _gathered(part)
        g.replay()
        out[f"{name} add graph{k}"] = score(into, parts, res)
    g.reset()
    return out


CHAIN = ((torch.bfloat16, 1), (torch.float32, 1), (torch.bfloat16, 3), (torch.float32, 16),
         (torch.bfloat16, 1), (torch.bfloat16, 64), (torch.float32, 2), (torch.bfloat16, 2))


def _check_chain(hidden: int, rounds: int = 4) -> dict[str, dict[str, float]]:
    """Calls of mixed dtypes and row counts (so other programs own a slot's bytes from call to call),
    back to back: eagerly, then a graph of the same calls replayed between eager chains, all checked
    at the end. Residual adds every third call."""
    rank = dist.get_rank()
    gen = torch.Generator("cuda").manual_seed(77 + rank)
    shapes = [(dt, rows, hidden) for dt, rows in CHAIN if rows * hidden * dt.itemsize <= all_reduce.MAX_BYTES]

    def fresh() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.randn(r, h, device="cuda", dtype=dt, generator=gen), torch.randn(r, h, device="cuda", dtype=dt))
                for dt, r, h in shapes]

    def call(i: int, x: torch.Tensor, res: torch.Tensor) -> None:
        if i % 3 == 2:
            all_reduce.all_reduce_add(x, res)
        else:
            all_reduce.all_reduce(x)

    out: dict[str, dict[str, float]] = {}
    static = fresh()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i, (x, res) in enumerate(static):         # warm-up: every kernel variant built before capture
            call(i, x, res)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for i, (x, res) in enumerate(static):
            call(i, x, res)
    torch.cuda.synchronize()
    for r in range(rounds):
        inputs = fresh()
        for (x, res), (sx, sres) in zip(inputs, static):
            sx.copy_(x)
            sres.copy_(res)
        eager = fresh()
        parts = [(_gathered(x), _gathered(res)[0]) for x, res in inputs + eager]   # res: rank 0's for all
        for (x, res), (_, res0) in zip(eager, parts[len(inputs):]):
            res.copy_(res0)
        for (sx, sres), (_, res0) in zip(static, parts):
            sres.copy_(res0)
        torch.cuda.synchronize()
        dist.barrier()
        for i, (x, res) in enumerate(eager[: len(eager) // 2]):      # eager, replay, eager: no NCCL between
            call(i, x, res)
        g.replay()
        for i, (x, res) in enumerate(eager[len(eager) // 2:], len(eager) // 2):
            call(i, x, res)
        torch.cuda.synchronize()
        for tag, tensors, pr in (("graph", static, parts[: len(inputs)]), ("eager", eager, parts[len(inputs):])):
            for i, ((x, res), (px, res0)) in enumerate(zip(tensors, pr)):
                dt, rows, _ = shapes[i]
                name = f"chain{r} {tag} {i} {str(dt)[6:]} {rows}x{hidden}"
                out[name + (" add" if i % 3 == 2 else "")] = score(res, px, res0) if i % 3 == 2 else score(x, px)
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
            report["check"] = _check(args["hiddens"])
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


def run(world: int, check: bool, time: bool, hiddens: tuple[int, ...] = (4096,), calls: int = 64,
        replays: int = 50) -> list[dict]:
    """Reports of every rank (rank order); the check covers each of ``hiddens``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    args = {"check": check, "time": time, "hiddens": tuple(hiddens), "calls": calls, "replays": replays}
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    reports = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"rank process {p.pid} exited with {p.exitcode}")
    return [reports[r] for r in range(world)]


def failures(report: dict) -> dict[str, dict[str, float]]:
    """The failing cases of one rank's check: over the bound, or not the same bits as rank 0."""
    return {k: v for k, v in report.get("check", {}).items() if not v["ratio"] <= 1.0 or v["disagree"] > 0}


def check_summary(reports: list[dict]) -> str:
    """Lines: cases per rank, the worst ratio to the bound and |difference|, then every failing case."""
    worst = max((v for r in reports for v in r["check"].values()), key=lambda v: v["ratio"])
    lines = [f"check against the exact sum: {len(reports[0]['check'])} cases per rank, worst "
             f"{worst['ratio']:.3g} of the bound (|difference| {worst['diff']:.3g}); failing cases:"]
    for rank, r in enumerate(reports):
        for k, v in failures(r).items():
            lines.append(f"  rank {rank} {k}: |difference| {v['diff']:.4g}, {v['ratio']:.3g} of the bound, "
                         f"{v['disagree']:.0f} elements differ from rank 0")
    if len(lines) == 1:
        lines[0] += " none"
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="only the check against the exact sum (no timing)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 4096],
                    help="row widths checked (512: every row count on the peer path; 4096: NCCL above 64 rows)")
    ap.add_argument("--calls", type=int, default=64, help="all-reduces per graph")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    reports = run(args.world, True, not args.check, tuple(args.hidden), args.calls, args.replays)
    print(f"peer path in use: {[r['peer'] for r in reports]}")
    if "check" in reports[0]:
        print(check_summary(reports))
    for kb in SIZES_KB if not args.check else ():
        peer = [r.get(f"peer {kb} KB", float("nan")) for r in reports]
        nccl = [r.get(f"nccl {kb} KB", float("nan")) for r in reports]
        add = [r.get(f"add {kb} KB", float("nan")) for r in reports]
        print(f"{kb:>4} KB in a graph: peer {peer[0]:6.2f} µs (slowest rank {max(peer):6.2f}), "
              f"NCCL {nccl[0]:6.2f} µs (slowest rank {max(nccl):6.2f}), "
              f"adding into a residual {add[0]:6.2f} µs (slowest rank {max(add):6.2f})")


if __name__ == "__main__":
    main()
