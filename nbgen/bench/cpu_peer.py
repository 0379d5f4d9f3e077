"""nbgen against llama.cpp on the CPU, same GGUF: ``python -m nbgen.bench.cpu_peer``.

The embedded SmolLM2-135M-Instruct (Q4_1 GGUF), the 32 chat questions rendered with its chat
template, greedy, ``--max-new-tokens`` (64) each, ``ignore_eos`` on both sides. Rows: nbgen with all
32 prompts in one ``generate`` call; nbgen at batch 1 (the first ``--batch1-prompts`` prompts one
after another, the playground / streamed-cell case); llama.cpp (llama-cpp-python, ``--threads``
threads, one prompt after another; a bench-only extra, built from source: ``pip install
llama-cpp-python``). Also printed: how many of the batch-1 greedy texts equal llama.cpp's.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Optional

import torch

from nbgen.bench.report import add_json_option, write_json
from nbgen.bench.workloads import chat32_prompts
from nbgen.engine import Engine
from nbgen.models.embedded import download_gguf


def _row(name: str, secs: float, out_tokens: int) -> dict[str, Any]:
    return {"engine": name, "seconds": round(secs, 3), "out_tokens": out_tokens, "tok_s": round(out_tokens / secs, 1)}


def run_nbgen(prompts: list[str], max_new: int, batch1: int) -> tuple[list[dict], list[str]]:
    """nbgen's two rows and its batch-1 texts."""
    sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    with Engine(device="cpu") as eng:
        eng.generate(prompts[:2], sp, use_tqdm=False)                                        # warm-up
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sp, use_tqdm=False)
        batched = _row("nbgen, one batch", time.perf_counter() - t0,
                       sum(o["meta_info"]["completion_tokens"] for o in outs))
        texts, n, t0 = [], 0, time.perf_counter()
        for p in prompts[:batch1]:
            o = eng.generate(p, sp)
            texts.append(o["text"])
            n += o["meta_info"]["completion_tokens"]
        single = _row("nbgen, batch 1", time.perf_counter() - t0, n)
    return [batched, single], texts


def run_llamacpp(gguf: str, prompts: list[str], max_new: int, threads: int) -> tuple[Optional[dict], list[str]]:
    """llama.cpp's row (prompts one after another) and texts; (None, []) without llama-cpp-python."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, []
    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    llm.create_completion(prompts[0], max_tokens=4, temperature=0.0)          # warm-up
    texts, n, t0 = [], 0, time.perf_counter()
    for p in prompts:
        # ignore_eos as nbgen: llama.cpp stops at EOS, so the EOS logit is pushed down instead
        r = llm.create_completion(p, max_tokens=max_new, temperature=0.0, top_k=1,
                                  logit_bias={llm.token_eos(): -1e9})
        texts.append(r["choices"][0]["text"])
        n += r["usage"]["completion_tokens"]
    return _row(f"llama.cpp ({threads} threads), batch 1", time.perf_counter() - t0, n), texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts run one at a time (both engines)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    add_json_option(ap, "the rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = chat32_prompts(None)
    rows, ours = run_nbgen(prompts, args.max_new_tokens, args.batch1_prompts)
    peer, theirs = run_llamacpp(str(download_gguf()), prompts[:args.batch1_prompts], args.max_new_tokens,
                                args.threads)
    if peer is not None:
        rows.append(peer)
    print(f"{'engine':<34}{'seconds':>9}{'out tokens':>12}{'tok/s':>9}")
    for r in rows:
        print(f"{r['engine']:<34}{r['seconds']:>9.2f}{r['out_tokens']:>12}{r['tok_s']:>9.1f}")
    if peer is None:
        print("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python)")
    else:
        same = sum(a.strip() == b.strip() for a, b in zip(ours, theirs))
        print(f"nbgen batch 1 / llama.cpp: {rows[1]['tok_s'] / peer['tok_s']:.2f}x; nbgen one batch / llama.cpp: "
              f"{rows[0]['tok_s'] / peer['tok_s']:.2f}x; greedy texts equal on {same} of {len(theirs)} prompts")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
