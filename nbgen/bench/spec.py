"""Speculative decoding benchmark: ``python -m nbgen.bench.spec`` (CPU, embedded SmolLM2 by default).

**Extractive** (default): NGRAM prompt lookup on the extractive prompt set (``bench/spec_prompts.py``:
quote, copy-edit, summarise given passages; the model's chat template), greedy, batch 1 — each
prompt alone — with and without speculation in the same run, on two engines of the same model
taking turns prompt by prompt. Reported: output tok/s of both, the speed-up, the mean acceptance length
(tokens per verify step, SGLang's ``spec_accept_length``) and the acceptance rate, and whether the
outputs are token-identical.

**Machinery** (``--machinery``, for the GPU host with ``--load-format dummy``): dummy weights make
acceptance meaningless, so the drafts are made to agree as far as possible: NGRAM on prompts that
are a random block repeated, with ``ignore_eos`` (greedy random-weight models fall into cycles that
prompt lookup then predicts), or STANDALONE with the target as its own draft (``--draft-model`` =
``--model``: every draft agrees; its step then includes the draft's forwards), or an EAGLE / EAGLE3
head (``--eagle-head DIR`` or ``random`` [``--eagle3``]: the head's cost per step; ``--eagle-topk K
--eagle-steps S``: trees of ``--num-draft-tokens`` tokens instead of chains). Reported per batch
size (``--batch-sizes``, 1 and 32): ms per decode step without and with speculation (the step of a
speculative request verifies ``--num-draft-tokens`` tokens), the acceptance length reached, the
verify step's cost in plain decode steps, the speed-up that cost implies at acceptance lengths
2, 3 and 4 (acceptance length x plain step ms / speculative step ms), and how many engine steps
replayed a verify CUDA graph (and, STANDALONE, drafted through the draft model's graphs).
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from typing import Any, Optional

import torch

from nbgen.bench.spec_prompts import extractive_chats
from nbgen.engine import Engine
from nbgen.models.eagle import save_random_head
from nbgen.models.embedded import default_model_path


def _engine(args: argparse.Namespace, spec: bool) -> Engine:
    kw: dict[str, Any] = dict(dtype=args.dtype, device=args.device, random_seed=0)
    if args.load_format:
        kw["load_format"] = args.load_format
    if not spec:
        # both engines are up at once and each sizes its KV pool from the share of the GPU the whole
        # process may use: the plain engine, built first, takes a part, the speculative one (and a
        # STANDALONE draft's KV) the default share of what is left
        kw["mem_fraction_static"] = args.mem_fraction_static
    if spec:
        kw["speculative_num_draft_tokens"] = args.num_draft_tokens
        if args.eagle_head:
            head = args.eagle_head
            if head == "random":       # speed machinery only: a random head's drafts are rarely accepted
                head = save_random_head(args.model or default_model_path(), tempfile.mkdtemp(prefix="nbgen_eagle_"),
                                        args.eagle3)
            kw.update(speculative_algorithm="EAGLE3" if args.eagle3 else "EAGLE",
                      speculative_draft_model_path=head, speculative_num_steps=args.num_draft_tokens - 1)
            if args.eagle_topk > 1:    # a tree of num_draft_tokens tokens, eagle_steps deep
                kw.update(speculative_eagle_topk=args.eagle_topk, speculative_num_steps=args.eagle_steps)
            else:
                kw.pop("speculative_num_draft_tokens")
        elif args.draft_model:
            kw.update(speculative_algorithm="STANDALONE", speculative_draft_model_path=args.draft_model,
                      speculative_num_steps=args.num_draft_tokens - 1)
            kw.pop("speculative_num_draft_tokens")
        else:
            kw["speculative_algorithm"] = "NGRAM"
    return Engine(args.model, **kw)


def _timed(eng: Engine, prompts: list[Any], sp: dict[str, Any], batch: int, ids: bool) -> tuple[float, list[dict]]:
    """Seconds and outputs of ``prompts`` run ``batch`` at a time."""
    outs: list[dict] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        res = eng.generate(input_ids=chunk, sampling_params=sp) if ids else eng.generate(chunk, sp)
        outs.extend(res)
    return time.perf_counter() - t0, outs


def _summary(secs: float, outs: list[dict]) -> dict[str, Any]:
    toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    acc = sum(o["meta_info"].get("spec_accepted_drafts", 0) for o in outs)
    prop = sum(o["meta_info"].get("spec_proposed_drafts", 0) for o in outs)
    out = {"seconds": round(secs, 3), "output_tokens": toks, "tok_s": round(toks / secs, 2)}
    if verify:
        out.update(accept_length=round(toks / verify, 3), accept_rate=round(acc / max(prop, 1), 3),
                   verify_steps=verify)
    return out


def extractive(args: argparse.Namespace) -> dict[str, Any]:
    """Batch-1 greedy NGRAM vs plain decoding on the extractive prompt set. Both engines are up at
    once and take turns prompt by prompt, so a change in the machine's load hits both alike."""
    sp = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    res: dict[str, Any] = {"mode": "extractive", "model": args.model or "embedded SmolLM2-135M-Instruct",
                           "num_draft_tokens": args.num_draft_tokens}
    engines = {"plain": _engine(args, False), "ngram": _engine(args, True)}
    secs = {name: 0.0 for name in engines}
    outs: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        prompts = [engines["plain"].apply_chat_template(c) for c in extractive_chats()][: args.num_prompts]
        for eng in engines.values():
            _timed(eng, prompts[:1], {**sp, "max_new_tokens": 8}, 1, False)          # warm-up
        for p in prompts:
            for name, eng in engines.items():
                t, o = _timed(eng, [p], sp, 1, False)
                secs[name] += t
                outs[name] += o
    finally:
        for eng in engines.values():
            eng.shutdown()
    for name in engines:
        res[name] = _summary(secs[name], outs[name])
    res["speedup"] = round(res["ngram"]["tok_s"] / res["plain"]["tok_s"], 3)
    res["identical"] = [o["output_ids"] for o in outs["plain"]] == [o["output_ids"] for o in outs["ngram"]]
    return res


