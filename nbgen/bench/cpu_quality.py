"""How closely the embedded model's quantized CPU arithmetic follows the dequantized fp32 model:
``python -m nbgen.bench.cpu_quality``.

The embedded SmolLM2 GGUF (Q4_1 layers, Q8_0 output matrix), three engines on the CPU:

- ``fp32``: the GGUF dequantized to fp32 (the reference);
- ``bf16``: the dequantized weights in bf16, steps of many rows (the batched path: oneDNN bf16 linears
  and LM head);
- ``quantized``: the same engine with ``chunked_prefill_size=4``, so every step has at most 4 rows and
  takes the quantized kernels a batch-1 decode step takes (the 4-bit GEMV on the Q4_1 layers with int16
  activations, the int8 LM head on the Q8_0 grid).

Each engine reads, teacher-forced (prompt logprobs, one prefill): the 32 chat prompts, each followed by the
fp32 engine's own greedy answer (``--answer-tokens``), and the fixed text ``bench/texts/fp8_accuracy.txt``.
Reported per mode against fp32: top-1 agreement over the answers' positions, mean |delta logprob| of
the true tokens, and the text's perplexity and its change.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

from nbgen.bench.fp8_accuracy import shipped_text, teacher_forced
from nbgen.bench.workloads import chat32_prompts
from nbgen.engine import Engine

MODES: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {},
    "quantized": {"chunked_prefill_size": 4},
}


def _read(eng: Engine, seqs: list[list[int]], text: list[int]) -> tuple[list[tuple[list[float], list[int]]],
                                                                     list[float]]:
    """Teacher-forced (logprobs, top-1) of each sequence, and the text's logprobs."""
    return [teacher_forced(eng, s) for s in seqs], teacher_forced(eng, text)[0]


def run(answer_tokens: int = 48, text_tokens: int = 512, num_prompts: int = 32) -> list[dict[str, Any]]:
    """Every mode against fp32 (fp32 first); one dict per mode."""
    prompts = chat32_prompts(None)[:num_prompts]
    rows, ref = [], None
    for mode, kw in MODES.items():
        with Engine(device="cpu", **kw) as eng:
            if ref is None:       # fp32 writes the answers every mode reads
                ids = [list(eng.tokenizer.encode(p)) for p in prompts]
                outs = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": answer_tokens,
                                                                     "temperature": 0, "ignore_eos": True},
                                    use_tqdm=False)
                seqs = [i + o["output_ids"] for i, o in zip(ids, outs)]
                starts = [len(i) - 1 for i in ids]           # logprob index of each answer's first token
                text = list(eng.tokenizer.encode(shipped_text()))[:text_tokens]
            forced, text_lps = _read(eng, seqs, text)
            info = eng.get_server_info()
        if ref is None:
            ref = (forced, text_lps)
        pairs = [(a, b) for (lp0, t0), (lp, t), s in zip(ref[0], forced, starts)
                 for a, b in zip(zip(lp0[s:], t0[s:]), zip(lp[s:], t[s:]))]
        ppl = math.exp(-sum(text_lps) / len(text_lps))
        ppl0 = math.exp(-sum(ref[1]) / len(ref[1]))
        rows.append({"mode": mode, "top1_agreement": sum(a[1] == b[1] for a, b in pairs) / len(pairs),
                     "mean_abs_dlogprob": sum(abs(a[0] - b[0]) for a, b in pairs) / len(pairs),
                     "positions": len(pairs), "perplexity": ppl, "ppl_change": ppl / ppl0 - 1,
                     "int4_linears": info.get("int4_linears", 0), "int8_linears": info.get("int8_linears", 0)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--text-tokens", type=int, default=512)
    args = ap.parse_args()
    print(f"{'mode':<10}{'top-1 vs fp32':>14}{'mean |dlp|':>12}{'positions':>11}{'perplexity':>12}{'change':>9}"
          f"{'int4 / int8 linears':>21}")
    for r in run(args.answer_tokens, args.text_tokens):
        print(f"{r['mode']:<10}{r['top1_agreement']:>14.4f}{r['mean_abs_dlogprob']:>12.4f}{r['positions']:>11}"
              f"{r['perplexity']:>12.3f}{100 * r['ppl_change']:>8.2f}%{r['int4_linears']:>13} / {r['int8_linears']}")


if __name__ == "__main__":
    main()
