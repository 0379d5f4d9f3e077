"""Embedding throughput: ``python -m nbgen.bench.embed --model DIR --load-format dummy --num-texts 10000``.

Workload: ``--num-texts`` texts of random token ids (below 10000 and the vocabulary size), each ``randint(min, max)`` tokens
long (64-512 by default; ``random.seed(0)``), embedded with ``Engine(is_embedding=True).encode(
input_ids=...)`` in one call. Reported: input tokens/s, and the prefill bound measured in the same
run: the prompts' matmul FLOPs (decoder linears and causal attention; no LM head) at the matmul rate
measured here (``nbgen.bench.floor``), with nbgen's share of it (% of bound = bound seconds / nbgen
seconds). Peer, same run, when sentence-transformers is importable: a SentenceTransformer built from
the same directory (Transformer + last-token Pooling + Normalize) running its forward over the same
token ids in ``encode``'s batches (length-sorted, ``--st-batch-size``); tokenization is left out of
both engines. With ``--load-format dummy`` the directory has no weights: the peer gets random HF
weights of the same shapes (saved to a temporary directory), which times the same work.
``--score``: the same texts through ``score()`` on a generative engine instead (prefill plus one
token's label logprobs; no peer).
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from typing import Any, Optional

import torch

from nbgen.bench.floor import linear_rate, matmul_rate, prefill_flops
from nbgen.bench.gpu_spans import GpuSpans
from nbgen.bench.profiling import GcPauses, StepTimer, print_gpu_profile
from nbgen.bench.report import add_json_option, write_json
from nbgen.engine import Engine
from nbgen.models.model_config import read_model_config
from nbgen.models.registry import get_model_class
from nbgen.runtime.pooling import PendingVectors


def make_texts(n: int, lo: int, hi: int, vocab_size: int = 10000) -> list[list[int]]:
    """``n`` random-id texts of ``randint(lo, hi)`` tokens each (seeded), ids below
    ``min(10000, vocab_size)``."""
    random.seed(0)
    top = min(10000, vocab_size) - 1
    return [[random.randint(0, top) for _ in range(random.randint(lo, hi))] for _ in range(n)]


def meta_model(model_dir: str) -> tuple[torch.nn.Module, Any]:
    """nbgen's model for ``model_dir`` on the meta device (shapes only: no memory, no weights) and its config."""
    cfg = read_model_config(model_dir)
    with torch.device("meta"):
        return get_model_class(cfg)(cfg), cfg


def bounds(model_dir: str, lens: list[int], rate: float, rows: int, device: torch.device) -> tuple[float, float, float]:
    """(prefill FLOPs of ``lens`` without the LM head, seconds at ``rate`` FLOP/s, the shape bound): the
    same FLOPs with the decoder linears at the rate their own shapes reach on ``rows``-token chunks
    (``floor.linear_rate``) and attention at ``rate`` — this model's bound when everything besides its
    matmuls (norms, RoPE, activations, pooling, host work) were free."""
    model, cfg = meta_model(model_dir)
    flops = prefill_flops(model, cfg, lens, lm_head=False)
    linear = 2.0 * sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2) * sum(lens)
    return flops, flops / rate, linear / linear_rate(model, rows, device) + (flops - linear) / rate


def _job(eng: Engine, texts: list[list[int]], score: bool) -> list[dict[str, Any]]:
    """The timed call: encode the texts, or (``--score``) score each as an item after an empty query
    against two label ids (a generative engine; its output dicts carry the meta_info)."""
    if not score:
        return eng.encode(input_ids=texts)
    outs = dict(eng.score_iter(query=[], items=texts, label_token_ids=[0, 1]))
    return [outs[i] for i in range(len(texts))]


