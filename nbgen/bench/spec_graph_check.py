"""Verify CUDA graphs against eager verify forwards, tensor by tensor (CUDA):
``python -m nbgen.bench.spec_graph_check --model DIR [--load-format dummy] [--num-draft-tokens 4] [--engine]``.

**Step** (always): a runner of the model (bf16, flashinfer) prefills a few prompts of different lengths, then
runs the same chain verify steps (rows with q - 1 drafts, fewer, none; batches of different sizes) four ways:

* ``E0`` eager: ``model(ids, positions, backend.prepare(batch))`` over the unpadded rows (flashinfer's
  prefill wrapper, leading one-token rows on the decode kernel);
* ``E1`` the runner's eager step (``ModelRunner.hidden_states``: piecewise prefill graphs where it has them);
* ``P`` the verify graphs' padded layout, staged and planned as for a replay, run eagerly
  (``VerifyGraphRunner.run_eager``: the same kernels as the graph);
* ``G`` the graph replay (``VerifyGraphRunner.run``).

Forward hooks on every layer's attention module copy its inputs (q after RoPE, k, v) and its output, and
the residual stream after each layer, into fixed buffers (captured into the graphs too), so each path
leaves per-layer tensors. For each pair the report gives, in model order, the largest |difference| over
the real tokens' rows and where the two first differ (P vs G must be bit-identical: same kernels and
inputs), then the final hidden states, the logits (and argmax agreement) and the K/V each path wrote at
the real tokens' slots. The KV pool is restored before every path. Every flashinfer plan call (eager
prefill / decode, verify) is printed with its inputs, with the verify wrapper's plan info, and the graph's
device buffers after staging are checked against the layout.

**Engine** (``--engine``): then bench/spec_forks.py (engines with graphs on and off: where outputs fork).
"""
from __future__ import annotations

import argparse
import gc
import random
from typing import Any, Callable, Optional

import numpy as np
import torch

from nbgen.bench.spec_forks import engine_check
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.config import EngineConfig
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.runtime.pages import SCRATCH_PAGE
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.step_inputs import flatten
from nbgen.runtime.verify_graphs import VerifyGraphRunner
from nbgen.runtime.verify_layout import verify_layout


