"""Tensor-parallel parity on a real-sized config: teacher-forced top-1 agreement of tp N with tp 1.

Dummy weights are drawn per rank in each rank's shard shape, so tp sizes would not share weights:
``--random-checkpoint DIR`` first writes one random bf16 checkpoint of the config (HF tensor names from
transformers' model built on the meta device, drawn on the GPU) and every engine loads that.

One-GPU engine first: greedy continuations of random prompts, then each prompt + continuation read
back teacher-forced (prompt logprobs, top-1 per position). Each ``--tp-sizes`` engine then reads the
same sequences; reported per tp size: the share of positions whose top-1 equals tp 1's, the mean
|delta logprob| of the true tokens, and whether its own greedy continuations equal tp 1's. After each
engine's shutdown it checks that no worker process is left and prints every GPU's used memory.

    python -m nbgen.bench.tp_parity --model <llama-3.1-8b dir> --random-checkpoint /tmp/l8 --tp-sizes 2 4
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
from typing import Any

import psutil
import torch

from nbgen.bench.fp8_accuracy import teacher_forced
from nbgen.engine import Engine
from nbgen.models.loader import fill_dummy_


def _gpu_memory_used() -> str:
    """Each GPU's used MiB as nvidia-smi reports it ('' where there is no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return " ".join(f"{line.strip()}MiB" for line in out.splitlines() if line.strip())


def write_random_checkpoint(model_dir: str, out_dir: str, seed: int = 0, shard_bytes: int = 4 << 30) -> str:
    """A random bf16 HF checkpoint of ``model_dir``'s config in ``out_dir``: N(0, 0.02) matrices, unit
    norms, zero biases (``loader.fill_dummy_``, as dummy weights), safetensors shards of ~``shard_bytes``.
    Returns ``out_dir``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(model_dir, "config.json"), out_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    names = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        names.pop("lm_head.weight", None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0
    for name, shape in names.items():
        t = fill_dummy_(name, torch.empty(shape, dtype=torch.bfloat16, device=device), gen).cpu()
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            save_file(shard, os.path.join(out_dir, f"model-{index:05d}.safetensors"))
            shard, size, index = {}, 0, index + 1
    if shard:
        save_file(shard, os.path.join(out_dir, f"model-{index:05d}.safetensors"))
    return out_dir


def _children() -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True)]


def _run(model: str, tp: int, prompts: list[list[int]], reference: list[list[int]] | None, new_tokens: int,
         kw: dict[str, Any]) -> tuple[list[list[int]], list[tuple[list[float], list[int]]]]:
    """(greedy continuations, teacher-forced (logprobs, top-1) of each ``reference`` sequence, or of each
    prompt + this engine's own continuation when there is no reference yet)."""
    sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    with Engine(model, tp_size=tp, **kw) as eng:
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)]
        seqs = reference if reference is not None else [p + o for p, o in zip(prompts, outs)]
        forced = [teacher_forced(eng, s) for s in seqs]
    return outs, forced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--random-checkpoint", default=None,
                    help="write a random checkpoint of the config here and load it (tp-independent weights)")
    ap.add_argument("--tp-sizes", type=int, nargs="*", default=[2])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=16)
    args = ap.parse_args()
    if args.random_checkpoint:
        args.model, args.load_format = write_random_checkpoint(args.model, args.random_checkpoint), "auto"
    kw = {"load_format": args.load_format, "cuda_graph_max_bs": args.cuda_graph_max_bs}
    rng = random.Random(0)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    outs1, forced1 = _run(args.model, 1, prompts, None, args.new_tokens, kw)
    reference = [p + o for p, o in zip(prompts, outs1)]
    # tp 1 against itself: its teacher-forced top-1 (one prefill) against its own greedy tokens (decode steps):
    # the disagreement that bf16 kernels of other shapes cause without any parallelism
    own = [t == g for (_, tops), o in zip(forced1, outs1) for t, g in zip(tops[args.prompt_len - 1:], o)]
    print(f"tp 1: {len(prompts)} prompts x {args.new_tokens} tokens; teacher-forced top-1 = own greedy token "
          f"{sum(own) / len(own):.4f}; after shutdown: workers {_children()} "
          f"GPU memory {_gpu_memory_used()}", flush=True)
    for tp in args.tp_sizes:
        outs, forced = _run(args.model, tp, prompts, reference, args.new_tokens, kw)
        pairs = [(a, b) for (lp1, t1), (lp, t) in zip(forced1, forced) for a, b in zip(zip(lp1, t1), zip(lp, t))]
        agree = sum(t1 == t for (_, t1), (_, t) in pairs) / len(pairs)
        dlp = sum(abs(l1 - lp) for (l1, _), (lp, _) in pairs) / len(pairs)
        same = sum(a == b for a, b in zip(outs1, outs))
        print(f"tp {tp}: teacher-forced top-1 agreement {agree:.4f} over {len(pairs)} positions, "
              f"mean |d logprob| {dlp:.4f}, greedy continuations equal {same}/{len(prompts)}; after shutdown: "
              f"workers {_children()} GPU memory {_gpu_memory_used()}", flush=True)


if __name__ == "__main__":
    main()
