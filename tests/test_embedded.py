"""The embedded default model (SmolLM2-135M-Instruct GGUF): real text and greedy parity with HF."""
from __future__ import annotations

import pytest
import torch

import nbgen

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_engine():
    eng = nbgen.Engine()            # embedded model, CPU default dtype
    yield eng
    eng.shutdown()


def test_capital_of_france(default_engine):
    out = default_engine.chat(QUESTION, {"temperature": 0, "max_new_tokens": 24})
    assert "Paris" in out["text"], out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_greedy_equals_hf_gguf_fp32():
    from transformers import AutoModelForCausalLM

    from nbgen.models.embedded import download_gguf

    gguf = download_gguf()
    with nbgen.Engine(dtype="float32") as eng:
        prompts = [eng.apply_chat_template(QUESTION),
                   eng.apply_chat_template([{"role": "user", "content": "Write a haiku about autumn."}]),
                   "Once upon a time"]
        ours = eng.generate(prompts, {"temperature": 0, "max_new_tokens": 24, "min_new_tokens": 24},
                            use_tqdm=False)
        ids = [eng.tokenizer.encode(p) for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        for p_ids, out in zip(ids, ours):
            x = torch.tensor([p_ids])
            g = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24,
                            min_new_tokens=24, pad_token_id=0)
            assert out["output_ids"] == g[0, len(p_ids):].tolist()
