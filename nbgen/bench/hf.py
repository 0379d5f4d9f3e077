"""The HF transformers peer on a bench workload: ``generate_batch`` (paged attention) on a GPU,
left-padded ``generate()`` in fp32 on a CPU."""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from nbgen.models.embedded import default_model_path


def run_hf(args: argparse.Namespace, prompts: Any, outs: list[int]) -> dict[str, Any]:
    """HF transformers on the same workload: generate_batch on GPU, left-padded generate() on CPU, greedy
    or sampled at ``args.temperature`` as nbgen runs it (on the CPU, text out: the ids decoded in the
    timed window, as nbgen's text prompts return text)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    sample: dict[str, Any] = ({"do_sample": True, "temperature": args.temperature, "top_k": 0}
                              if args.temperature else {"do_sample": False})
    if args.device == "cpu":
        path = args.model or default_model_path()
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            g = model.generate(**enc, max_new_tokens=outs[0], min_new_tokens=outs[0],
                               pad_token_id=tok.pad_token_id or 0, **sample)
        tok.batch_decode(g[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        secs = time.perf_counter() - t0
        n_out = int((g.shape[1] - enc["input_ids"].shape[1]) * g.shape[0])
        return {"engine": "hf generate", "seconds": secs, "out_tokens": n_out,
                "in_tokens": int(enc["attention_mask"].sum()), "first_ids": g[0, enc["input_ids"].shape[1]:][:16].tolist()}
    if len(set(outs)) != 1:
        return {"engine": "hf generate_batch", "error": "needs one output length for all requests (use --workload fixed)"}
    cfg = AutoConfig.from_pretrained(args.model)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="paged|sdpa").eval()
    gen = GenerationConfig(max_new_tokens=outs[0], eos_token_id=None, pad_token_id=0, **sample)
    model.generate_batch(inputs=[p[:32] for p in prompts[:4]], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    n_out = sum(len(r.generated_tokens) for r in res.values())
    return {"engine": "hf generate_batch", "seconds": secs, "out_tokens": n_out,
            "in_tokens": sum(len(p) for p in prompts)}
