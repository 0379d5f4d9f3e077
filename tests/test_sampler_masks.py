"""A masked token is never sampled: the Gumbel noise is finite for every hash, and sampled draws
match torch.multinomial over the masked distribution (chi-square), on CPU and on CUDA (bf16)."""
from __future__ import annotations

import pytest
import torch

from nbgen.core.batch import SeqWork
from nbgen.core.request import Request
from nbgen.runtime.sampler import Sampler
from nbgen.runtime.sampling_ops import gumbel_from_hash, mix32, noisy_argmax
from nbgen.core.sampling import SamplingParams

CPU = torch.device("cpu")
_M32 = 0xFFFFFFFF


def _seq(params: dict, seed: int, output: list[int] | None = None,
         stop_ids: frozenset[int] = frozenset()) -> SeqWork:
    req = Request(rid=f"r{seed}", prompt_ids=[0], params=SamplingParams.from_dict(params),
                  stop_ids=stop_ids, seed=seed)
    req.output_ids = list(output or [])
    return SeqWork(req=req, token_ids=[req.all_ids[-1]], start_pos=req.num_tokens - 1, pages=[], sample=True)


def _unmix32(h: int) -> int:
    """Inverse of mix32 (each of its steps is a bijection on 32-bit words)."""
    h ^= h >> 16
    h = (h * pow(0x846CA68B, -1, 1 << 32)) & _M32
    h ^= (h >> 15) ^ (h >> 30)
    h = (h * pow(0x7FEB352D, -1, 1 << 32)) & _M32
    return h ^ (h >> 16)


def test_noise_is_finite_for_every_hash() -> None:
    """The noise depends on the top 23 bits of the hash only: all 2**23 values, with the low bits
    all 0 and all 1, give finite noise; so do the 2**20 largest and smallest hashes themselves."""
    k = torch.arange(1 << 23, dtype=torch.int64)
    for low in (0, (1 << 9) - 1):
        g = gumbel_from_hash((k << 9) | low)
        assert torch.isfinite(g).all()
        assert g.min().item() > -2.82 and g.max().item() < 16.64
    edge = torch.cat([torch.arange(1 << 20), torch.arange((1 << 32) - (1 << 20), 1 << 32)]).to(torch.int64)
    assert torch.isfinite(gumbel_from_hash(edge)).all()


def test_unmix32_inverts_mix32() -> None:
    for v in (0, 1, 0xFFFFFFFF, 0x12345678, 0x80000000):
        assert _unmix32(mix32(v)) == v and mix32(_unmix32(v)) == v


@pytest.mark.parametrize("device", [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else []))
def test_masked_token_with_the_largest_noise_is_not_sampled(device: torch.device) -> None:
    """Row keys are chosen so the masked token's hash is 2**32 - 1, the hash whose noise used to
    round to +inf and beat the -inf mask: every kind of mask must hold against it."""
    V = 64
    s = Sampler(V, device)
    target = 7
    want = _unmix32(_M32) ^ int(s.vocab_hash[target].item())
    keys = torch.tensor([want], dtype=torch.int64, device=device)
    h = mix32(keys.view(-1, 1) ^ s.vocab_hash.view(1, -1))
    assert int(h[0, target]) == _M32                 # the worst hash lands on the masked token
    noise = gumbel_from_hash(h)
    assert torch.isfinite(noise).all()
    x = torch.zeros(1, V, device=device)
    x[0, target] = float("-inf")
    assert int(noisy_argmax(x, keys, s.vocab_hash)) != target


def _masked_draws(device: torch.device, dtype: torch.dtype, rows: int) -> None:
    """rows requests, each with a mask of every kind; no masked token may ever be drawn."""
    V = 300
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(rows, V, generator=g) * 3).to(dtype).to(device)
    seqs = []
    for i in range(rows):
        kind = i % 5
        if kind == 0:
            p = {"temperature": 1.5, "top_k": 20}
        elif kind == 1:
            p = {"temperature": 1.5, "top_p": 0.5}
        elif kind == 2:
            p = {"temperature": 1.5, "min_p": 0.2}
        elif kind == 3:
            p = {"temperature": 1.5, "logit_bias": {str(t): float("-inf") for t in range(0, V, 2)}}
        else:
            p = {"temperature": 1.5, "min_new_tokens": 5, "max_new_tokens": 10}
        seqs.append(_seq(p, seed=i, stop_ids=frozenset(range(1, V, 3)) if kind == 4 else frozenset()))
    s = Sampler(V, device)
    x = logits.float()
    for step in range(6):
        for q in seqs:
            q.req.output_ids = [0] * step
        toks = s(logits, seqs).token_ids.cpu().tolist()
        for i, t in enumerate(toks):
            row, kind = x[i].cpu(), i % 5
            if kind == 0:
                assert t in row.topk(20).indices.tolist()
            elif kind == 1:
                pr = torch.softmax(row / 1.5, -1)
                sp, order = pr.sort(descending=True)
                keep = order[: int(((sp.cumsum(0) - sp) < 0.5).sum())].tolist()
                assert t in keep
            elif kind == 2:
                assert row[t] / 1.5 >= row.max() / 1.5 + torch.log(torch.tensor(0.2)) - 1e-4
            elif kind == 3:
                assert t % 2 == 1
            elif step < 5:
                assert t % 3 != 1, (step, t)


