"""Multi-LoRA throughput: ``python -m nbgen.bench.lora --model DIR --load-format dummy --lora 8 --lora-rank 16``.

One process runs the same workload three ways, ``--repeats`` times each: on an engine without LoRA
("plain", then shut down), and on an ``enable_lora`` engine with no adapter ("base") and with the
requests spread round-robin over ``--lora`` random adapters ("lora"; peft format, built here for the
model's shapes with random weights, rank ``--lora-rank`` on ``--targets``). Reported: output tok/s
of every run and lora / plain, lora / base (best of each). Workloads: ``fixed`` (the bench's W-fixed:
256 random-id prompts of 100-1024 tokens, 512 new tokens each; GPU) and ``chat32`` (32 chat questions
x 64 new tokens, the CPU workload); greedy, ``ignore_eos``. ``--profile`` (CUDA): one more run of each kind
under torch.profiler and the loop's step timer: GPU busy time against wall time, the top kernels (the
LoRA kernels' total among them), and per step the device wait and the host's own time, to tell the
adapters' kernel cost from host cost. ``--cases 8x8,8x64,1x16,32x16``: one more LoRA engine per
(adapters x rank) after the first, the workload over its adapters (no base run). ``--kernels``: only the LoRA kernels' time per call at Llama-8B's
shapes (CUDA; ``--sweep``: their config sweep, ``bench/lora_kernels.py``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from typing import Any, Optional

import torch

from nbgen.bench.lora_kernels import SHAPES, kernel_times
from nbgen.bench.profiling import StepTimer, print_gpu_profile
from nbgen.bench.report import add_json_option, write_json
from nbgen.bench.workloads import chat32_prompts, make_workload
from nbgen.engine import Engine

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each LoRA target module of a Llama-family config."""
    h = int(hf_config.hidden_size)
    nh, nkv = int(hf_config.num_attention_heads), int(getattr(hf_config, "num_key_value_heads", None) or
                                                      hf_config.num_attention_heads)
    hd = int(getattr(hf_config, "head_dim", None) or h // nh)
    inter = int(hf_config.intermediate_size)
    return {"q_proj": (nh * hd, h), "k_proj": (nkv * hd, h), "v_proj": (nkv * hd, h), "o_proj": (h, nh * hd),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def write_random_adapter(out_dir: str, hf_config: Any, rank: int, seed: int,
                         targets: tuple[str, ...] = ALL_TARGETS) -> str:
    """A random peft LoRA adapter directory for the model of ``hf_config`` (small B: outputs stay sane)."""
    from safetensors.torch import save_file   # a transformers dependency

    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(hf_config)
    tensors = {}
    for layer in range(int(hf_config.num_hidden_layers)):
        for name in targets:
            out, inp = shapes[name]
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) / inp ** 0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).to(torch.bfloat16)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
                   "bias": "none", "use_rslora": False}, f)
    return out_dir


def _prompts(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """(prompts, sampling params) of the workload."""
    if args.workload == "chat32":
        sp = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens or 64, "ignore_eos": True}
        return chat32_prompts(args.model), sp
    ids, outs = make_workload(args.workload)
    n = args.max_new_tokens
    return ids, [{"temperature": 0.0, "max_new_tokens": n or o, "ignore_eos": True} for o in outs]


def _timed(eng: Engine, prompts: Any, sp: Any, names: Optional[list]) -> dict[str, float]:
    key = "input_ids" if isinstance(prompts[0], list) else "prompt"
    t0 = time.perf_counter()
    outs = eng.generate(**{key: prompts}, sampling_params=sp, lora_path=names, use_tqdm=False)
    secs = time.perf_counter() - t0
    n = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"seconds": secs, "out_tokens": n, "out_tok_s": n / secs}


def _profiled(eng: Engine, prompts: Any, sp: Any, names: Optional[list], label: str) -> dict[str, float]:
    """One more run under torch.profiler (CUDA kernels) with the step timer: GPU busy vs wall, top kernels,
    ms per step (device wait, host)."""
    from torch.profiler import ProfilerActivity, profile

    timer = StepTimer(eng)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run = _timed(eng, prompts, sp, names)
        print(f"[{label}]", end=" ")
        busy = print_gpu_profile(prof, run["seconds"])
        st = timer.summary()
    finally:
        timer.close()
    idle = 1e3 * (run["seconds"] - busy) / max(st["steps"], 1)
    print(f"[{label}] {st['steps']} steps: {st['step_ms']:.2f} ms/step (device wait {st['wait_ms']:.2f}, host "
          f"{st['host_ms']:.2f}); GPU idle {idle:.2f} ms/step (under the profiler)", flush=True)
    return {**run, **st, "gpu_busy_s": busy, "gpu_idle_ms_per_step": idle}


