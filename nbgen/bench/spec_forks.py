"""Where greedy outputs of engines with and without CUDA graphs fork (CUDA, bf16):
``python -m nbgen.bench.spec_forks --model DIR [--load-format dummy] [--num-draft-tokens 4]``.

NGRAM engines with verify graphs and with ``disable_cuda_graph=True``, and plain engines both ways (the
fork rate of bf16 kernels of different tilings without speculation), on the GPU tests' prompts
(tests/test_verify_graphs.py), greedy: how many outputs are identical, and for each that is not, where
it forks and both runs' top-2 logprob gap there (a fork at a near-tie shows a small gap in both; a
wrong kernel forks with large gaps), with the largest logprob difference before the fork.
"""
from __future__ import annotations

import argparse
import random
from typing import Any, Optional

from nbgen.engine import Engine


def _prompts(n: int) -> list[list[int]]:
    """The GPU tests' prompts (tests/test_verify_graphs.py): random blocks repeated."""
    rng = random.Random(2)
    return [[rng.randrange(2, 512) for _ in range(rng.choice([8, 21, 40]))] * rng.choice([2, 3]) for _ in range(n)]


def engine_check(args: argparse.Namespace) -> None:
    """Outputs with and without CUDA graphs (NGRAM and plain engines): forks and the top-2 gaps there."""
    prompts = _prompts(12)
    sp = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
    kw: dict[str, Any] = {"load_format": args.load_format} if args.load_format else {}
    for label, extra in (("plain", {}), ("NGRAM", {"speculative_algorithm": "NGRAM",
                                                   "speculative_num_draft_tokens": args.num_draft_tokens})):
        runs, graph_steps = [], 0
        for off in (False, True):
            with Engine(args.model, device="cuda", dtype="bfloat16", disable_cuda_graph=off, random_seed=0,
                        cuda_graph_max_bs=16, **kw, **extra) as eng:
                runs.append(eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True,
                                         top_logprobs_num=2, use_tqdm=False))
                if not off:
                    graph_steps = eng.stats().get("spec_verify_graph_steps", 0)
        same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(*runs))
        print(f"\n==== engine {label}: graphs on vs off, {same} of {len(prompts)} identical; "
              f"verify graph replays {graph_steps}")
        for i, (a, b) in enumerate(zip(*runs)):
            n = next((j for j, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y), None)
            if n is None:
                continue
            gaps = []
            for o in (a, b):
                top = o["meta_info"]["output_top_logprobs"][n]
                gaps.append(round(top[0][0] - top[1][0], 4) if len(top) > 1 else None)
            la = a["meta_info"]["output_token_logprobs"]
            lb = b["meta_info"]["output_token_logprobs"]
            dmax = max([abs(x[0] - y[0]) for x, y in zip(la[:n], lb[:n])], default=0.0)
            print(f"  seq {i}: fork at token {n} (on {a['output_ids'][n]} / off {b['output_ids'][n]}), top-2 gap "
                  f"there on {gaps[0]} / off {gaps[1]}; max |dlogprob| before it {dmax:.4f}")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default=None)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    engine_check(ap.parse_args(argv))


if __name__ == "__main__":
    main()