def test_every_mask_holds_over_a_batch_on_cpu() -> None:
    _masked_draws(CPU, torch.float32, 200)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_mask_holds_bf16_batch_256_on_cuda() -> None:
    _masked_draws(torch.device("cuda"), torch.bfloat16, 256)


def _chi2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square statistic of two count vectors of equal totals (cells where both are 0 skipped)."""
    a, b = a.double(), b.double()
    m = (a + b) > 0
    return float((((a - b) ** 2)[m] / (a + b)[m]).sum())


@pytest.mark.parametrize("params", [{"temperature": 0.7, "top_k": 6}, {"temperature": 1.0, "top_p": 0.8},
                                    {"temperature": 1.3, "min_p": 0.05},
                                    {"temperature": 1.0, "logit_bias": {"3": float("-inf"), "5": 2.0}}])
def test_draws_match_torch_multinomial(params: dict) -> None:
    """The seeded Gumbel draws of masked distributions against torch.multinomial over the same
    probabilities (two-sample chi-square, df <= 11: 40 is p < 1e-4); masked tokens get 0 draws."""
    V, n = 12, 12000
    base = torch.linspace(-1.5, 1.5, V)
    s = Sampler(V, CPU)
    ours = s(base.expand(n, V).contiguous(), [_seq(params, seed=i) for i in range(n)]).token_ids
    # the masked distribution, computed independently of the sampler
    x = base.clone()
    for t, b in (params.get("logit_bias") or {}).items():
        x[int(t)] += b
    x = x / params["temperature"]
    p = torch.softmax(x, -1)
    if "top_k" in params:
        p[p.argsort(descending=True)[params["top_k"]:]] = 0
    if "top_p" in params:
        sp, order = p.sort(descending=True)
        p[order[((sp.cumsum(0) - sp) >= params["top_p"]).nonzero().flatten()]] = 0
    if "min_p" in params:
        p[p < params["min_p"] * p.max()] = 0
    p = p / p.sum()
    ref = torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(0))
    c_ours, c_ref = torch.bincount(ours, minlength=V), torch.bincount(ref, minlength=V)
    assert (c_ours[p == 0] == 0).all(), c_ours
    assert _chi2(c_ours, c_ref) < 40.0, (c_ours.tolist(), c_ref.tolist())


def test_a_row_with_every_token_masked_gets_an_error_not_a_token() -> None:
    """-inf biases and banned stop ids that leave nothing: that row's request is aborted (an error),
    the other rows sample as usual."""
    V = 16
    s = Sampler(V, CPU)
    logits = torch.randn(3, V)
    rows = [_seq({"temperature": 1.0, "logit_bias": {str(t): float("-inf") for t in range(1, V)},
                  "min_new_tokens": 1, "max_new_tokens": 4}, seed=0, stop_ids=frozenset({0})),  # bans id 0
            _seq({"temperature": 1.0}, seed=1),
            _seq({"temperature": 0.0, "logit_bias": {str(t): float("-inf") for t in range(V - 1)}}, seed=2)]
    out = s(logits, rows)
    assert set(out.errors) == {0} and "no token is allowed" in out.errors[0]
    assert int(out.token_ids[2]) == V - 1         # the one token row 2 allows


@pytest.mark.parametrize("temperature", [1e30, 3.5e38, 1e300])
def test_huge_temperatures_keep_masked_tokens_out(temperature: float) -> None:
    """A temperature beyond float32's range would turn -inf logits into NaN; it is capped, so the
    draw stays uniform over the allowed tokens only."""
    V, n = 8, 4000
    s = Sampler(V, CPU)
    params = {"temperature": temperature, "logit_bias": {"5": float("-inf"), "6": float("-inf")}}
    toks = s(torch.randn(n, V) * 5, [_seq(params, seed=i) for i in range(n)]).token_ids
    counts = torch.bincount(toks, minlength=V)
    assert counts[5] == 0 and counts[6] == 0
    assert counts[[0, 1, 2, 3, 4, 7]].min() > n / 6 * 0.8           # about uniform over the rest


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """int32 [rows + 2, ceil(vocab / 32)] random bitmask; row 1 allows only id 31 (the sign bit of
    word 0), row 2 allows nothing."""
    g = torch.Generator().manual_seed(seed)
    bm = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows + 2, -(-vocab // 32)), dtype=torch.int32, generator=g)
    bm[1] = 0
    bm[1, 0] = -(1 << 31)
    bm[2] = 0
    return bm


def test_masked_greedy_argmax_reference_on_cpu() -> None:
    """The bitmask argmax (grammar steps whose rows are all greedy) picks the argmax of the logits
    masked to -inf, bf16 and fp32; the sign bit of a word is an allowed id like any other."""
    from nbgen.runtime.sampling_ops import allowed_ids, masked_greedy_argmax

    V = 1000
    bm = _random_bitmask(5, V, 0)
    ok = allowed_ids(bm[:5], V)
    assert bool(ok[1, 31]) and int(ok[1].sum()) == 1 and int(ok[2].sum()) == 0
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, V, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
        ref = x.float().masked_fill(~ok, float("-inf")).argmax(-1)
        out = torch.full((5,), -1, dtype=torch.long)
        got = masked_greedy_argmax(x, bm, out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, ref) and int(got[1]) == 31


def test_masked_argmax_kernel_on_the_interpreter() -> None:
    """The argmax kernel's bitmask variant under Triton's CPU interpreter, in a fresh process: each
    row's argmax among its allowed ids, widths that are and are not a multiple of 32 and of its chunk."""
    pytest.importorskip("triton")
    from tests.tiny_models import run_under_triton_interpreter

    code = """
import torch
from nbgen.kernels import gpu_argmax
from nbgen.runtime.sampling_ops import allowed_ids
from tests.test_sampler_masks import _random_bitmask
for B, V in [(5, 9000), (3, 4097), (4, 200)]:
    x = torch.randn(B, V, generator=torch.Generator().manual_seed(V)) * 3
    bm = _random_bitmask(B, V, V)
    ref = x.masked_fill(~allowed_ids(bm[:B], V), float("-inf")).argmax(-1)
    ref[2] = 0                                  # nothing allowed: index 0
    got = gpu_argmax.masked_argmax(x, bm, gpu_argmax.ArgmaxWorkspace())
    assert torch.equal(got, ref), (B, V, got, ref)
print("ok")
"""
    r = run_under_triton_interpreter(code, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masked_argmax_kernel_on_cuda() -> None:
    """256 bf16 rows x Qwen3's vocabulary under a bitmask of SmolLM2's 49 152 ids (the bench's shape)
    and of the whole width: the kernel equals masking and torch's argmax."""
    from nbgen.kernels import gpu_argmax
    from nbgen.runtime.sampling_ops import allowed_ids

    ws = gpu_argmax.ArgmaxWorkspace()
    x = (torch.randn(256, 151936, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)) * 3)
    x = x.to(torch.bfloat16)
    for width in (49152, 151936):
        bm = _random_bitmask(256, width, width).cuda()
        xv = x[:, :width]
        ok = allowed_ids(bm[:256], width)
        ref = xv.float().masked_fill(~ok, float("-inf")).argmax(-1)
        ref[2] = 0
        assert torch.equal(gpu_argmax.masked_argmax(xv, bm, ws), ref), width
        assert int(ws.count.sum()) == 0


