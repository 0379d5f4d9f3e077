"""FP8 accuracy on a real model: teacher-forced next-token agreement and perplexity per mode.

The embedded SmolLM2 (real weights) reads a fixed text the repo ships (``bench/texts/fp8_accuracy.txt``)
once per mode, teacher-forced, through the Engine's prompt logprobs (one prefill, every position's
logprob of the true next token and its top-1 token). Modes: ``bf16`` (the reference), ``fp8-weights``
(``quantization="fp8"``), ``fp8-kv`` (``kv_cache_dtype="fp8_e4m3"``) and ``fp8-both``. Reported per mode:
top-1 agreement with bf16, mean |delta logprob| of the true tokens, perplexity and its change.

On the CPU the fp8 modes run the torch reference arithmetic (``models/fp8_linear.py``,
``attention/kv_quant.py``), the same the GPU kernels are tested against.

    python -m nbgen.bench.fp8_accuracy [--tokens 1024] [--device cpu]
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from importlib import resources
from typing import Optional

from nbgen.engine import Engine

MODES: dict[str, dict[str, str]] = {
    "bf16": {},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8-both": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
}


@dataclass
class ModeResult:
    """One mode's teacher-forced numbers (agreement and delta against the bf16 run)."""

    mode: str
    top1_agreement: float        # share of positions whose top-1 token equals bf16's
    mean_abs_dlogprob: float     # mean |logprob(true token) - bf16's| over positions
    perplexity: float
    ppl_change: float            # perplexity / bf16's - 1


def shipped_text() -> str:
    """The fixed English text of the study."""
    return resources.files("nbgen.bench").joinpath("texts/fp8_accuracy.txt").read_text()


def teacher_forced(engine: Engine, ids: list[int]) -> tuple[list[float], list[int]]:
    """(logprob of each true next token, top-1 token id) at positions 1..len(ids)-1."""
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    meta = out["meta_info"]
    lps = [lp for lp, _tok, *_ in meta["input_token_logprobs"][1:]]
    tops = [top[0][1] for top in meta["input_top_logprobs"][1:]]
    return lps, tops


def run(tokens: int = 1024, device: str = "cpu", modes: Optional[list[str]] = None,
        text: Optional[str] = None) -> list[ModeResult]:
    """Every mode (bf16 first) on the first ``tokens`` tokens of the text; results in MODES order."""
    names = ["bf16"] + [m for m in (modes or list(MODES)) if m != "bf16"]
    ref_lps: list[float] = []
    ref_tops: list[int] = []
    results = []
    for name in names:
        with Engine(dtype="bfloat16", device=device, disable_radix_cache=True, **MODES[name]) as eng:
            ids = eng.tokenizer.encode(text or shipped_text())[:tokens]
            lps, tops = teacher_forced(eng, ids)
        if name == "bf16":
            ref_lps, ref_tops = lps, tops
        n = len(lps)
        ppl = math.exp(-sum(lps) / n)
        ref_ppl = math.exp(-sum(ref_lps) / n)
        results.append(ModeResult(name, sum(a == b for a, b in zip(tops, ref_tops)) / n,
                                  sum(abs(a - b) for a, b in zip(lps, ref_lps)) / n, ppl, ppl / ref_ppl - 1))
    return results


def main(argv: Optional[list[str]] = None) -> None:
    """Print the table of ``run``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of the shipped text to read")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", nargs="*", choices=list(MODES), default=None)
    args = ap.parse_args(argv)
    print(f"{'mode':<12} {'top-1 agree':>11} {'mean|dlp|':>10} {'ppl':>8} {'ppl change':>10}")
    for r in run(args.tokens, args.device, args.modes):
        print(f"{r.mode:<12} {r.top1_agreement:>11.4f} {r.mean_abs_dlogprob:>10.4f} {r.perplexity:>8.3f} "
              f"{r.ppl_change:>+10.2%}")


if __name__ == "__main__":
    main()