class Probe:
    """Forward hooks copying each layer's attention inputs / output and residual stream into fixed buffers
    (allocated at the first eager pass, so a captured graph copies into the same buffers)."""

    def __init__(self, model: torch.nn.Module, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.bufs: dict[str, torch.Tensor] = {}
        self.T = 0                     # rows the latest pass wrote
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.attn.register_forward_pre_hook(self._pre(i))
            layer.self_attn.attn.register_forward_hook(self._post(i))
            layer.register_forward_hook(self._layer(i))

    def _put(self, name: str, x: Optional[torch.Tensor]) -> None:
        if x is None:
            return
        buf = self.bufs.get(name)
        if buf is None:
            assert x.device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), "buffers before capture"
            buf = self.bufs[name] = torch.zeros(self.max_tokens, x.shape[-1], dtype=x.dtype, device=x.device)
        self.T = x.shape[0]
        buf[: x.shape[0]].copy_(x.reshape(x.shape[0], -1))

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(_mod: torch.nn.Module, args: tuple) -> None:
            q, k, v = args[:3]
            self._put(f"L{i:02d}.0_q_roped", q)
            self._put(f"L{i:02d}.1_k", k)
            self._put(f"L{i:02d}.2_v", v)
        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(_mod: torch.nn.Module, _args: tuple, out: torch.Tensor) -> None:
            self._put(f"L{i:02d}.3_attn_out", out)
        return hook

    def _layer(self, i: int) -> Callable[..., None]:
        def hook(_mod: torch.nn.Module, _args: tuple, out: tuple) -> None:
            x, residual = out
            self._put(f"L{i:02d}.4_x", x)
            self._put(f"L{i:02d}.5_residual", residual)
        return hook

    def take(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """The buffers' rows ``rows`` (fp32 copies), by name in model order."""
        idx = torch.tensor(rows, device=next(iter(self.bufs.values())).device)
        return {k: self.bufs[k].index_select(0, idx).float() for k in sorted(self.bufs)}


def _plan_logger(backend: Any, log: list[str]) -> None:
    """Wrap the backend's plan calls (this instance only) to record their inputs."""
    def show(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.cpu().tolist()
        return x if x is None or isinstance(x, (int, float, str)) else list(np.asarray(x).tolist())

    def wrap(obj: Any, name: str) -> None:
        orig = getattr(obj, name)

        def logged(*a: Any, **kw: Any) -> Any:
            out = orig(*a, **kw)
            w = a[0] if name == "plan_verify" else out if name == "plan_prefill" else a[0]
            info = getattr(w, "_plan_info", None)
            args = [show(x) for x in (a[1:] if name in ("plan_verify", "plan_decode") else a)]
            log.append(f"{name}: {type(w).__name__} args={args} kw={ {k: show(v) for k, v in kw.items()} } "
                       f"plan_info={None if info is None else list(info)}")
            return out
        setattr(obj, name, logged)

    prefill = getattr(backend, "prefill", None)          # the flashinfer backend's prefill / verify wrappers
    for obj, name in ((backend, "plan_prefill"), (backend, "plan_decode"), (prefill, "plan_verify")):
        if hasattr(obj, name):
            wrap(obj, name)


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> tuple[list[str], Optional[str]]:
    """Per tensor: max |a - b|, relative to max |a|; marks the first that differs (beyond bf16 noise unless
    ``exact``) -> (lines, the first differing tensor's name or None)."""
    lines: list[str] = []
    first = None
    for k in a:
        if k not in b:
            continue
        d = (a[k] - b[k]).abs().max().item()
        ref = max(a[k].abs().max().item(), 1e-12)
        bad = d > 0 if exact else d / ref > 2e-2
        if bad and first is None:
            first = k
        lines.append(f"    {k:<22} max|d| {d:.3e}  rel {d / ref:.2e}{'   <-- first difference' if first == k else ''}")
    lines.insert(0, f"  first differing tensor: {first}")
    return lines, first


def _pages(c: torch.Tensor, backend: Any) -> torch.Tensor:
    """A layer's K or V cache as [pages, Hkv, P, D] (flashinfer's HND pages; a view of the torch backend's
    [Hkv, pages * P, D])."""
    if c.dim() == 4:
        return c
    sp = backend.spec
    return c.view(sp.num_kv_heads, sp.num_pages, sp.page_size, sp.head_dim).transpose(0, 1)


def _kv_at(backend: Any, slots: list[int]) -> dict[str, torch.Tensor]:
    """Every layer's K and V at flat slots ``slots`` (HND pages) -> {name: [n, Hkv * D] fp32}."""
    P = backend.spec.page_size
    s = torch.tensor(slots, device=backend.k_cache[0].device)
    out = {}
    for i, (kc, vc) in enumerate(zip(backend.k_cache, backend.v_cache)):
        for name, c in (("k", kc), ("v", vc)):
            out[f"L{i:02d}.kv_{name}"] = _pages(c, backend)[s // P, :, s % P].reshape(len(slots), -1).float()
    return out


def step_check(args: argparse.Namespace) -> None:
    """The four paths of a few verify steps, compared tensor by tensor."""
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    cfg = EngineConfig(model_path=args.model, dtype="bfloat16" if cuda else "float32", device=args.device,
                       load_format=args.load_format or "auto", cuda_graph_max_bs=16, mem_fraction_static=0.3,
                       random_seed=0)
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else None
    runner = ModelRunner(cfg.resolved(dev.type, total), dev)
    backend, model, q = runner.backend, runner.model, args.num_draft_tokens
    P = backend.spec.page_size
    V = runner.vocab_size
    print(f"backend {type(backend).__name__}, page size {P}, q {q}, decode graphs "
          f"{runner.cuda_graph_batch_sizes}, piecewise prefill graphs {runner.piecewise_cuda_graph_tokens}")
    rng = random.Random(0)
    lens = [37, 5, 64, 18, 130, 16, 3]
    reqs, pages, nxt = [], [], 1
    for i, n in enumerate(lens):
        ids = [rng.randrange(2, min(V, 512)) for _ in range(n)]
        reqs.append(Request(f"r{i}", ids, SamplingParams(temperature=0.0, max_new_tokens=64)))
        k = -(-(n + q) // P) + 1
        pages.append(list(range(nxt, nxt + k)))
        nxt += k
    probe = Probe(model, max(sum(lens), 16 * q))
    log: list[str] = []
    summary: list[str] = []
    _plan_logger(backend, log)
    with torch.inference_mode():
        pre = ScheduledBatch([SeqWork(r, r.prompt_ids, 0, p, True) for r, p in zip(reqs, pages)], P)
        flat = flatten(pre)
        model(runner.to_device(flat.ids), runner.to_device(flat.positions), backend.prepare(pre))
        log.append("---- verify graphs captured below ----")
        vg = VerifyGraphRunner(runner, q) if cuda else None     # CPU: a dry run of the eager paths only
        print(f"verify graphs: bs {vg.batch_sizes if vg is not None else None}")
        touched = sorted({SCRATCH_PAGE} | {p for ps in pages for p in ps})
        idx = torch.tensor(touched, device=dev)
        saved = [_pages(c, backend).index_select(0, idx) for c in backend.k_cache + backend.v_cache]

        def restore() -> None:
            for c, s in zip(backend.k_cache + backend.v_cache, saved):
                _pages(c, backend).index_copy_(0, idx, s)

        scenarios = [("mixed drafts, 7 rows (graph bs 8)", list(range(7)), [q - 1, 0, 2, q - 1, 1, 0, q - 1]),
                     ("3 rows, other drafts (graph bs 4)", [2, 4, 0], [1, q - 1, 0]),
                     ("1 row, no drafts (graph bs 1)", [3], [0]),
                     ("7 rows again, all q - 1 drafts (graph bs 8, replayed again)", list(range(7)), [q - 1] * 7)]
        for title, which, nd in scenarios:
            seqs = []
            for i, k in zip(which, nd):
                r = reqs[i]
                toks = [rng.randrange(2, min(V, 512)) for _ in range(k + 1)]
                seqs.append(SeqWork(r, toks, len(r.prompt_ids), pages[i], True))
            batch = ScheduledBatch(seqs, P)
            flat = flatten(batch)
            rows_e = [flat.starts[i] + j for i, s in enumerate(seqs) for j in range(s.q_len)]
            rows_p = [i * q + j for i, s in enumerate(seqs) for j in range(s.q_len)]
            slots = [s.pages[p // P] * P + p % P for s in seqs for p in range(s.start_pos, s.kv_len)]
            res: dict[str, dict[str, torch.Tensor]] = {}
            print(f"\n==== {title}: drafts {nd}, start positions {[s.start_pos for s in seqs]}")
            for path in ("E0", "E1", "P", "G") if vg is not None else ("E0", "E1"):
                restore()
                log.append(f"---- {title}: path {path}")
                if path == "E0":
                    h = model(runner.to_device(flat.ids), runner.to_device(flat.positions), backend.prepare(batch))
                    rows = rows_e
                elif path == "E1":
                    h = runner.hidden_states(batch, flat)
                    rows = rows_e
                elif path == "P":
                    h = vg.run_eager(batch)  # type: ignore[union-attr]
                    rows = rows_p
                else:
                    h, _starts = vg.run(batch)  # type: ignore[union-attr]
                    rows = rows_p
                if cuda:
                    torch.cuda.synchronize()
                t = probe.take(rows) if path != "E1" else {}
                hid = h.index_select(0, torch.tensor(rows, device=dev))
                t["final_hidden"] = hid.float()
                t["logits"] = model.compute_logits(hid).float()
                t.update(_kv_at(backend, slots))
                res[path] = t
                if path == "G" and vg is not None:
                    bs = vg.graph_size(len(seqs))
                    lay = verify_layout(seqs, q, bs, P)
                    nnz = len(lay.kv_indices)
                    dev_io = vg.io[: 3 * bs * q].view(3, -1).cpu().numpy()
                    ok = {"ids": (dev_io[0] == lay.ids).all(), "positions": (dev_io[1] == lay.positions).all(),
                          "slots": (dev_io[2] == lay.slots).all(),
                          "qo_indptr": (vg.qo[: bs + 1].cpu().numpy() == lay.qo_indptr).all(),
                          "kv_indptr": (vg.kv_indptr[: bs + 1].cpu().numpy() == lay.kv_indptr).all(),
                          "last_page_len": (vg.last[:bs].cpu().numpy() == lay.last_page_len).all(),
                          "kv_indices": (vg.indices[:nnz].cpu().numpy() == lay.kv_indices).all()}
                    print(f"  graph's device buffers equal the layout: {ok}")
                    print(f"  layout: kv_indptr {lay.kv_indptr.tolist()} last {lay.last_page_len.tolist()} "
                          f"kv_indices {lay.kv_indices.tolist()}")
            pairs = (("P", "G", True), ("E0", "P", False), ("E0", "G", False), ("E0", "E1", False))
            for a, b, exact in (p for p in pairs if p[0] in res and p[1] in res):
                la, lb = res[a]["logits"], res[b]["logits"]
                agree = (la.argmax(-1) == lb.argmax(-1)).float().mean().item()
                top2 = la.topk(2, dim=-1).values
                gaps = [round(g, 3) for g in (top2[:, 0] - top2[:, 1])[la.argmax(-1) != lb.argmax(-1)].tolist()]
                lines, first = _compare(res[a], res[b], exact)
                line = (f"{title[:28]:<28} {a:>2} vs {b:<2}: first differing {first}; logits max|d| "
                        f"{(la - lb).abs().max().item():.3e}, argmax agreement {agree:.3f}, {a}'s top-2 gaps "
                        f"where they disagree {gaps}")
                summary.append(line)
                print(f"\n  {line}")
                if args.verbose or (exact and first is not None):
                    print("\n".join(lines))
        restore()
    print("\n==== flashinfer plan calls (inputs; plan_info = flashinfer's plan vector)")
    for line in log if args.verbose else [x for x in log if "plan_verify" in x][:8]:
        print("  " + line[:1500])
    print("\n==== summary (P vs G must show 'first differing None')")
    print("\n".join(summary))
    del vg, runner, model, probe
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default=None)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--engine", action="store_true", help="also compare whole engines (graphs on / off)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the eager paths (no graphs)")
    ap.add_argument("--verbose", action="store_true", help="every tensor of every pair, every plan call")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    step_check(args)
    if args.engine:
        engine_check(args)


if __name__ == "__main__":
    main()
