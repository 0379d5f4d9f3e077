"""Sampler: processors, greedy, seeded sampling (batch-independent), distributions, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from nbgen.runtime import logprobs as lp_mod
from nbgen.core.batch import SeqWork
from nbgen.core.request import LogprobRequest, Request
from nbgen.runtime.sampler import Sampler
from nbgen.runtime.sampling_ops import gumbel_noise, mix32, row_key
from nbgen.core.sampling import SamplingParams
from tests.tiny_models import run_under_triton_interpreter


CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def seq(params: dict | None = None, seed: int = 0, prompt: list[int] | None = None,
        output: list[int] | None = None, stop_ids: frozenset[int] = frozenset(),
        lp: LogprobRequest | None = None) -> SeqWork:
    req = Request(rid=f"r{seed}", prompt_ids=list(prompt or [0]),
                  params=SamplingParams.from_dict(params or {}), stop_ids=stop_ids,
                  logprobs=lp or LogprobRequest(), seed=seed)
    req.output_ids = list(output or [])
    return SeqWork(req=req, token_ids=[req.all_ids[-1]], start_pos=req.num_tokens - 1,
                   pages=[], sample=True)


def test_mix32_matches_python_reference_and_never_overflows() -> None:
    def ref(v: int) -> int:
        v ^= v >> 16; v = (v * 0x7FEB352D) & 0xFFFFFFFF; v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF; return v ^ (v >> 16)
    xs = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789]
    assert mix32(torch.tensor(xs, dtype=torch.int64)).tolist() == [ref(v) for v in xs]
    assert [mix32(v) for v in xs] == [ref(v) for v in xs]
    u = torch.exp(-torch.exp(-gumbel_noise(torch.tensor([row_key(7, 0)]),
                                           mix32(torch.arange(10000, dtype=torch.int64)))))
    assert 0.0 < u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.02


def test_row_keys_vectorised_equal_row_key() -> None:
    import random

    from nbgen.runtime.sampling_ops import row_keys

    rnd = random.Random(0)
    seeds = [rnd.randint(-2 ** 70, 2 ** 70) for _ in range(300)] + [0, 1, -1, 2 ** 63 - 1]
    steps = [rnd.randint(0, 2 ** 40) for _ in seeds]
    assert row_keys(seeds, steps).tolist() == [row_key(a, b) for a, b in zip(seeds, steps)]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_top_k_1_is_greedy(device: torch.device) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50, device=device)
    s = Sampler(50, device)
    greedy = s(logits, [seq({"temperature": 0.0}, seed=i) for i in range(6)])
    assert torch.equal(greedy.token_ids, logits.argmax(-1))
    assert greedy.token_ids.dtype == torch.long and greedy.token_ids.device.type == device.type
    topk1 = s(logits, [seq({"temperature": 1.0, "top_k": 1}, seed=i) for i in range(6)])
    assert torch.equal(topk1.token_ids, logits.argmax(-1))
    assert greedy.logprobs == [None] * 6


def test_bf16_logits_greedy_and_processed_rows() -> None:
    """bf16 logits (the model dtype on GPU/CPU): plain greedy rows take their argmax directly;
    rows with processing or logprobs see the fp32 widening, with the same choices."""
    torch.manual_seed(1)
    logits = torch.randn(4, 40).to(torch.bfloat16)
    s = Sampler(40, CPU)
    ref = logits.float().argmax(-1)
    plain = s(logits, [seq({"temperature": 0.0}, seed=i) for i in range(4)])
    assert torch.equal(plain.token_ids, ref) and plain.logprobs == [None] * 4
    banned = int(ref[0])
    biased = s(logits, [seq({"temperature": 0.0, "logit_bias": {str(banned): -100.0}}, seed=0)]
               + [seq({"temperature": 0.0}, seed=i) for i in range(1, 4)])
    assert int(biased.token_ids[0]) != banned and torch.equal(biased.token_ids[1:], ref[1:])
    with_lp = s(logits, [seq({"temperature": 0.0}, seed=i, lp=LogprobRequest(return_logprob=True))
                         for i in range(4)])
    assert torch.equal(with_lp.token_ids, ref)
    assert with_lp.logprobs[0] is not None
    exp = logits.float().log_softmax(-1)[0, banned].item()
    assert abs(with_lp.logprobs[0].logprob - exp) < 1e-5


def test_padded_vocab_columns_never_sampled() -> None:
    logits = torch.zeros(64, 13)
    logits[:, 10:] = 100.0                       # lm_head padding beyond vocab_size=10
    out = Sampler(10, CPU)(logits, [seq({"temperature": 1.0}, seed=i) for i in range(64)])
    assert out.token_ids.max().item() < 10


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(1)
    V = 200
    row = torch.randn(V)
    s = Sampler(V, CPU)
    mine = dict(params={"temperature": 0.9, "top_p": 0.95}, output=[3, 4])
    # batch 1: alone; batch 2: among others (greedy, other filters, other seeds), other order
    alone = s(row.view(1, V), [seq(seed=42, **mine)]).token_ids[0].item()
    others = torch.randn(4, V)
    logits = torch.cat([others[:2], row.view(1, V), others[2:]])
    batch = [seq({"temperature": 0.0}, seed=1), seq({"top_k": 5, "min_p": 0.1}, seed=2),
             seq(seed=42, **mine), seq({"temperature": 1.3}, seed=3, output=[1]), seq(seed=4)]
    assert s(logits, batch).token_ids[2].item() == alone
    # and over many steps / seeds the draws agree between solo and batched calls
    for seed in range(30):
        for step in range(3):
            kw = dict(params={"temperature": 1.0}, seed=seed, output=list(range(step)))
            solo = s(row.view(1, V), [seq(**kw)]).token_ids.item()
            mixed = s(torch.stack([others[0], row]), [seq(seed=999), seq(**kw)]).token_ids[1].item()
            assert solo == mixed


def test_different_seeds_and_steps_draw_differently() -> None:
    V = 1000
    s = Sampler(V, CPU)
    flat = torch.zeros(256, V)
    by_seed = s(flat, [seq(seed=i) for i in range(256)]).token_ids
    assert len(set(by_seed.tolist())) > 200          # ~224 expected for 256 uniform draws
    by_step = s(flat, [seq(seed=5, output=[1] * i) for i in range(256)]).token_ids
    assert len(set(by_step.tolist())) > 200
    # and the same seed/step repeated gives exactly the same token
    again = s(flat, [seq(seed=i) for i in range(256)]).token_ids
    assert torch.equal(by_seed, again)


P = torch.tensor([0.1, 0.2, 0.3, 0.4])
N = 8000


def draw(params: dict, n: int = N, logits: torch.Tensor | None = None) -> torch.Tensor:
    """Empirical distribution over 4 tokens from n seeds sampled as one batch."""
    base = P.log() if logits is None else logits
    out = Sampler(4, CPU)(base.expand(n, 4).contiguous(), [seq(params, seed=i) for i in range(n)])
    return torch.bincount(out.token_ids, minlength=4).double() / n


def chi2_ok(freq: torch.Tensor, expected: torch.Tensor, n: int = N) -> bool:
    mask = expected > 0
    assert (freq[~mask] == 0).all(), f"impossible tokens were drawn: {freq}"
    stat = (n * (freq[mask] - expected[mask].double()) ** 2 / expected[mask].double()).sum()
    return stat.item() < 20.0                     # df <= 3: p < 0.0002 for a correct sampler


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_reshapes_distribution(temperature: float) -> None:
    expected = P ** (1.0 / temperature)
    expected = expected / expected.sum()
    freq = draw({"temperature": temperature})
    assert chi2_ok(freq, expected), (freq, expected)
    if temperature != 1.0:                        # and it is clearly not the untempered one
        assert not chi2_ok(freq, P)


@pytest.mark.parametrize("params", [{"top_p": 0.6}, {"top_k": 2}, {"min_p": 0.6},
                                    {"top_k": 3, "top_p": 0.75}])
def test_filters_remove_the_tail(params: dict) -> None:
    # top_p 0.6: mass before 0.2 is 0.7 >= 0.6 -> dropped; min_p 0.6: 0.6*0.4 = 0.24 > 0.2;
    # top_k 3 then top_p 0.75 on the renormalised {.4,.3,.2}/.9: mass before .2 is .78 -> dropped
    freq = draw(params)
    assert chi2_ok(freq, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])), freq


def test_mixed_batch_applies_each_rows_own_filters() -> None:
    n = 4000
    seqs = [seq({"top_p": 0.6} if i % 2 else {"temperature": 1.0}, seed=i) for i in range(2 * n)]
    out = Sampler(4, CPU)(P.log().expand(2 * n, 4).contiguous(), seqs).token_ids
    plain = torch.bincount(out[0::2], minlength=4).double() / n
    topp = torch.bincount(out[1::2], minlength=4).double() / n
    assert chi2_ok(plain, P, n) and chi2_ok(topp, torch.tensor([0, 0, 3 / 7, 4 / 7]), n)


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -4.0, 0.5, 1.0]])
    s = Sampler(6, CPU)
    x = s.process(logits, [seq({"repetition_penalty": 2.0}, prompt=[0, 1], output=[3, 3])])
    assert torch.allclose(x, torch.tensor([[1.0, -2.0, 3.0, -8.0, 0.5, 1.0]]))
    assert logits[0, 0].item() == 2.0                 # the caller's logits are not modified


def test_frequency_and_presence_penalties_openai_semantics() -> None:
    logits = torch.zeros(2, 6)
    s = Sampler(6, CPU)
    x = s.process(logits, [seq({"frequency_penalty": 0.5, "presence_penalty": 0.25},
                               prompt=[1, 1, 2], output=[3, 3, 5]),
                           seq({"temperature": 0.0}, output=[3])])
    assert torch.allclose(x[0], torch.tensor([0.0, 0.0, 0.0, -1.25, 0.0, -0.75]))
    assert torch.equal(x[1], torch.zeros(6))          # the other row is untouched


def test_logit_bias_added_and_changes_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    s = Sampler(4, CPU)
    sw = seq({"temperature": 0.0, "logit_bias": {"3": 10.0, 2: -1.5}})
    assert torch.allclose(s.process(logits, [sw]), torch.tensor([[1.0, 2.0, 1.5, 10.0]]))
    assert s(logits, [sw]).token_ids.item() == 3


def test_min_new_tokens_masks_stop_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]]).expand(40, 5).contiguous()
    s = Sampler(5, CPU)
    stops = frozenset({2, 3})
    early = [seq({"min_new_tokens": 3, "temperature": 0.0 if i % 2 else 1.0}, seed=i,
                 output=[1] * (i % 3), stop_ids=stops) for i in range(40)]
    tok = s(logits, early).token_ids
    assert not torch.isin(tok, torch.tensor([2, 3])).any()
    assert (tok[1::2] == 4).all()                     # greedy falls back to the best non-stop id
    late = [seq({"min_new_tokens": 3, "temperature": 0.0}, output=[1, 1, 1], stop_ids=stops)]
    assert s(logits[:1], late).token_ids.item() == 2


def _processed(logits: torch.Tensor, bias: dict[int, float], rep: float, seen: list[int]) -> torch.Tensor:
    """The reference processing of one row: logit_bias, then the repetition penalty (HF's rule)."""
    x = logits.clone()
    for t, b in bias.items():
        x[t] += b
    for t in set(seen):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    return x


@pytest.mark.parametrize("original", [False, True])
def test_logprobs_follow_sglang_processed_and_temperature_scaled(original: bool) -> None:
    """Output logprobs are SGLang's: log_softmax of the processed logits (bias, penalties) divided by
    the temperature (not for greedy rows); ``original_logprobs`` leaves the temperature out."""
    torch.manual_seed(3)
    logits = torch.randn(4, 30)
    want = LogprobRequest(return_logprob=True, top_logprobs_num=4, token_ids_logprob=[7, 2])
    seqs = [seq({"temperature": 0.7, "logit_bias": {5: 5.0}, "repetition_penalty": 1.5, "top_k": 3},
                seed=1, lp=want, prompt=[4, 9]),
            seq({"temperature": 0.0}, seed=2),
            seq({"temperature": 0.0, "logit_bias": {1: -2.0}}, seed=3, lp=LogprobRequest(return_logprob=True)),
            seq({"temperature": 2.5, "top_p": 0.5}, seed=4, lp=LogprobRequest(return_logprob=True))]
    out = Sampler(30, CPU, original_logprobs=original)(logits, seqs)
    t0, t3 = (1.0, 1.0) if original else (0.7, 2.5)
    ref0 = torch.log_softmax(_processed(logits[0], {5: 5.0}, 1.5, [4, 9]) / t0, -1)   # before top-k
    ref2 = torch.log_softmax(_processed(logits[2], {1: -2.0}, 1.0, []), -1)          # greedy: no division
    ref3 = torch.log_softmax(logits[3] / t3, -1)                                      # before top-p
    a, b, c, d = out.logprobs
    assert b is None
    tok0 = out.token_ids[0].item()
    assert a.token_id == tok0 and math.isclose(a.logprob, ref0[tok0].item(), abs_tol=1e-5)
    top_v, top_i = ref0.topk(4)
    assert [t for _, t in a.top] == top_i.tolist()
    assert all(math.isclose(v, w, abs_tol=1e-5) for (v, _), w in zip(a.top, top_v.tolist()))
    assert [v for v, _ in a.top] == sorted([v for v, _ in a.top], reverse=True)
    assert [t for _, t in a.ids] == [7, 2]
    assert all(math.isclose(v, ref0[t].item(), abs_tol=1e-5) for v, t in a.ids)
    assert c.token_id == ref2.argmax().item() and c.top == [] and c.ids == []
    assert math.isclose(c.logprob, ref2.max().item(), abs_tol=1e-5)
    assert math.isclose(d.logprob, ref3[d.token_id].item(), abs_tol=1e-5)


def test_masked_tokens_have_minus_inf_logprobs() -> None:
    """A banned token (logit_bias -inf, min_new_tokens' stop ids) reports -inf, as SGLang's."""
    logits = torch.randn(1, 12)
    want = LogprobRequest(return_logprob=True, top_logprobs_num=12, token_ids_logprob=[3])
    out = Sampler(12, CPU)(logits, [seq({"temperature": 1.0, "logit_bias": {3: float("-inf")}}, lp=want)])
    lp = out.logprobs[0]
    assert lp.ids == [(float("-inf"), 3)] and lp.top[-1] == (float("-inf"), 3)
    assert math.isclose(sum(math.exp(v) for v, _ in lp.top), 1.0, abs_tol=1e-5)


def test_prompt_logprobs_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(4)
    logits = torch.randn(7, 12)
    targets = [3, 1, 4, 1, 5, 9, 2]
    full = lp_mod.prompt_logprobs(logits, targets, 2, [0])
    monkeypatch.setattr(lp_mod, "PROMPT_BLOCK_ROWS", 3)
    blocked = lp_mod.prompt_logprobs(logits, torch.tensor(targets), 2, [0])
    ref = torch.log_softmax(logits, -1)
    assert len(full) == len(blocked) == 7
    for j, (f, b) in enumerate(zip(full, blocked)):
        assert f.token_id == b.token_id == targets[j]
        assert math.isclose(f.logprob, ref[j, targets[j]].item(), abs_tol=1e-5)
        assert f.top == b.top and [t for _, t in f.top] == ref[j].topk(2).indices.tolist()
        assert f.ids == b.ids and f.ids[0][1] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_draw_the_same_tokens() -> None:
    torch.manual_seed(5)
    logits = torch.randn(64, 500)
    seqs = [seq({"temperature": 0.8, "top_p": 0.9}, seed=i, output=[1] * (i % 4)) for i in range(64)]
    cpu = Sampler(500, CPU)(logits, seqs).token_ids
    gpu = Sampler(500, torch.device("cuda"))(logits.cuda(), seqs).token_ids.cpu()
    assert (cpu == gpu).float().mean().item() >= 0.98   # float log/softmax may differ by an ulp


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_argmax_is_torch_argmax(dtype) -> None:
    """The split-row Triton argmax (greedy decoding on CUDA): torch's index on every row, the first
    one on ties (within a chunk, across chunks, at the last column), rows of -inf, widths that are
    and are not a multiple of its chunk, into ``out`` and with the counters re-armed for reuse."""
    from nbgen.kernels import gpu_argmax

    ws = gpu_argmax.ArgmaxWorkspace()
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, V in [(1, 151936), (7, 151936), (256, 151936), (33, 4096), (5, 4097), (3, 10)]:
        x = torch.randn(B, V, device="cuda", generator=g).to(dtype)
        x[0, V // 2] = 40.0
        x[0, V - 1] = 40.0                                     # tie across chunks: first index
        if B > 2:
            x[1, V - 1] = 50.0                                 # the last column
            x[2] = float("-inf")                               # all -inf: index 0
        assert gpu_argmax.usable(x)
        out = torch.full((B,), -1, dtype=torch.long, device="cuda")
        got = gpu_argmax.argmax(x, ws, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got, x.argmax(dim=-1)), (B, V)
        assert torch.equal(gpu_argmax.argmax(x, ws), got) and int(ws.count.sum()) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_gumbel_draw_equals_the_torch_formula() -> None:
    """The sampled draw's Triton kernel (noise hashed in uint32 inside the argmax) picks the token of
    the int64 tensor formula on every row: 256 rows x Qwen3's vocabulary, masked tails, one allowed token."""
    from nbgen.kernels import gpu_argmax
    from nbgen.runtime.sampling_ops import gumbel_noise

    V = 151936
    x = torch.randn(256, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) * 2
    x[3, 1000:] = float("-inf")
    x[4] = float("-inf")
    x[4, 77] = 0.0
    keys = torch.tensor([row_key(i * 7919, i) for i in range(256)], dtype=torch.int64, device="cuda")
    vh = mix32(torch.arange(V, dtype=torch.int64, device="cuda") ^ 0x27D4EB2F)
    ref = torch.cat([(x[i:i + 32] + gumbel_noise(keys[i:i + 32], vh)).argmax(-1) for i in range(0, 256, 32)])
    got = gpu_argmax.noisy_argmax(x, keys, vh, gpu_argmax.ArgmaxWorkspace())
    assert torch.equal(got, ref) and int(got[4]) == 77 and int(got[3]) < 1000


def test_triton_gumbel_draw_on_the_interpreter_equals_the_torch_formula() -> None:
    """The same kernel under Triton's CPU interpreter (tl.log for libdevice's), in a fresh process."""
    pytest.importorskip("triton")
    code = """
import torch
from nbgen.kernels import gpu_argmax
from nbgen.runtime.sampling_ops import gumbel_noise, mix32, row_key
x = torch.randn(6, 9000, generator=torch.Generator().manual_seed(0)) * 3
x[1, :] = float("-inf"); x[1, 17] = 0.0
x[2, 100:] = float("-inf")
keys = torch.tensor([row_key(s, 7) for s in range(6)], dtype=torch.int64)
vh = mix32(torch.arange(9000, dtype=torch.int64) ^ 0x27D4EB2F)
ref = (x + gumbel_noise(keys, vh)).argmax(-1)
got = gpu_argmax.noisy_argmax(x, keys, vh, gpu_argmax.ArgmaxWorkspace())
assert torch.equal(got, ref), (got, ref)
assert int(got[1]) == 17 and int(got[2]) < 100
print("ok")
"""
    r = run_under_triton_interpreter(code, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


_TEMPERED_CHECK = """
import torch
from nbgen.runtime.sampling_ops import gumbel_noise, mix32, row_key, tempered_draw
dev = "{dev}"
V = {V}
x = (torch.randn(8, V, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16).to(dev)
x[1, :] = float("-inf"); x[1, 17] = 0.0
temps = torch.tensor([0.6, 0.6, 0.0, 1.0, 1e30, 0.05, 0.0, 2.5], dtype=torch.float32, device=dev)
keys = torch.tensor([row_key(s, 3) for s in range(8)], dtype=torch.int64, device=dev)
vh = mix32(torch.arange(V, dtype=torch.int64, device=dev) ^ 0x27D4EB2F)
xf = x.float()
ref = [int((xf[i:i + 1] / temps[i] + gumbel_noise(keys[i:i + 1], vh)).argmax(-1)) if temps[i] > 0
       else int(xf[i].argmax()) for i in range(8)]
got = tempered_draw(x, temps, keys, vh).tolist()
assert got == ref, (got, ref)
assert got[1] == 17 and got[2] == int(xf[2].argmax()) and got[6] == int(xf[6].argmax())
print("ok")
"""


def test_tempered_draw_equals_widen_divide_then_draw() -> None:
    """The temperature-only fast path's draw (torch fallback on the CPU) equals the sampler's long path:
    float32 widening, IEEE division by the row's temperature, the Gumbel noise; temperature 0 rows are
    the plain argmax; a row with one allowed token draws it at any temperature."""
    exec(_TEMPERED_CHECK.format(dev="cpu", V=5000), {})


def test_tempered_draw_kernel_on_the_interpreter() -> None:
    """The same check through the Triton kernel under its CPU interpreter, in a fresh process."""
    pytest.importorskip("triton")
    r = run_under_triton_interpreter(_TEMPERED_CHECK.format(dev="cpu", V=9000).replace(
        "from nbgen.runtime.sampling_ops import", "from nbgen.kernels import gpu_argmax\n"
        "from nbgen.runtime.sampling_ops import _argmax_ws,").replace(
        "got = tempered_draw(x, temps, keys, vh)", "got = gpu_argmax.tempered_argmax(x, temps, keys, vh, _argmax_ws(x.device))"),
        timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tempered_draw_kernel_on_cuda() -> None:
    """The kernel on the GPU, bf16 logits of Qwen3's vocabulary width."""
    exec(_TEMPERED_CHECK.format(dev="cuda", V=151936), {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_temperature_fast_path_draws_the_long_paths_tokens() -> None:
    """A batch of temperature-only rows (and plain greedy rows) takes the one-kernel path; the same rows
    asking for logprobs (which forces the long path: float32 copy, division, then the draw) draw the same
    tokens."""
    V = 151936
    logits = (torch.randn(64, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)) * 4
              ).to(torch.bfloat16)
    fast, slow = [], []
    for i in range(64):
        t = 0.0 if i % 5 == 0 else 0.3 + 0.1 * (i % 7)
        fast.append(seq({"temperature": t}, seed=i, output=[1] * (i % 4)))
        slow.append(seq({"temperature": t}, seed=i, output=[1] * (i % 4), lp=LogprobRequest(return_logprob=True)))
    sampler = Sampler(V, torch.device("cuda"))
    a = sampler(logits, fast).token_ids
    b = sampler(logits, slow).token_ids
    assert torch.equal(a, b)
    assert {s.req.raw_kind for s in fast} == {"argmax", "draw"} and {s.req.raw_kind for s in slow} == {""}


def test_argmax_workspace_grows_for_more_rows_and_wider_vocabularies() -> None:
    """The partials hold rows x chunk slots: a later call with a wider vocabulary (more chunks per row)
    at a row count seen before must grow them too, and the slots per row never shrink."""
    from nbgen.kernels import gpu_argmax

    ws = gpu_argmax.ArgmaxWorkspace()
    pmax, pidx, count = ws.get(64, 1, CPU)
    assert ws.sp == 1 and pmax.numel() >= 64 and count.numel() >= 64 and int(count.sum()) == 0
    pmax, pidx, _ = ws.get(64, 16, CPU)
    assert ws.sp == 16 and pmax.numel() >= 64 * 16 and pidx.numel() == pmax.numel()
    pmax, _, count = ws.get(200, 2, CPU)
    assert ws.sp == 16 and ws.rows >= 200 and pmax.numel() >= 200 * 16 and count.numel() >= 200


def test_raw_kinds_decide_as_the_rows_kinds() -> None:
    """The batch's kinds (``raw_kinds``, read from the requests' cached kinds) pass the sampler's fast-path
    tests exactly when every row's own ``raw_kind`` does, first steps, min_new_tokens and logprobs included."""
    import random

    from nbgen.runtime.sampler_rows import raw_kind, raw_kinds

    rng = random.Random(0)
    makes = [lambda k: seq({"temperature": 0.0}, seed=k),
             lambda k: seq({"temperature": 0.7}, seed=k),
             lambda k: seq({"temperature": 0.7, "top_p": 0.9}, seed=k),
             lambda k: seq({"temperature": 0.0}, seed=k, lp=LogprobRequest(return_logprob=True)),
             lambda k: seq({"temperature": 0.0, "min_new_tokens": 3}, seed=k, stop_ids=frozenset({2}),
                           output=[5] * rng.randint(0, 5))]
    for trial in range(300):
        rows = [rng.choice(makes[: rng.randint(1, len(makes))])(k) for k in range(rng.randint(1, 6))]
        for _ in range(2):          # the first call fills req.raw_kind, the second reads it
            got = raw_kinds(rows)
            own = {raw_kind(s) for s in rows}
            for fast in ({"argmax"}, {"argmax", "draw"}):
                assert (got <= fast) == (own <= fast), (trial, own, got)
