"""The bench's workloads: random-id prompts (nano / fixed / bs1 / prefix), the same as text, and 32 chat questions (chat32).

All ignore_eos; ids are drawn with ``random.seed(0)`` below 10000 (DESIGN.md "Benchmarks").
"""
from __future__ import annotations

import random
from typing import Optional

from nbgen.models.embedded import default_model_path

QUESTIONS = [
    "What is the capital of France?", "How do plants make food?", "Name three primary colors.",
    "Why is the sky blue?", "What is 12 times 7?", "Explain gravity in one sentence.",
    "Who wrote Romeo and Juliet?", "What is a prime number?", "How many legs does a spider have?",
    "What is the boiling point of water?", "Give me a synonym for happy.", "What is photosynthesis?",
    "How far is the Moon from Earth?", "What does a CPU do?", "Translate 'thank you' to Spanish.",
    "What is the largest ocean?", "Why do we have seasons?", "What is machine learning?",
    "Name a famous painting.", "How do airplanes fly?", "What is the speed of light?",
    "Suggest a name for a cat.", "What is an atom?", "Why do leaves change color?",
    "What is the tallest mountain?", "How does a rainbow form?", "What is democracy?",
    "Write a haiku about rain.", "What is the square root of 81?", "Who painted the Mona Lisa?",
    "What language is spoken in Brazil?", "How do bees make honey?",
]


def make_workload(name: str) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, output lengths) of a random-id workload."""
    random.seed(0)
    if name == "bs1":
        return [[random.randint(0, 9999) for _ in range(256)]], [256]
    ins = [random.randint(100, 1024) for _ in range(256)]
    outs = [random.randint(100, 1024) for _ in range(256)] if name == "nano" else [512] * 256
    return [[random.randint(0, 9999) for _ in range(n)] for n in ins], outs


PREFIXES, PREFIX_LEN = 8, 2000     # W-prefix: 8 shared prompt prefixes of 2,000 tokens, 32 requests each


def prefix_workload() -> tuple[list[list[int]], list[int], list[int]]:
    """W-prefix: (prompt ids, output lengths, each prompt's prefix index). 256 requests, each a shared
    prefix (a system prompt plus few-shot examples) followed by its own randint(50, 300) tokens, 32
    requests per prefix in shuffled order, outputs randint(100, 512)."""
    random.seed(0)
    heads = [[random.randint(0, 9999) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    group = [g for g in range(PREFIXES) for _ in range(256 // PREFIXES)]
    random.shuffle(group)
    prompts = [heads[g] + [random.randint(0, 9999) for _ in range(random.randint(50, 300))] for g in group]
    return prompts, [random.randint(100, 512) for _ in group], group


def chat32_prompts(model: Optional[str]) -> list[str]:
    """The 32 questions, each rendered with the model's chat template (the embedded model's by default)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model or default_model_path())
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS]


def text_prompts(prompts: list[list[int]], tokenizer_dir: Optional[str]) -> list[str]:
    """The id prompts as text: each id taken modulo the tokenizer's vocabulary, decoded (special
    tokens skipped); re-tokenized by the engine, the prompts' lengths change a little."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir or default_model_path())
    v = len(tok)
    return [tok.decode([t % v for t in p], skip_special_tokens=True) for p in prompts]
