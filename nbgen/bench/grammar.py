"""Structured-output throughput: ``python -m nbgen.bench.grammar --model DIR --load-format dummy``.

The same 256 chat prompts run on one Engine, alternately unconstrained and with a ``json_schema``
(greedy, ``ignore_eos``, the same max_new_tokens), ``--repeats`` times each. Reported: output tok/s
of every run (completion tokens actually generated / wall time; a constrained request that completes
its grammar stops early, so both sides print their token counts), the best ratio of a json run to the
free run before it and the ratio of the medians, how many constrained outputs completed the grammar
and whether those parse and validate. The schema is compiled in a warm-up (its first-use time is
printed), then run once at the full batch for a few tokens (the fill worker and the mask kernel's
batch-size specialisation), so the timed runs measure steady decoding.
Each run also reports the loop's steps, the host's own time per step and the time it waited for
the device (``StepTimer``); ``--gpu-profile`` adds the GPU's idle time per step. Then the realistic
workload (``bench/grammar_extract.py``): ``--extract`` record-extraction prompts with a nested
schema, completing their grammar (no ignore_eos), each output validated, with and without
jump-forward decoding. ``--threads 8,4`` alternates xgrammar's fill threads (``NBGEN_GRAMMAR_THREADS``)
between the pairs of one engine and reports the ratio at each.
A grammar needs a real tokenizer: with dummy weights pass ``--tokenizer DIR`` (tokenizer files; its
vocabulary may be smaller than the model's, those logits are masked).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable, Optional

from nbgen.bench import grammar_extract
from nbgen.bench.phases import PhaseTimer
from nbgen.bench.profiling import StepTimer, print_gpu_profile
from nbgen.bench.report import add_json_option, write_json
from nbgen.bench.schema_check import schema_errors
from nbgen.bench.workloads import QUESTIONS
from nbgen.engine import Engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence", "keywords"],
          "properties": {"answer": {"type": "string"},
                         "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                         "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}}
WARM_SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def _run(eng: Any, prompts: list[str], sp: dict[str, Any]) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0, outs


def _validity(outs: list[dict], schema: dict) -> dict[str, int]:
    stats = {"complete": 0, "valid": 0}
    for o in outs:
        if o["meta_info"]["finish_reason"]["type"] != "stop":
            continue
        stats["complete"] += 1
        try:
            stats["valid"] += not schema_errors(json.loads(o["text"]), schema)
        except Exception:  # noqa: BLE001 - counted as invalid
            pass
    return stats


def grammar_consistent(eng: Any, outs: list[dict], schema: dict) -> int:
    """How many outputs a fresh xgrammar matcher accepts token by token (a check of the masks)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(eng.tokenizer, vocab_size=len(eng.tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    ok = 0
    for o in outs:
        m = xgr.GrammarMatcher(compiled)
        ok += all(m.accept_token(t) for t in o["output_ids"])
    return ok


def _host_profile(eng: Any, prompts: list[str], sp: dict[str, Any], label: str) -> None:
    """cProfile of the loop thread (where all host work of a step runs) over one run."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    eng.loop.call(prof.enable)
    secs, _ = _run(eng, prompts, sp)
    eng.loop.call(prof.disable)
    print(f"host profile (loop thread, {label} run, wall {secs:.2f} s under cProfile):")
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(22)
    st.sort_stats("cumulative").print_stats(r"overlap|runner|constraints|grammar|sampler|loop|scheduler", 18)


def _gpu_profile(eng: Any, prompts: list[str], sp: dict[str, Any], label: str, timer: StepTimer) -> None:
    """GPU busy time against wall time over one run (torch.profiler, CUDA kernels only), and the
    GPU's idle time per loop step."""
    from torch.profiler import ProfilerActivity, profile

    timer.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        secs, _ = _run(eng, prompts, sp)
    print(f"[{label}]", end=" ")
    busy = print_gpu_profile(prof, secs)
    steps = timer.summary()["steps"]
    n = max(steps, 1)
    print(f"[{label}] GPU busy per step {1e3 * busy / n:.3f} ms, idle per step {1e3 * (secs - busy) / n:.3f} ms "
          f"over {steps} steps (under the profiler)")


def _profiles(host: bool, gpu: bool) -> Optional[Callable[[Any, list[str], dict[str, Any], str, StepTimer], None]]:
    """One more run of a kind under the profiles asked for (cProfile of the loop thread, the GPU's busy
    time), as ``(eng, prompts, sampling params, label, step timer)``; None when none is asked."""
    if not (host or gpu):
        return None

    def run(eng: Any, prompts: list[str], sp: dict[str, Any], label: str, timer: StepTimer) -> None:
        if host:
            _host_profile(eng, prompts, sp, label)
        if gpu:
            _gpu_profile(eng, prompts, sp, label, timer)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF dir (config.json); default: the embedded model")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model dir)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--num", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each kind")
    add_json_option(ap, "the results")
    ap.add_argument("--host-profile", action="store_true",
                    help="one more run of each kind (extract: with and without jump-forward) under cProfile "
                         "of the engine's loop thread")
    ap.add_argument("--gpu-profile", action="store_true",
                    help="one more run of each kind (extraction too) under torch.profiler "
                         "(GPU busy and idle time per step)")
    ap.add_argument("--jump-forward", action="store_true", help="the json runs with jump-forward decoding")
    ap.add_argument("--phases", action="store_true",
                    help="each run also prints its host time per step by phase (bench/phases.py)")
    ap.add_argument("--threads", default="",
                    help="comma list of NBGEN_GRAMMAR_THREADS values: each repeat runs a free and a json run "
                         "at each, in turn; a json/free ratio per value")
    ap.add_argument("--extract", type=int, default=256, help="prompts of the realistic workload (0: skip it)")
    ap.add_argument("--extract-max-new-tokens", type=int, default=512)
    ap.add_argument("--extract-chunks", action="store_true",
                    help="extract: also jump-forward with forced tokens as chunks instead of decode rows")
    args = ap.parse_args()

    # jump-forward is built in, and switched per run (the grammar service's jumper)
    kw: dict[str, Any] = {"device": args.device, "load_format": args.load_format, "enable_return_hidden_states": True,
                          "enable_jump_forward": True}
    if args.tokenizer:
        kw["tokenizer_path"] = args.tokenizer
    eng = Engine(args.model, **kw) if args.model else Engine(**kw)
    prompts = [eng.apply_chat_template([{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} "
                                         f"Reply in JSON (request {i})."}]) for i in range(args.num)]
    base = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    json_sp = {**base, "json_schema": json.dumps(SCHEMA)}
    # warm-up: kernels, graphs, xgrammar's tokenizer info and bitmask kernel (another schema), then
    # SCHEMA's first use (its compilation) on its own: the timed runs measure steady-state decoding
    eng.generate(prompts[:8], {**base, "max_new_tokens": 8}, use_tqdm=False)
    eng.generate(prompts[:8], {**base, "max_new_tokens": 8, "json_schema": json.dumps(WARM_SCHEMA)}, use_tqdm=False)
    service = eng.loop.delivery.grammar
    jumper = service.jumper
    if not args.jump_forward:
        eng.loop.call(lambda: setattr(service, "jumper", None))
    first_use, _ = _run(eng, prompts[:8], {**json_sp, "max_new_tokens": 8})
    print(f"first use of the schema (compile + 8 requests x 8 tokens): {first_use:.2f} s")
    # and once at the full batch: the bitmask fill's worker and thread pool start from 32 rows, and
    # Triton specialises the mask kernel on the batch size (a JIT compile, like flashinfer's)
    warm, _ = _run(eng, prompts, {**json_sp, "max_new_tokens": 16})
    print(f"full-batch warm-up ({args.num} requests x 16 tokens): {warm:.2f} s")
    rows: dict[str, Any] = {"free": [], "json": []}
    matched: list[float] = []    # free time / json time at the json run's output lengths (where outputs completed)
    last: dict[str, list] = {}
    timer = StepTimer(eng)
    phases = PhaseTimer(eng) if args.phases else None
    settings = [int(t) for t in args.threads.split(",")] if args.threads else [0]
    if min(settings) < 1 and args.threads:
        raise ValueError(f"threads must be positive integers, got {args.threads!r}")
    pairs: dict[int, list[tuple[float, float]]] = {t: [] for t in settings}   # (json/free, json host ms)
    for _, threads in ((r, t) for r in range(args.repeats) for t in settings):
        if threads:
            os.environ["NBGEN_GRAMMAR_THREADS"] = str(threads)   # read at the next batch fill
        for kind, sp in (("free", base), ("json", json_sp)):
            timer.reset()
            if phases is not None:
                phases.reset()
            secs, outs = _run(eng, prompts, sp)
            n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
            st = timer.summary()
            rows[kind].append({"seconds": secs, "out_tokens": n_out, "out_tok_s": n_out / secs, **st})
            last[kind] = outs
            kind_at = f"{kind} t{threads}" if threads else kind
            print(f"{kind_at:5s} {secs:7.2f} s  {n_out:7d} out tokens  {n_out / secs:9.1f} out tok/s  "
                  f"{st['steps']} steps: {st['step_ms']:.2f} ms/step, device wait {st['wait_ms']:.2f}, "
                  f"host {st['host_ms']:.2f}", flush=True)
            if phases is not None:
                print(f"{kind_at:5s} {phases.line(st['steps'])}", flush=True)
        pairs[threads].append((rows["json"][-1]["out_tok_s"] / rows["free"][-1]["out_tok_s"], rows["json"][-1]["host_ms"]))
        lens = [o["meta_info"]["completion_tokens"] for o in last["json"]]
        if min(lens) < args.max_new_tokens:   # outputs that completed their grammar: free runs of the same lengths too
            msecs, _ = _run(eng, prompts, [{**base, "max_new_tokens": n} for n in lens])
            matched.append(msecs / rows["json"][-1]["seconds"])
    if args.threads:
        for t, got in pairs.items():
            print(f"threads {t}: json/free median {100 * statistics.median(r for r, _ in got):.1f}% "
                  f"(runs {', '.join(f'{100 * r:.1f}' for r, _ in got)}), json host per step median "
                  f"{statistics.median(h for _, h in got):.2f} ms", flush=True)
    profile = _profiles(args.host_profile, args.gpu_profile)
    for kind, sp in (("free", base), ("json", json_sp)) if profile is not None else ():
        profile(eng, prompts, sp, kind, timer)
    if phases is not None:
        phases.close()                              # before the step timer: its wrappers are on top
    timer.close()
    best = {k: max(v, key=lambda r: r["out_tok_s"]) for k, v in rows.items()}
    median = {k: statistics.median(r["out_tok_s"] for r in v) for k, v in rows.items()}
    # best of the run pairs (each json run against the free run just before it, on the same host state):
    # the best json run over the best free run fell below the median ratio when one free run was fast
    ratio = max(j["out_tok_s"] / f["out_tok_s"] for f, j in zip(rows["free"], rows["json"]))
    ratio_median = median["json"] / median["free"]
    valid = _validity(last["json"], SCHEMA)
    consistent = grammar_consistent(eng, last["json"], SCHEMA)
    lens = sorted(o["meta_info"]["completion_tokens"] for o in last["json"])
    print(f"json/free throughput: best pair {100 * ratio:.1f}%, median {100 * ratio_median:.1f}% "
          f"({len(rows['json'])} runs each); constrained outputs: "
          f"{valid['complete']}/{args.num} completed the grammar, {valid['valid']} of those valid; "
          f"{consistent} accepted token by token by a fresh matcher; "
          f"completion tokens min/median/max {lens[0]}/{lens[len(lens) // 2]}/{lens[-1]}")
    if matched:   # a json run's outputs that complete their grammar stop early; its batch thins out
        print(f"json/free at the json runs' output lengths (free requests generate as many tokens as each json "
              f"request did): median {100 * statistics.median(matched):.1f}%, best {100 * max(matched):.1f}% "
              f"({len(matched)} runs)")
    host = {k: statistics.median(r["host_ms"] for r in v) for k, v in rows.items()}
    print(f"host time per step (median): free {host['free']:.2f} ms, json {host['json']:.2f} ms "
          f"({'device wait excluded' if args.device == 'cuda' else 'model forward excluded'})")
    print("sample:", repr(last["json"][0]["text"][:160]))
    eng.loop.call(lambda: setattr(service, "jumper", jumper))
    extract = grammar_extract.run(eng, args.extract, args.extract_max_new_tokens, args.repeats,
                                  profile,
                                  args.extract_chunks, args.phases) if args.extract else None
    # checks on this device: free requests give the same greedy text beside constrained ones
    free_sp = {**base, "max_new_tokens": 24}
    k = max(1, min(8, len(prompts) // 2))
    alone = [o["text"] for o in eng.generate(prompts[:k], free_sp, use_tqdm=False)]
    mixed = eng.generate(prompts[:2 * k], [free_sp] * k + [{**free_sp, "json_schema": json.dumps(SCHEMA)}] * k,
                         use_tqdm=False)
    hs = eng.generate(prompts[0], {**free_sp, "max_new_tokens": 4}, return_hidden_states=True)
    checks = {"mixed_free_identical": [o["text"] for o in mixed[:k]] == alone,
              # SGLang's shape: [the prompt's states, one per later token]: [tokens, prompt_len, hidden]
              "hidden_states": [len(hs["meta_info"]["hidden_states"]), len(hs["meta_info"]["hidden_states"][0]),
                                len(hs["meta_info"]["hidden_states"][1])]}
    print("checks:", checks)
    info = eng.get_server_info()
    eng.shutdown()
    write_json(args.json, {"runs": rows, "best": best, "ratio": ratio, "median": median, "ratio_median": ratio_median,
                           "first_use_s": first_use, "validity": valid, "consistent": consistent,
                           "ratio_same_lengths": matched,
                           "host_ms_median": host, "jump_forward": args.jump_forward, "extract": extract,
                           "checks": checks,
                           "model": args.model,
                           "device": info["device"], "attention_backend": info["attention_backend"]})


if __name__ == "__main__":
    main()