def run_nbgen(args: argparse.Namespace, texts: list[list[int]]) -> dict[str, Any]:
    kw: dict[str, Any] = {"device": args.device, "load_format": args.load_format, "is_embedding": not args.score}
    for k in ("dtype", "chunked_prefill_size", "max_running_requests", "piecewise_cuda_graph_max_tokens"):
        if getattr(args, k):
            kw[k] = getattr(args, k)
    for k in ("disable_cuda_graph", "disable_overlap_schedule"):
        if getattr(args, k):
            kw[k] = True
    t0 = time.perf_counter()
    eng = Engine(args.model, **kw)
    startup = time.perf_counter() - t0
    _job(eng, [t[:64] for t in texts[:8]], args.score)                 # warm-up (graphs, kernels)
    eng.flush_cache()
    # the loop's time per step, and the part spent waiting for the device: pipelined embedding steps
    # wait for the previous step's vectors (CUDA), score steps for their sampled ids, a CPU step for its forward
    cuda = args.device == "cuda"
    wait_on = (eng.loop.runner, "hidden_states") if not cuda else None if args.score else (PendingVectors, "wait")
    timer = StepTimer(eng, wait_on)
    spans = GpuSpans(eng) if cuda else None
    gc_pauses = GcPauses()
    t0 = time.perf_counter()
    outs = _job(eng, texts, args.score)
    secs = time.perf_counter() - t0
    gc_pauses.close()
    steps = timer.summary()
    timer.close()
    print(gc_pauses.summary(secs))
    print(f"nbgen: {steps['steps']} steps, {steps['step_ms']:.2f} ms each: host {steps['host_ms']:.2f} ms, "
          f"waiting for the device {steps['wait_ms']:.2f} ms (a wait near 0: the host is the bottleneck)")
    if spans is not None:
        g = spans.summary()
        spans.close()
        steps.update(gpu=g)
        print(f"GPU: {g['forwards']} forwards, {g['forward_ms']:.2f} ms each ({g['forward_s']:.2f} s), "
              f"{g['between_ms']:.3f} ms between forwards ({g['between_s']:.2f} s: the step's tail and the GPU "
              f"idle waiting for the host)")
    info = eng.get_server_info()
    if args.profile and cuda:   # a second, profiled run: GPU busy time and top kernels
        from torch.profiler import ProfilerActivity, profile
        eng.flush_cache()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t1 = time.perf_counter()
            _job(eng, texts, args.score)
            wall = time.perf_counter() - t1
        print_gpu_profile(prof, wall)
    eng.shutdown()
    n_in = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    ok = next(o for o in outs if (o.get("embedding") or o.get("scores")) is not None)
    return {"engine": "nbgen", "seconds": secs, "in_tokens": n_in, "startup_s": startup,
            "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
            "dim": len(ok.get("embedding") or ok["scores"]), "steps": steps,
            "server_info": {k: info.get(k) for k in ("attention_backend", "piecewise_cuda_graph_tokens",
                                                     "chunked_prefill_size", "max_running_requests")}}


def _st_modules() -> Any:
    try:   # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer import modules as m
    except ImportError:
        from sentence_transformers import models as m
    return m


