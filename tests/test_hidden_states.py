"""return_hidden_states as SGLang returns them: meta_info["hidden_states"][0] holds every prompt
position's final-normed last-layer state ([prompt_len][hidden]), then one [hidden] per later
generated token (the position that produced it). Compared with HF's ``output_hidden_states[-1]``
over prompt + output[:-1] on tiny fp32 Llama / Qwen2 / Qwen3: with chunked prefill, behind a cached
prefix, with preemption, sampled, n > 1 and streamed. The GPU test runs the bf16 paths (flashinfer,
piecewise prefill graphs, decode graphs)."""
from __future__ import annotations

import os

import pytest
import torch

import nbgen

pytestmark = pytest.mark.filterwarnings("ignore:1 other nbgen Engine is still running")
DEVICE = os.environ.get("NBGEN_TEST_DEVICE", "cpu")
GREEDY = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
LONG = [5 + (7 * i) % 300 for i in range(40)]         # longer than the 16-token chunks below
SHORT = [9, 8, 7, 6, 5]


def hf_states(model_dir: str, ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF's final-normed last-layer states [prompt + output - 1, H] (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids + output_ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]


def stacked(out: dict, prompt_len: int, hidden: int) -> torch.Tensor:
    """SGLang's list ([prompt][H], then [H] per later token) as one [positions, H] tensor; checks its shape."""
    hs = out["meta_info"]["hidden_states"]
    assert len(hs) == out["meta_info"]["completion_tokens"] == len(out["output_ids"])
    assert len(hs[0]) == prompt_len and all(len(row) == hidden for row in hs[0])
    assert all(len(h) == hidden and isinstance(h[0], float) for h in hs[1:])
    return torch.tensor(hs[0] + hs[1:])


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_dir(request) -> str:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def eng(family_dir):
    with nbgen.Engine(family_dir, dtype="float32", device=DEVICE, chunked_prefill_size=16,
                      enable_return_hidden_states=True) as e:
        yield e


def test_every_position_matches_hf_with_chunked_prefill(eng, family_dir):
    outs = eng.generate(input_ids=[LONG, SHORT], sampling_params=GREEDY, return_hidden_states=True)
    for ids, out in zip([LONG, SHORT], outs):
        got = stacked(out, len(ids), eng.hf_config.hidden_size)
        ref = hf_states(family_dir, ids, out["output_ids"])
        assert got.shape == ref.shape == (len(ids) + 4, eng.hf_config.hidden_size)
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_a_cached_prefix_is_recomputed_for_hidden_states(eng, family_dir):
    prompt = LONG + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    eng.generate(input_ids=LONG + [1, 2, 3], sampling_params=GREEDY)          # caches LONG's pages
    plain = eng.generate(input_ids=prompt, sampling_params=GREEDY)
    assert plain["meta_info"]["cached_tokens"] >= 32                           # the cache serves others
    out = eng.generate(input_ids=prompt, sampling_params=GREEDY, return_hidden_states=True)
    assert out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == plain["output_ids"]
    torch.testing.assert_close(stacked(out, len(prompt), eng.hf_config.hidden_size),
                               hf_states(family_dir, prompt, out["output_ids"]), atol=2e-4, rtol=1e-4)


def test_sampled_and_n_samples_with_logprobs(eng, family_dir):
    sp = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "n": 2, "sampling_seed": 3}
    outs = eng.generate(input_ids=SHORT + LONG[:20], sampling_params=sp, return_hidden_states=True,
                        return_logprob=True, logprob_start_len=0)
    assert len(outs) == 2
    for out in outs:
        assert len(out["meta_info"]["input_token_logprobs"]) == 25
        torch.testing.assert_close(stacked(out, 25, eng.hf_config.hidden_size),
                                   hf_states(family_dir, SHORT + LONG[:20], out["output_ids"]),
                                   atol=2e-4, rtol=1e-4)


def test_streamed_chunks_carry_their_new_states(eng):
    one = eng.generate(input_ids=LONG, sampling_params=GREEDY, return_hidden_states=True)
    chunks = list(eng.generate(input_ids=LONG, sampling_params=GREEDY, return_hidden_states=True, stream=True))
    parts = [c["meta_info"]["hidden_states"] for c in chunks[:-1]]
    assert len(parts[0][0]) == len(LONG)                      # the first token's chunk: the prompt block
    assert sum(parts, []) == one["meta_info"]["hidden_states"][:len(sum(parts, []))]
    assert chunks[-1]["meta_info"]["hidden_states"] == one["meta_info"]["hidden_states"]   # the last: all


def test_preempted_requests_keep_every_state(family_dir):
    """Two requests of 40 tokens in a 64-token KV cache: one is preempted and recomputes its prompt and
    output (the states it has are kept, the rest are collected once)."""
    prompts = [[5 + i for i in range(10)], [50 + i for i in range(10)]]
    sp = {**GREEDY, "max_new_tokens": 30}
    with nbgen.Engine(family_dir, dtype="float32", device=DEVICE, max_total_tokens=64, max_running_requests=2,
                      enable_return_hidden_states=True) as e:
        outs = e.generate(input_ids=prompts, sampling_params=sp, return_hidden_states=True, use_tqdm=False)
        assert sorted(o["meta_info"]["num_retractions"] for o in outs) == [0, 1]
        for ids, out in zip(prompts, outs):
            torch.testing.assert_close(stacked(out, 10, e.hf_config.hidden_size),
                                       hf_states(family_dir, ids, out["output_ids"]), atol=2e-4, rtol=1e-4)


def test_refused_without_enable_return_hidden_states(tiny_engine):
    with pytest.raises(ValueError, match="return_hidden_states=True needs an Engine created with "
                                         "enable_return_hidden_states=True"):
        tiny_engine.generate(["a", "b"], {"max_new_tokens": 2}, return_hidden_states=[False, True])
    with pytest.raises(TypeError, match="return_hidden_states must be a bool"):
        tiny_engine.generate("a", {"max_new_tokens": 2}, return_hidden_states="yes")
    out = tiny_engine.generate("a", {"max_new_tokens": 2, "ignore_eos": True}, return_hidden_states=False)
    assert "hidden_states" not in out["meta_info"] and out["meta_info"]["completion_tokens"] == 2
    with pytest.raises(ValueError, match="enable_return_hidden_states must be a bool"):
        nbgen.Engine(None, enable_return_hidden_states="yes")


@pytest.mark.gpu
def test_gpu_bf16_states_follow_hf(gpu_model_dir):
    """bf16 on CUDA: chunked prefill through flashinfer and the piecewise prefill graphs, decode through
    the decode graphs (hidden-state requests take the synchronous step), a cached prefix, beside
    requests without hidden states. Each state is compared with HF fp32 by cosine similarity."""
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=rng).tolist() for n in (300, 5, 70)]
    sp = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", chunked_prefill_size=128,
                      cuda_graph_max_bs=16, enable_return_hidden_states=True) as e:
        e.generate(input_ids=prompts[0][:200], sampling_params=sp)              # a cached prefix
        outs = e.generate(input_ids=prompts + prompts, sampling_params=sp,
                          return_hidden_states=[True] * 3 + [False] * 3, use_tqdm=False)
        info = e.get_server_info()
    assert info["cuda_graph_batch_sizes"] and info["piecewise_cuda_graph_tokens"]
    for ids, out, twin in zip(prompts, outs[:3], outs[3:]):
        assert "hidden_states" not in twin["meta_info"]
        got = stacked(out, len(ids), 512)
        ref = hf_states(gpu_model_dir, ids, out["output_ids"])
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        assert cos.min().item() > 0.99, cos.min().item()