def _profile(eng: Engine, prompts: list[Any], sp: dict[str, Any], batch: int, steps: int) -> list[str]:
    """The top ops of ``steps`` engine steps (torch.profiler through ``Engine.start_profile``), per step:
    host syncs show as cudaStreamSynchronize / cudaEventSynchronize / aten::_local_scalar_dense calls."""
    eng.start_profile(num_steps=steps, activities=["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"])
    _timed(eng, prompts, sp, batch, True)
    prof = eng.stop_profile()
    n = max(prof.steps, 1)
    ops = sorted(prof.ops, key=lambda o: -o.get("self_cpu_us", o["cpu_us"]))[:25]
    return [f"{o['name']}: {o['calls'] / n:.2f} calls, self cpu {o.get('self_cpu_us', 0) / n:.1f} us, "
            f"device {o.get('device_us', 0) / n:.1f} us" for o in ops]


def machinery(args: argparse.Namespace) -> dict[str, Any]:
    """A speculative step's cost against a plain decode step, with drafts that agree as far as possible."""
    rng = random.Random(0)
    sp = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    res: dict[str, Any] = {"mode": "machinery", "model": args.model, "num_draft_tokens": args.num_draft_tokens,
                           "draft_model": args.draft_model, "eagle_head": args.eagle_head,
                           "eagle3": args.eagle3, "eagle_topk": args.eagle_topk}
    engines = {"plain": _engine(args, False), "spec": _engine(args, True)}
    try:
        tok = engines["plain"].tokenizer
        top = min(5000, len(tok) - 1) if tok is not None else 5000
        for bs in args.batch_sizes:
            prompts = [[rng.randint(2, top) for _ in range(args.block)] * args.repeats for _ in range(bs)]
            for name, eng in engines.items():
                _timed(eng, prompts, {**sp, "max_new_tokens": 4}, bs, True)              # warm-up
                before = eng.stats()
                secs, outs = _timed(eng, prompts, sp, bs, True)
                s = _summary(secs, outs)
                if name == "spec":    # engine steps whose verify forward / STANDALONE drafts replayed CUDA graphs
                    after = eng.stats()
                    for key in ("verify_graph_steps", "draft_graph_steps"):
                        s[key] = after.get(f"spec_{key}", 0) - before.get(f"spec_{key}", 0)
                steps = s.get("verify_steps", sum(o["meta_info"]["completion_tokens"] for o in outs)) / bs
                s["ms_per_step"] = round(1000 * secs / steps, 3)
                if args.profile_steps:
                    s["profile"] = _profile(eng, prompts, sp, bs, args.profile_steps)
                res.setdefault(f"bs{bs}", {})[name] = s
    finally:
        for eng in engines.values():
            eng.shutdown()
    for bs in args.batch_sizes:
        r = res[f"bs{bs}"]
        ratio = r["plain"]["ms_per_step"] / r["spec"]["ms_per_step"]
        r["spec_step_cost_x_decode"] = round(1 / ratio, 3)
        r["implied_speedup"] = {a: round(a * ratio, 2) for a in (2, 3, 4)}
    return res


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default=None)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--machinery", action="store_true")
    ap.add_argument("--draft-model", default=None, help="STANDALONE draft (machinery: the target itself)")
    ap.add_argument("--eagle-head", default=None,
                    help="EAGLE / EAGLE3 head dir, or 'random' (a random head for --model: speed machinery only)")
    ap.add_argument("--eagle3", action="store_true", help="the head is EAGLE3 (speculative_algorithm='EAGLE3')")
    ap.add_argument("--eagle-topk", type=int, default=1,
                    help="EAGLE tree drafts: children per node (> 1: a tree of --num-draft-tokens tokens)")
    ap.add_argument("--eagle-steps", type=int, default=3, help="EAGLE tree drafts: the tree's depth")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--block", type=int, default=64, help="machinery: random block repeated in each prompt")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--mem-fraction-static", type=float, default=0.4,
                    help="GPU memory share of the plain engine (cuda)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="machinery: also profile this many engine steps of each engine (top ops per step)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(machinery(args) if args.machinery else extractive(args), indent=1))


if __name__ == "__main__":
    main()