def lora_cases(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(adapters, rank) per LoRA engine: ``--lora`` x ``--lora-rank`` first, then ``--cases``."""
    out = [(args.lora, args.lora_rank)]
    for c in (args.cases or "").split(","):
        if c:
            n, r = (int(v) for v in c.lower().split("x"))
            if (n, r) not in out:
                out.append((n, r))
    return out


def _lora_engine_runs(kw: dict[str, Any], hf_config: Any, prompts: list, sp: Any, warm: list, warm_sp: dict,
                      n: int, rank: int, targets: tuple[str, ...], repeats: int, with_base: bool, profile: bool,
                      profiles: dict[str, dict]) -> dict[str, list[dict]]:
    """One ``enable_lora`` engine with ``n`` random rank-``rank`` adapters: the workload round-robin over
    them ("lora"), and without adapters ("base") when ``with_base``."""
    rows: dict[str, list[dict]] = {"base": [], "lora": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_random_adapter(os.path.join(tmp, f"a{i}"), hf_config, rank, seed=i, targets=targets)
                 for i in range(n)]
        lora_kw = {**kw, "lora_paths": [f"a{i}={p}" for i, p in enumerate(paths)],
                   "max_loras_per_batch": max(n, 1), "max_lora_rank": rank}
        with Engine(**lora_kw) as eng:
            names = [f"a{i % n}" for i in range(len(prompts))]
            key = "input_ids" if isinstance(warm[0], list) else "prompt"
            eng.generate(**{key: warm}, sampling_params=warm_sp, lora_path=names[:len(warm)], use_tqdm=False)
            kinds = (("base", None), ("lora", names)) if with_base else (("lora", names),)
            for _ in range(repeats):
                for kind, nm in kinds:
                    rows[kind].append(_timed(eng, prompts, sp, nm))
                    print(f"{kind:5s} {rows[kind][-1]}", flush=True)
            if profile:
                for kind, nm in kinds:
                    profiles[kind] = _profiled(eng, prompts, sp, nm, kind)
    _release_memory()
    return rows


def _release_memory() -> None:
    """Return a shut-down engine's memory before the next engine sizes its KV pool from what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF dir (config.json); default: the embedded model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--workload", default="fixed", choices=["fixed", "nano", "chat32"])
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override the workload's output lengths")
    ap.add_argument("--lora", type=int, default=8, help="distinct adapters, requests round-robin over them")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(ALL_TARGETS))
    ap.add_argument("--cases", default=None,
                    help="more LoRA engines after the first, as ADAPTERSxRANK,... (e.g. 8x8,8x64,1x16,32x16): "
                         "each runs the workload over its adapters once per repeat")
    ap.add_argument("--repeats", type=int, default=2)
    add_json_option(ap, "the results")
    ap.add_argument("--profile", action="store_true", help="one more profiled run of each kind (CUDA)")
    ap.add_argument("--kernels", action="store_true", help="only time the LoRA kernels at Llama-8B's shapes (CUDA)")
    ap.add_argument("--sweep", action="store_true", help="with --kernels: sweep the kernels' configs")
    ap.add_argument("--rows", default="256,32", help="with --kernels: rows per case (row counts of one table bucket are swept together)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="with --kernels: which of " + ",".join(SHAPES))
    args = ap.parse_args()
    if args.kernels:
        kernel_times(tuple(int(r) for r in args.rows.split(",")), slots=max(args.lora, 1), rank=args.lora_rank,
                     sweep=args.sweep, shapes=tuple(s for s in args.shapes.split(",") if s), json_path=args.json)
        return
    if args.profile and args.device != "cuda":
        raise SystemExit("--profile needs --device cuda (it reports GPU kernel time)")
    prompts, sp = _prompts(args)
    kw: dict[str, Any] = {"device": args.device, "load_format": args.load_format}
    if args.model:
        kw["model_path"] = args.model
    rows: dict[str, list[dict]] = {"plain": [], "base": [], "lora": []}
    profiles: dict[str, dict] = {}
    warm = prompts[:8]
    warm_sp = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(**kw) as eng:
        eng.generate(**{"input_ids" if isinstance(warm[0], list) else "prompt": warm}, sampling_params=warm_sp,
                     use_tqdm=False)
        for _ in range(args.repeats):
            rows["plain"].append(_timed(eng, prompts, sp, None))
            print(f"plain {rows['plain'][-1]}", flush=True)
        if args.profile:
            profiles["plain"] = _profiled(eng, prompts, sp, None, "plain")
        hf_config = eng.hf_config
    del eng                        # the plain engine's weights and KV pool go before the LoRA engine sizes its own
    _release_memory()
    targets = tuple(t for t in args.targets.split(",") if t)
    for n, rank in lora_cases(args):
        first = (n, rank) == (args.lora, args.lora_rank)
        got = _lora_engine_runs(kw, hf_config, prompts, sp, warm, warm_sp, n, rank, targets, args.repeats,
                                with_base=first, profile=args.profile and first, profiles=profiles)
        if first:
            rows["base"], rows["lora"] = got["base"], got["lora"]
        else:
            case = f"lora {n} x rank {rank}"
            rows[case] = got["lora"]
            best_case = max(r["out_tok_s"] for r in got["lora"])
            print(f"{case}: {best_case:.1f} out tok/s", flush=True)
    best = {k: max(r["out_tok_s"] for r in v) for k, v in rows.items()}
    result = {"args": vars(args), "runs": rows, "best_out_tok_s": best, "profiles": profiles,
              "lora_vs_plain": best["lora"] / best["plain"], "lora_vs_base": best["lora"] / best["base"]}
    print(f"best out tok/s: plain {best['plain']:.1f}  base (LoRA engine) {best['base']:.1f}  "
          f"lora ({args.lora} x rank {args.lora_rank}) {best['lora']:.1f}  ->  lora / plain "
          f"{result['lora_vs_plain']:.3f}, lora / base {result['lora_vs_base']:.3f}")
    for case in (k for k in best if k.startswith("lora ")):
        print(f"{case}: {best[case]:.1f} out tok/s  ->  / plain {best[case] / best['plain']:.3f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