def _peer_dir(model_dir: str, dtype: torch.dtype, tmp: str) -> str:
    """A directory sentence-transformers can load: the model's own when it has weights and a
    tokenizer, else random HF weights of its config plus a stub tokenizer (never used: the peer
    runs on token ids)."""
    names = os.listdir(model_dir)
    if any(n.endswith(".safetensors") for n in names) and any(n.startswith("tokenizer") for n in names):
        return model_dir
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModel, PreTrainedTokenizerFast

    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    AutoModel.from_config(cfg, dtype=dtype).save_pretrained(tmp)
    stub = Tokenizer(models.WordLevel({"<unk>": 0, "<pad>": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=stub, unk_token="<unk>", pad_token="<pad>").save_pretrained(tmp)
    return tmp


def run_sentence_transformers(args: argparse.Namespace, texts: list[list[int]]) -> dict[str, Any]:
    """The peer (see the module docstring): SentenceTransformer forward in encode's batches."""
    from sentence_transformers import SentenceTransformer

    m = _st_modules()
    dev = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        args.dtype or "", torch.bfloat16 if dev.type == "cuda" else torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = _peer_dir(args.model, dtype, tmp)
        t0 = time.perf_counter()
        body = m.Transformer(path, model_kwargs={"dtype": dtype})
        hidden = body.get_embedding_dimension() if hasattr(body, "get_embedding_dimension") \
            else body.get_word_embedding_dimension()
        st = SentenceTransformer(modules=[body, m.Pooling(hidden, pooling_mode="lasttoken"), m.Normalize()],
                                 device=str(dev))
        startup = time.perf_counter() - t0
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))      # as encode: longest first
        bs = args.st_batch_size

        def run(idx: list[int]) -> None:
            for s in range(0, len(idx), bs):
                batch = [texts[i] for i in idx[s:s + bs]]
                width = max(len(t) for t in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for r, t in enumerate(batch):           # right padding; last-token pooling reads the mask
                    ids[r, :len(t)] = torch.tensor(t)
                    mask[r, :len(t)] = 1
                with torch.inference_mode():
                    st({"input_ids": ids.to(dev), "attention_mask": mask.to(dev)})["sentence_embedding"].cpu()

        run(order[:8])                                                       # warm-up
        t0 = time.perf_counter()
        run(order)
        secs = time.perf_counter() - t0
    return {"engine": "sentence-transformers", "seconds": secs, "in_tokens": sum(map(len, texts)),
            "startup_s": startup, "batch_size": bs}


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m nbgen.bench.embed", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF dir (config.json; weights unless --load-format dummy)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-texts", type=int, default=10000)
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--max-running-requests", type=int, default=None)
    ap.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                    help="largest piecewise prefill graph (default: the chunk, at most 8192)")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--disable-overlap-schedule", action="store_true", help="the plain loop (no pipelined steps)")
    ap.add_argument("--score", action="store_true",
                    help="score() each text on a generative engine (two label ids) instead of encode(); no peer")
    ap.add_argument("--st-batch-size", type=int, default=32, help="the peer's batch size (encode's default)")
    ap.add_argument("--no-peer", action="store_true", help="skip sentence-transformers")
    ap.add_argument("--profile", action="store_true", help="profile a second nbgen run (CUDA): GPU busy time, top kernels")
    add_json_option(ap, "the rows")
    args = ap.parse_args(argv)
    if not 1 <= args.min_tokens <= args.max_tokens:
        raise ValueError(f"need 1 <= --min-tokens <= --max-tokens, got {args.min_tokens}, {args.max_tokens}")
    vocab = int(read_model_config(args.model).vocab_size)
    texts = make_texts(args.num_texts, args.min_tokens, args.max_tokens, vocab)
    dev = torch.device(args.device)
    rate = matmul_rate(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rows = [run_nbgen(args, texts)]
    if not args.no_peer and not args.score:
        try:
            rows.append(run_sentence_transformers(args, texts))
        except ImportError:
            print("sentence-transformers is not installed: no peer row")
        except Exception as e:  # noqa: BLE001 - report the peer's failure, keep nbgen's numbers
            rows.append({"engine": "sentence-transformers", "error": f"{type(e).__name__}: {e}"})
    lens = [len(t) for t in texts]
    chunk = rows[0]["server_info"].get("chunked_prefill_size") or 8192
    flops, bound, shape_bound = bounds(args.model, lens, rate, chunk, dev)
    print(f"\n{args.num_texts} texts of {args.min_tokens}-{args.max_tokens} random tokens  model {args.model}  "
          f"device {args.device}  startup {rows[0]['startup_s']:.1f} s")
    print(f"prefill {flops / 1e12:.3g} TFLOP at the measured matmul rate {rate / 1e12:.3g} TFLOP/s: bound {bound:.3f} s")
    print(f"with the decoder linears at the rate of their own shapes on {chunk}-token chunks: bound {shape_bound:.3f} s")
    print(f"server: {rows[0]['server_info']}")
    print(f"{'engine':<24}{'seconds':>9}{'in tok/s':>12}{'texts/s':>10}{'% bound':>9}{'% shape bound':>15}")
    for r in rows:
        r.update(num_texts=args.num_texts, matmul_flops=rate, prefill_flops=flops, bound_s=bound,
                 shape_bound_s=shape_bound)
        if "error" in r:
            print(f"{r['engine']:<24} error: {r['error']}")
            continue
        r["tok_s"] = r["in_tokens"] / r["seconds"]
        r["pct_bound"] = 100 * bound / r["seconds"]
        r["pct_shape_bound"] = 100 * shape_bound / r["seconds"]
        print(f"{r['engine']:<24}{r['seconds']:>9.2f}{r['tok_s']:>12.0f}{args.num_texts / r['seconds']:>10.1f}"
              f"{r['pct_bound']:>8.1f}%{r['pct_shape_bound']:>14.1f}%")
    if len(rows) > 1 and "error" not in rows[1]:
        print(f"nbgen / sentence-transformers: {rows[0]['tok_s'] / rows[1]['tok_s']:.2f}x tokens/s")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
