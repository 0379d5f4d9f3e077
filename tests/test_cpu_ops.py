"""nbgen's C kernels for the CPU (nbgen/csrc/cpu_ops.c) against plain torch references."""
from __future__ import annotations

import pytest
import torch

from nbgen.kernels import cpu_ops, cpu_q4
from nbgen.models import layers

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler: the kernels are not built")


def _reference(q, kc, vc, table, lens, P, scale):
    """Per sequence: gather its slots, repeat kv heads (HF repeat_kv), softmax attention in fp32."""
    B, Hq, D = q.shape
    G = Hq // kc.shape[0]
    out = []
    for b in range(B):
        n = int(lens[b])
        slots = (table[b][:, None] * P + torch.arange(P)).reshape(-1)[:n]
        k = kc[:, slots].float().repeat_interleave(G, 0)               # [Hq, n, D]
        v = vc[:, slots].float().repeat_interleave(G, 0)
        s = (q[b].float()[:, None, :] @ k.transpose(1, 2)) * scale      # [Hq, 1, n]
        out.append((s.softmax(-1) @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("hq,hkv,d,P", [(9, 3, 64, 16), (4, 4, 32, 1), (14, 2, 64, 8), (8, 1, 128, 16)])
def test_paged_decode_attention_matches_reference(dtype, tol, hq, hkv, d, P):
    g = torch.Generator().manual_seed(hq * 100 + P)
    num_pages = 2 + 400 // P
    kc = torch.randn(hkv, num_pages * P, d, generator=g).to(dtype)
    vc = torch.randn(hkv, num_pages * P, d, generator=g).to(dtype)
    lens = torch.tensor([1, P - 1 if P > 1 else 1, P, P + 1, 77, 300])
    width = int(-(-lens.max() // P)) + 2                                 # padded with page 0
    table = torch.zeros(len(lens), width, dtype=torch.long)
    for b, n in enumerate(lens.tolist()):
        pages = -(-n // P)
        table[b, :pages] = torch.randperm(num_pages - 1, generator=g)[:pages] + 1
    # q rows strided like a view of a fused qkv projection: [B, Hq + 2 Hkv, D] -> first Hq heads
    qkv = torch.randn(len(lens), hq + 2 * hkv, d, generator=g).to(dtype)
    q = qkv[:, :hq]
    scale = d ** -0.5
    out = cpu_ops.paged_decode_attention(q, kc, vc, table, lens, P, scale)
    assert out.dtype == dtype and out.shape == (len(lens), hq, d)
    ref = _reference(q, kc, vc, table, lens, P, scale)
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_writes_new_kv_first(dtype):
    """new_kv: each sequence's new K / V row (a strided view of qkv) lands in its slot before it attends,
    exactly as the separate write + attention; other slots untouched."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, P, B = 9, 3, 64, 16, 4
    kc = torch.randn(hkv, 20 * P, d, generator=g).to(dtype)
    vc = torch.randn(hkv, 20 * P, d, generator=g).to(dtype)
    lens = torch.tensor([1, 17, 40, 16])
    table = torch.zeros(B, 3, dtype=torch.long)
    for b, pages in enumerate([[3], [5, 6], [7, 8, 9], [12]]):
        table[b, :len(pages)] = torch.tensor(pages)
    slots = torch.tensor([int(table[b, (n - 1) // P]) * P + (n - 1) % P for b, n in enumerate(lens.tolist())])
    qkv = torch.randn(B, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[:, slots] = k.view(B, hkv, d).transpose(0, 1)
    vc2[:, slots] = v.view(B, hkv, d).transpose(0, 1)
    ref = cpu_ops.paged_decode_attention(q.view(B, hq, d), kc2, vc2, table, lens, P, d ** -0.5)
    kc3, vc3 = kc.clone(), vc.clone()
    out = cpu_ops.paged_decode_attention(q.view(B, hq, d), kc, vc, table, lens, P, d ** -0.5, new_kv=(k, v, slots))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(out, ref)
    # k and v with different row strides (Qwen3's normed k is its own tensor, v a view of qkv)
    out = cpu_ops.paged_decode_attention(q.view(B, hq, d), kc3, vc3, table, lens, P, d ** -0.5,
                                         new_kv=(k.contiguous(), v, slots))
    assert torch.equal(kc3, kc2) and torch.equal(vc3, vc2) and torch.equal(out, ref)


def test_paged_decode_attention_rows_of_one_sequence_see_each_other():
    """A jump's forced tokens: rows j = 0..R-1 of one sequence at lengths n + j in one call, each reading
    the rows before it. With new_kv every row's K / V is written before any row attends (else a thread
    could attend a slot another thread has not written yet)."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, P, R, n = 8, 4, 64, 16, 48, 10
    kc = torch.randn(hkv, 8 * P, d, generator=g)
    vc = torch.randn(hkv, 8 * P, d, generator=g)
    pages = torch.tensor([2, 5, 1, 7])
    lens = torch.arange(n + 1, n + R + 1)
    table = pages.repeat(R, 1)
    slots = torch.tensor([int(pages[(m - 1) // P]) * P + (m - 1) % P for m in lens.tolist()])
    qkv = torch.randn(R, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[:, slots] = k.view(R, hkv, d).transpose(0, 1)
    vc2[:, slots] = v.view(R, hkv, d).transpose(0, 1)
    ref = cpu_ops.paged_decode_attention(q.reshape(R, hq, d), kc2, vc2, table, lens, P, d ** -0.5)
    for _ in range(5):
        k3, v3 = kc.clone(), vc.clone()
        out = cpu_ops.paged_decode_attention(q.reshape(R, hq, d), k3, v3, table, lens, P, d ** -0.5,
                                             new_kv=(k, v, slots))
        assert torch.equal(out, ref)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_q8_grid_and_gemv_match_the_dequantized_weight(rows):
    """A GGUF Q8_0 weight read back through bf16 is found on its grid (the GGUF's q almost everywhere);
    the GEMV equals x @ (q * d).T in fp32 up to summation order; weights off the grid are refused."""
    g = torch.Generator().manual_seed(rows)
    N, K = 80, 128
    d = torch.rand(N, K // 32, generator=g) * 0.01 + 1e-3
    qt = torch.randint(-127, 128, (N, K), generator=g)
    qt[:, ::32] = 127                                   # Q8_0: each group's largest value is +-127 d
    w = (qt.float().view(N, K // 32, 32) * d[:, :, None]).view(N, K).bfloat16()
    q, dd = cpu_ops.q8_grid(w, 2 ** -7)
    assert (q.long() == qt).float().mean() > 0.95
    assert ((q.float().view(N, -1, 32) * dd[:, :, None]).view(N, K) - w.float()).abs().max() <= 2 ** -7 * w.abs().max()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, K, generator=g).to(dtype)
        ref = x.float() @ (q.float().view(N, -1, 32) * dd[:, :, None]).view(N, K).t()
        y = cpu_ops.q8_gemv(x, q, dd)
        assert y.dtype == dtype and y.shape == (rows, N)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        assert ((y.float() - ref).abs() <= tol * ref.abs() + 1e-5).all()
    assert cpu_ops.q8_grid(torch.randn(N, K, generator=g).bfloat16(), 2 ** -7) is None
    w_off = w.clone()
    w_off[3, 40] = d[3, 1] * 2.4              # between two grid points (a small value: bf16 keeps it exact enough)
    assert cpu_ops.q8_grid(w_off, 2 ** -7) is None


def _q4_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q4_gemv's arithmetic: x quantized to int16 per group of 32 as the kernel does it in fp32 (x * (32767 / max|x|),
    round half to even), then in fp64 the integer dot products with the nibbles, scaled by d * max|x| / 32767,
    plus m times the group's exact sum of x."""
    T, K = x.shape
    xf = x.float().view(T, K // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 32767.0) / amax.clamp_min(1e-30)   # a division, as the kernel's (c / t is c * 1/t)
    xq = torch.where(amax > 0, torch.round(xf * inv), torch.zeros_like(xf)).double()
    xg = xf.double()
    isum = torch.einsum("tgi,ngi->tng", xq, q.double().view(q.shape[0], K // 32, 32))
    return (isum * d.double()[None] * (amax.squeeze(-1) / 32767)[:, None]
            + m.double()[None] * xg.sum(-1)[:, None]).sum(-1)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8])
def test_q4_gemv_matches_its_reference(rows):
    """The 4-bit GEMV (nibbles, fp16 d and m per group of 32) equals its int8-activation arithmetic in fp64,
    up to fp32 summation and the output's rounding, for every row count it takes, fp32 and bf16 x."""
    g = torch.Generator().manual_seed(rows)
    N, K = 70, 192
    qt = torch.randint(0, 16, (N, K), generator=g)
    d = (torch.rand(N, K // 32, generator=g) * 0.01 + 1e-3).half()
    m = (-torch.rand(N, K // 32, generator=g) * 0.08).half()
    q4 = qt.view(N, K // 32, 2, 16).to(torch.uint8)
    nib = (q4[:, :, 0] | (q4[:, :, 1] << 4)).reshape(N, K // 2).contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, K, generator=g).to(dtype)
        x[0, 32:64] = 0                                   # an all-zero group
        ref = _q4_reference(x.float(), qt, d.float(), m.float())
        cpu_q4.check_weight(nib, d, m)
        y = cpu_q4.q4_gemv(x, nib, d, m)
        assert y.dtype == dtype and y.shape == (rows, N)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        assert ((y.double() - ref).abs() <= tol * ref.abs() + 1e-5).all()
        # against the dequantized weight in fp32: int16 activations lose nothing beyond the output's rounding
        w = (qt.float().view(N, -1, 32) * d.float()[:, :, None] + m.float()[:, :, None]).view(N, K)
        exact = x.float() @ w.t()
        assert ((y.float() - exact).abs() <= tol * exact.abs() + 1e-4 * exact.abs().max()).all()
    strided = torch.randn(rows, 2 * K, generator=g)[:, :K]       # rows with a stride (a view of a wider output)
    assert torch.equal(cpu_q4.q4_gemv(strided, nib, d, m), cpu_q4.q4_gemv(strided.contiguous(), nib, d, m))


def test_softmax_is_stable_for_large_scores():
    """Scores of +-1e4 (no overflow to inf/nan): the largest key wins outright."""
    kc = torch.zeros(1, 32, 4)
    vc = torch.arange(32, dtype=torch.float32)[None, :, None].expand(1, 32, 4).contiguous()
    kc[0, 5] = 100.0
    kc[0, 9] = -100.0
    q = torch.full((1, 1, 4), 50.0)
    out = cpu_ops.paged_decode_attention(q, kc, vc, torch.tensor([[0, 1]]), torch.tensor([20]), 16, 1.0)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, torch.full((1, 1, 4), 5.0))


def test_engine_decodes_with_the_kernel_on_cpu(tiny_engine, device):
    """The CPU engine's attention backend uses the kernel when it is built (the parity tests then
    cover it; test_parity_torch_decode_path covers the torch fallback)."""
    if device != "cpu":
        pytest.skip("CPU engine only")
    assert tiny_engine.loop.runner.backend.cpu_kernels is True


def _hf_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then weight * it (in the model dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    # bf16: one rounding step apart at most (the fp32 sums run in another order); fp32: ~1e-6
    rtol, atol = (1e-2, 1e-2) if dtype == torch.bfloat16 else (1e-5, 1e-6)
    return torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_and_add_rmsnorm_match_hf(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 96, generator=g) * 3).to(dtype)
    r = torch.randn(37, 96, generator=g).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    assert _close(cpu_ops.rmsnorm(x, w, 1e-6), _hf_rmsnorm(x, w, 1e-6), dtype)
    s_ref = x + r                                    # HF adds residuals in the model dtype
    y, s = cpu_ops.add_rmsnorm(x.clone(), r.clone(), w, 1e-6)
    assert torch.equal(s, s_ref)
    assert _close(y, _hf_rmsnorm(s_ref, w, 1e-6), dtype)
    # per-head [T, H, D] view with strided rows (Qwen3's q/k norm on the qkv projection)
    qkv = torch.randn(5, 4 * 32 + 8, generator=g).to(dtype)
    heads = qkv[:, :128].view(5, 4, 32)
    wh = (torch.rand(32, generator=g) + 0.5).to(dtype)
    assert _close(cpu_ops.rmsnorm(heads, wh, 1e-6), _hf_rmsnorm(heads, wh, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_inplace_matches_torch_path(dtype):
    from nbgen.models.layers import RotaryEmbedding

    rope = RotaryEmbedding(64, 512, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, (6 + 2 + 2) * 64, generator=g).to(dtype)
    q, k = qkv[:, :384], qkv[:, 384:512]             # strided views, as the model passes them
    pos = torch.tensor([0, 1, 2, 63, 64, 200, 300, 511, 7])
    cos, sin = rope._cos_sin(pos, dtype)
    q_ref, k_ref = rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)
    v_before = qkv[:, 512:].clone()
    cpu_ops.rope_inplace(pos, q, k, 64, rope.cos_sin_cache)
    assert _close(q, q_ref, dtype) and _close(k, k_ref, dtype)
    assert torch.equal(qkv[:, 512:], v_before)     # v untouched
    with pytest.raises(ValueError, match="positions"):
        cpu_ops.rope_inplace(torch.tensor([512]), q[:1], k[:1], 64, rope.cos_sin_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(11, 2 * 200, generator=g) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])        # saturated and zero gates
    gate, up = x.chunk(2, dim=-1)
    assert _close(cpu_ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch_incl_ties_inf_nan(dtype):
    g = torch.Generator().manual_seed(3)
    for vocab in (5, 1024, 1025, 3000):
        x = torch.randn(8, vocab + 7, generator=g).to(dtype)[:, :vocab]   # strided rows, as the sampler slices
        x[1, vocab // 2] = x[1].max()                 # a tie: the first index wins
        x[2] = float("-inf")
        x[3, vocab // 3] = float("nan")               # NaN counts as the largest
        x[4, -1] = 1e4
        assert torch.equal(cpu_ops.argmax(x), x.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [0, 2, 5]])
def test_apply_token_bitmask_matches_xgrammar(dtype, rows):
    xgr = pytest.importorskip("xgrammar")
    torch.manual_seed(0)
    B, V, width = 7, 1000, 990                   # width < V: ids past the tokenizer stay as they are
    x = torch.randn(B, V).to(dtype)
    bm = torch.randint(-2 ** 31, 2 ** 31 - 1, (B + 3, (V + 31) // 32), dtype=torch.int32)
    bm[2] = -1                                    # a row that allows everything
    bm[0, 3] = 0                                  # a word that allows nothing
    ref = x.float().clone()                       # (x.float() is x itself for fp32)
    xgr.apply_token_bitmask_inplace(ref, bm[:B], vocab_size=width, indices=rows, backend="cpu")
    got = x.clone()
    assert cpu_ops.apply_token_bitmask(got, bm, width, rows)
    assert torch.equal(got.float(), ref.to(dtype).float())
    assert got.isinf().any() and not torch.equal(got, x)
    # layouts the kernel does not take are left to xgrammar
    assert not cpu_ops.apply_token_bitmask(x.t(), bm, width, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_ops_split_over_threads_give_the_same_bits(dtype):
    """A batch-32 decode step's rmsnorm / RoPE / SiLU rows (above the kernels' thread-split size) give the
    same bits on one thread and on two, and match the references."""
    g = torch.Generator().manual_seed(3)
    T, H, inter = 32, 576, 1536
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    r = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    gu = (torch.randn(T, 2 * inter, generator=g) * 4).to(dtype)
    qkv = torch.randn(T, (9 + 3 + 3) * 64, generator=g).to(dtype)
    pos = torch.randint(0, 512, (T,), generator=g)
    rope = layers.RotaryEmbedding(64, 512, 10000.0, None)

    def run() -> list[torch.Tensor]:
        y, s = cpu_ops.add_rmsnorm(x.clone(), r.clone(), w, 1e-5)
        q = qkv.clone()
        cpu_ops.rope_inplace(pos, q[:, :576], q[:, 576:768], 64, rope.cos_sin_cache)
        return [cpu_ops.rmsnorm(x, w, 1e-5), y, s, q, cpu_ops.silu_and_mul(gu)]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert _close(one[0], _hf_rmsnorm(x, w, 1e-5), dtype) and _close(one[1], _hf_rmsnorm(x + r, w, 1e-5), dtype)
    cos, sin = rope._cos_sin(pos, dtype)
    assert _close(one[3][:, :576], rope._rotate(qkv[:, :576], cos, sin), dtype)
    gate, up = gu.chunk(2, dim=-1)
    assert _close(one[4], torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (14, 2, 64), (8, 1, 128), (4, 4, 32), (6, 2, 96)])
def test_bf16_decode_attention_within_one_rounding_of_fp32(hq, hkv, d):
    """The bf16 path (csrc/cpu_attn_bf16.c where the CPU has AVX512-BF16): each output within one bf16 rounding of
    the fp32 reference, with scores that grow along the context (the online softmax rescales its sums) and
    lengths on and off its 16-key blocks."""
    g = torch.Generator().manual_seed(hq + d)
    P, num_pages = 16, 40
    ramp = torch.linspace(0.2, 3.0, num_pages * P)[None, :, None]          # later slots score higher
    kc = (torch.randn(hkv, num_pages * P, d, generator=g) * ramp).bfloat16()
    vc = torch.randn(hkv, num_pages * P, d, generator=g).bfloat16()
    lens = torch.tensor([1, 15, 16, 17, 33, 200, 511])
    table = torch.zeros(len(lens), num_pages, dtype=torch.long)
    for b, n in enumerate(lens.tolist()):
        pages = -(-n // P)
        table[b, :pages] = torch.arange(pages) if b % 2 else torch.randperm(num_pages, generator=g)[:pages]
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
    out = cpu_ops.paged_decode_attention(q, kc, vc, table, lens, P, d ** -0.5)
    ref = _reference(q, kc, vc, table, lens, P, d ** -0.5)
    ulp = ref.abs().clamp_min(2.0 ** -20) * 2.0 ** -7                       # one bf16 step at the value
    assert ((out.float() - ref).abs() <= ulp).all(), (out.float() - ref).abs().max()
