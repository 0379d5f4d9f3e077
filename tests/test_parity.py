"""Token-for-token parity with HF transformers (fp32, greedy) on tiny random models.

Eight prompts of 1..320 tokens run batched together; the same outputs must come back on a second
run that hits the prefix cache, with chunked prefill, and under a KV budget that forces preemption.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

import nbgen
from tests.tiny_models import make_tiny_model

FAMILIES = ["llama", "llama3", "qwen2", "qwen3"]
LENGTHS = [1, 2, 7, 16, 17, 40, 130, 320]
NEW = 24
DEVICE = os.environ.get("NBGEN_TEST_DEVICE", "cpu")  # the GPU host runs these with cuda too


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs, lps = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            g = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                            min_new_tokens=NEW, pad_token_id=0)
            outs.append(g[0, len(ids):].tolist())
            logits = hf(x).logits[0].float().log_softmax(-1)            # [L, V]
            lps.append([logits[i - 1, ids[i]].item() for i in range(1, len(ids))])
    return outs, lps


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tmp_path_factory):
    path = make_tiny_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    prompts = _prompts(380)
    ref_ids, ref_lps = _hf_greedy(path, prompts)
    return path, prompts, ref_ids, ref_lps


SP = {"temperature": 0.0, "max_new_tokens": NEW, "min_new_tokens": NEW}


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_parity_batched_and_prefix_cache(family_case):
    path, prompts, ref_ids, ref_lps = family_case
    with nbgen.Engine(path, dtype="float32", device=DEVICE) as eng:
        first = eng.generate(input_ids=prompts, sampling_params=SP, return_logprob=True, logprob_start_len=0)
        assert _ids(first) == ref_ids
        for out, ref in zip(first, ref_lps):
            got = [lp for lp, _tok, _txt in out["meta_info"]["input_token_logprobs"][1:]]
            assert len(got) == len(ref)
            assert max((abs(a - b) for a, b in zip(got, ref)), default=0.0) < 1e-4
        second = eng.generate(input_ids=prompts, sampling_params=SP)
        assert _ids(second) == ref_ids
        cached = [o["meta_info"]["cached_tokens"] for o in second]
        assert cached[-1] >= 320 - 16, cached  # the long prompt is served from the prefix cache


def test_parity_chunked_prefill(family_case):
    path, prompts, ref_ids, _ = family_case
    with nbgen.Engine(path, dtype="float32", device=DEVICE, chunked_prefill_size=16) as eng:
        assert _ids(eng.generate(input_ids=prompts, sampling_params=SP)) == ref_ids


def test_parity_under_preemption(family_case):
    path, prompts, ref_ids, _ = family_case
    # 360 tokens of KV for ~530 tokens of prompts + 192 new ones: decode growth must preempt
    with nbgen.Engine(path, dtype="float32", device=DEVICE, max_total_tokens=360, page_size=8) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=SP)
        assert _ids(outs) == ref_ids
        assert eng.loop.scheduler.stats().get("num_preemptions", 0) > 0


@pytest.mark.skipif(DEVICE != "cpu", reason="the torch decode path is the CPU fallback")
def test_parity_torch_decode_path(family_case, monkeypatch):
    """Without nbgen's C kernel (no compiler) the CPU decodes take the torch gather path: same ids."""
    from nbgen.kernels import cpu_ops

    path, prompts, ref_ids, _ = family_case
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    with nbgen.Engine(path, dtype="float32", device=DEVICE) as eng:
        assert eng.loop.runner.backend.cpu_kernels is False
        assert _ids(eng.generate(input_ids=prompts, sampling_params=SP)) == ref_ids
