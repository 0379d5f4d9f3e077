"""The extraction workload's scheduling on the CPU: ``python -m nbgen.bench.grammar_replay``.

A host-only replay of ``bench/grammar_extract.py``: a 1-layer random Llama with the real tokenizer's
vocabulary (default: the embedded model's) stands in for the model, so the forward is cheap and the
steps are the engine's own (the overlap stepper forced on as on CUDA, jump-forward forced rows
capped at ``--forced-rows`` like the largest decode graph). Outputs are random but complete their
grammar; every output is validated. Per run (token by token, then jump-forward): steps, host ms per
step (``StepTimer``: the forward excluded), the steps that held forced tokens as chunks (mixed
prefill steps on CUDA) and the forced rows, and how many constrained steps sampled by the masked
argmax (``FillJob.greedy``).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch

from nbgen.bench import grammar_extract
from nbgen.bench.phases import PhaseTimer
from nbgen.bench.profiling import StepTimer
from nbgen.bench.report import add_json_option, write_json
from nbgen.engine import Engine
from nbgen.models.embedded import default_model_path
from nbgen.runtime.overlap import OverlapStepper


def tiny_model(path: str, tokenizer_dir: str) -> None:
    """Save a 1-layer random Llama with the tokenizer's vocabulary at ``path``."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():           # wider logits: fewer near-ties between greedy choices
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path)


class StepCounts:
    """Counts over the loop thread's steps: scheduled batches with forced chunks, forced rows, and
    constrained steps on the masked-argmax path (installed on the loop thread)."""

    def __init__(self, eng: Any) -> None:
        self.batches = self.chunked = self.forced_rows = self.fills = self.masked = 0
        loop = eng.loop
        sched, cons = loop.scheduler, loop.runner.sampler.constraints
        schedule, fill_async = sched.schedule, cons.fill_async

        def counted_schedule() -> Any:
            batch = schedule()
            if batch is not None:
                self.batches += 1
                out = [s for s in batch.seqs if s.start_pos >= len(s.req.prompt_ids)]
                self.chunked += any(len(s.token_ids) > 1 for s in out)
                self.forced_rows += sum(1 for s in out if not s.sample)
            return batch

        def counted_fill(*args: Any, **kwargs: Any) -> Any:
            job = fill_async(*args, **kwargs)
            if job is not None:
                self.fills += 1
                self.masked += job.greedy
            return job

        loop.call(lambda: (setattr(sched, "schedule", counted_schedule), setattr(cons, "fill_async", counted_fill)))

    def take(self) -> dict[str, int]:
        out = {k: getattr(self, k) for k in ("batches", "chunked", "forced_rows", "fills", "masked")}
        self.batches = self.chunked = self.forced_rows = self.fills = self.masked = 0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the embedded model)")
    ap.add_argument("--num", type=int, default=256)
    ap.add_argument("--forced-rows", type=int, default=768, help="forced_token_rows (CUDA: the largest decode graph)")
    ap.add_argument("--repeats", type=int, default=1)
    add_json_option(ap, "the runs")
    args = ap.parse_args()
    tokenizer = args.tokenizer or default_model_path()
    with tempfile.TemporaryDirectory() as path:
        tiny_model(path, tokenizer)
        eng = Engine(path, tokenizer_path=tokenizer, device="cpu", dtype="float32", enable_jump_forward=True,
                     max_running_requests=args.num, chunked_prefill_size=16384, max_total_tokens=args.num * 260,
                     random_seed=0)
    loop = eng.loop
    loop.call(lambda: (setattr(loop, "_overlap", OverlapStepper.from_loop(loop)),
                       setattr(loop.scheduler.cfg, "forced_token_rows", args.forced_rows)))
    prompts = grammar_extract.prompts(eng, args.num)
    sp = {"temperature": 0.0, "max_new_tokens": 512, "json_schema": json.dumps(grammar_extract.SCHEMA)}
    eng.generate(prompts[:4], {**sp, "max_new_tokens": 8}, use_tqdm=False)     # compile the schema
    service = loop.delivery.grammar
    jumper = service.jumper
    timer, counts = StepTimer(eng), StepCounts(eng)
    phases = PhaseTimer(eng)
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for kind in ("token_by_token", "jump_forward"):
            loop.call(lambda: setattr(service, "jumper", None if kind == "token_by_token" else jumper))
            timer.reset()
            phases.reset()
            counts.take()
            t0 = time.perf_counter()
            outs = eng.generate(prompts, sp, use_tqdm=False)
            r = {"kind": kind, "seconds": time.perf_counter() - t0, **grammar_extract.check(outs),
                 **timer.summary(), **counts.take()}
            runs.append(r)
            print(f"{kind:15s} {r['valid']}/{r['n']} valid, {r['steps']} steps, host {r['host_ms']:.2f} ms/step "
                  f"(forward {r['wait_ms']:.1f}); batches with forced chunks {r['chunked']} of {r['batches']}, "
                  f"forced rows {r['forced_rows']}; masked-argmax steps {r['masked']} of {r['fills']}", flush=True)
            print(f"{kind:15s} {phases.line(r['steps'])}", flush=True)
    phases.close()
    timer.close()
    eng.shutdown()
    write_json(args.json, {"forced_rows": args.forced_rows, "runs": runs})


if __name__ == "__main__":
    main()
