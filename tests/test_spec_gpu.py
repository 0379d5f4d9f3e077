"""Speculative decoding on CUDA (bf16, flashinfer backend; verify steps eager): NGRAM, STANDALONE and
EAGLE (chains and trees) runs agree with plain decoding (up to bf16 near-tie forks, as
tests/test_gpu.py) and accept drafts; tree verify (flashinfer's custom mask) against running each
path plainly."""
from __future__ import annotations

import random

import pytest

import nbgen

from tests.tiny_models import GREEDY_SP, assert_close_runs, gpu_generate, output_ids

gpu = pytest.mark.gpu


def _repeating_prompts(n: int = 12) -> list[list[int]]:
    """Prompts that are a random block repeated (prompt lookup drafts from them), batch of n."""
    rng = random.Random(1)
    return [[rng.randrange(2, 512) for _ in range(rng.choice([8, 33, 64]))] * rng.choice([2, 4]) for _ in range(n)]


def _accepted(outs: list[dict]) -> int:
    return sum(o["meta_info"]["spec_accepted_drafts"] for o in outs)


@gpu
def test_ngram_gpu(gpu_model_dir):
    prompts = _repeating_prompts()
    base = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    spec = gpu_generate(gpu_model_dir, prompts, logprobs=True, speculative_algorithm="NGRAM")
    assert_close_runs(spec, base)
    assert _accepted(spec) > 0
    # fp32 on CUDA (torch backend): token-identical
    runs = []
    for kw in ({}, {"speculative_algorithm": "NGRAM"}):
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="float32", attention_backend="torch", **kw) as eng:
            runs.append(output_ids(eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False)))
    assert runs[0] == runs[1]


@gpu
def test_standalone_gpu_self_draft(gpu_model_dir):
    """The target as its own draft: nearly every draft accepted, outputs as plain decoding; batch 32."""
    prompts = _repeating_prompts(32)
    base = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    spec = gpu_generate(gpu_model_dir, prompts, logprobs=True, speculative_algorithm="STANDALONE",
                        speculative_draft_model_path=gpu_model_dir, speculative_num_steps=3)
    assert_close_runs(spec, base)
    rate = _accepted(spec) / max(sum(o["meta_info"]["spec_proposed_drafts"] for o in spec), 1)
    assert rate > 0.8, rate


@gpu
@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_eagle_gpu_random_head(gpu_model_dir, tmp_path, algo, request):
    """EAGLE / EAGLE3 with a random head on CUDA: outputs as plain decoding (bf16 up to near-tie
    forks; fp32 with the torch backend token-identical), drafts proposed every decode step. EAGLE3
    reads three layers' features: a 6-layer target of the family (prefill through piecewise graphs)."""
    from nbgen.models.eagle import save_random_head
    from tests.tiny_models import make_gpu_model

    if algo == "EAGLE3":
        family = request.node.callspec.params["gpu_model_dir"]
        gpu_model_dir = make_gpu_model(family, str(tmp_path / "deep"), layers=6)
    head = save_random_head(gpu_model_dir, str(tmp_path / "head"), algo == "EAGLE3")
    kw = {"speculative_algorithm": algo, "speculative_draft_model_path": head, "speculative_num_steps": 3}
    prompts = _repeating_prompts()
    base = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    spec = gpu_generate(gpu_model_dir, prompts, logprobs=True, **kw)
    assert_close_runs(spec, base)
    assert sum(o["meta_info"]["spec_proposed_drafts"] for o in spec) > 0
    runs = []
    for k in ({}, kw):
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="float32", attention_backend="torch", **k) as eng:
            runs.append(output_ids(eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False)))
    assert runs[0] == runs[1]


@gpu
@pytest.mark.parametrize("dtype, backend", [("bfloat16", "flashinfer"), ("float32", "torch")])
def test_tree_verify_logits_gpu(gpu_model_dir, dtype, backend):
    """A tree verify chunk's logits (flashinfer: prefill with a custom mask) equal each node's path run
    as a plain causal chunk over the same prefix (bf16: within kernel rounding, same argmax)."""
    import gc

    import torch

    from tests.test_spec_tree import tree_vs_paths

    got, want = tree_vs_paths(gpu_model_dir, "cuda", dtype, backend)
    gc.collect()                          # the runner's KV pool and weights
    torch.cuda.empty_cache()
    if dtype == "float32":
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
        return
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 0.03, err
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75


@gpu
@pytest.mark.parametrize("head_kind", ["random", "copy"])
def test_eagle_tree_gpu(gpu_model_dir, tmp_path, head_kind):
    """EAGLE trees (SGLang's 5 / 4 / 8) on CUDA, batch 12: outputs as plain decoding (bf16 up to
    near-tie forks; fp32 with the torch backend token-identical); the copy head's trees are accepted
    (the accepted path's KV moved in flashinfer's HND pages)."""
    from nbgen.models.eagle import save_random_head
    from tests.tiny_models import make_copy_head

    path = str(tmp_path / "head")
    head = save_random_head(gpu_model_dir, path, False) if head_kind == "random" else make_copy_head(gpu_model_dir, path)
    kw = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": head, "speculative_num_steps": 5,
          "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}
    prompts = _repeating_prompts()
    base = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    spec = gpu_generate(gpu_model_dir, prompts, logprobs=True, **kw)
    assert_close_runs(spec, base)
    assert sum(o["meta_info"]["spec_proposed_drafts"] for o in spec) > 0
    if head_kind == "copy":
        assert _accepted(spec) > 0
    runs = []
    for k in ({}, kw):
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="float32", attention_backend="torch", **k) as eng:
            runs.append(output_ids(eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False)))
    assert runs[0] == runs[1]