def test_cpu_draw_over_the_tokens_that_can_win_equals_the_dense_formula() -> None:
    """On the CPU the draw adds noise only to tokens within the noise's span of their row's max (the
    others cannot win): the same tokens as x + noise over every token, for peaked rows (the sparse
    path), flat rows (the dense path), masked tails, fully masked rows and one allowed token."""
    from nbgen.runtime.sampling_ops import gumbel_noise, row_key

    g = torch.Generator().manual_seed(3)
    V = 5000
    vh = mix32(torch.arange(V, dtype=torch.int64) ^ 0x27D4EB2F)
    for scale in (0.5, 4.0, 40.0, 400.0):
        x = torch.randn(24, V, generator=g) * scale
        x[2, 300:] = float("-inf")
        x[3] = float("-inf")
        x[4] = float("-inf")
        x[4, 77] = 0.0
        x[5, 10] = x[5, 20] = x[5].max() + 60.0           # two equal logits far above the rest: the noise decides
        keys = torch.tensor([row_key(i * 31 + int(scale), i) for i in range(24)], dtype=torch.int64)
        ref = (x + gumbel_noise(keys, vh)).argmax(-1)
        got = noisy_argmax(x, keys, vh)
        assert torch.equal(got, ref), (scale, got, ref)
        assert int(got[4]) == 77 and int(got[2]) < 300
