"""Diagnostic A/B of the fill worker's accept parts in one engine: ``python -m nbgen.bench.grammar_parts_ab``.

The engine, prompts and warm-up of ``bench.grammar``; then for each setting in turn (``--parts``,
repeated ``--rounds`` times), a free and a json run (256 greedy requests x 256 tokens), each run's
tok/s, host ms per step and phases, and per setting the median json/free ratio. Sets the module
constant ``fill_worker.ACCEPT_PARTS`` between runs (the engine idle); a setting ending in ``c``
(``2c``) also has the loop thread queue the bitmask's copy to the GPU at sampling instead of the fill
worker on its side stream (the worker's ``copy_out`` answers None).
"""
from __future__ import annotations

import argparse
import json
import statistics

from nbgen.bench.grammar import SCHEMA, WARM_SCHEMA, _run
from nbgen.bench.phases import PhaseTimer
from nbgen.bench.profiling import StepTimer
from nbgen.bench.workloads import QUESTIONS
from nbgen.engine import Engine
from nbgen.runtime import fill_worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default="2,3,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    eng = Engine(args.model, load_format=args.load_format, tokenizer_path=args.tokenizer, device=args.device,
                 enable_jump_forward=True)
    prompts = [eng.apply_chat_template([{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} "
                                         f"Reply in JSON (request {i})."}]) for i in range(args.num)]
    base = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    json_sp = {**base, "json_schema": json.dumps(SCHEMA)}
    eng.generate(prompts[:8], {**base, "max_new_tokens": 8}, use_tqdm=False)
    eng.generate(prompts[:8], {**base, "max_new_tokens": 8, "json_schema": json.dumps(WARM_SCHEMA)}, use_tqdm=False)
    service = eng.loop.delivery.grammar
    eng.loop.call(lambda: setattr(service, "jumper", None))
    _run(eng, prompts, {**json_sp, "max_new_tokens": 16})
    timer, phases = StepTimer(eng), PhaseTimer(eng)
    settings = args.parts.split(",")
    got: dict[str, list[tuple[float, float]]] = {p: [] for p in settings}
    worker = eng.loop.runner.sampler.constraints._worker
    copy_out = worker.copy_out
    for _ in range(args.rounds):
        for parts in settings:
            fill_worker.ACCEPT_PARTS = int(parts.rstrip("c"))
            worker.copy_out = (lambda *a, **k: None) if parts.endswith("c") else copy_out
            tps, host = {}, 0.0
            for kind, sp in (("free", base), ("json", json_sp)):
                timer.reset()
                phases.reset()
                secs, outs = _run(eng, prompts, sp)
                st = timer.summary()
                tps[kind] = sum(o["meta_info"]["completion_tokens"] for o in outs) / secs
                host = st["host_ms"]
                print(f"p{parts} {kind} {tps[kind]:9.0f} tok/s host {st['host_ms']:.2f} wait {st['wait_ms']:.2f} "
                      f"{phases.line(st['steps'])}", flush=True)
            got[parts].append((tps["json"] / tps["free"], host))
    for parts, pairs in got.items():
        print(f"== accept parts {parts}: json/free median {100 * statistics.median(r for r, _ in pairs):.1f}% "
              f"(runs {', '.join(f'{100 * r:.1f}' for r, _ in pairs)}), json host median "
              f"{statistics.median(h for _, h in pairs):.2f} ms", flush=True)
    phases.close()
    timer.close()
    eng.shutdown()


if __name__ == "__main__":
    main()
