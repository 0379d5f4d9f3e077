"""nbgen's Triton decode attention (nbgen.kernels.triton_decode) and the fused RoPE + K/V write
(nbgen.kernels.qk_norm_rope), CUDA only: against fp32 / HF-formula references, under CUDA-graph
replays with changing lengths, and end to end against flashinfer's decode path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.tiny_models import assert_close_runs, gpu_generate, gpu_prompts, write_kv_torch

gpu = pytest.mark.gpu


def _paged(lens: list[int], hkv: int, D: int, P: int, seed: int):
    """Random HND K/V caches with each sequence's pages scattered over the pool (page 0 unused)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    npg = [(n + P - 1) // P for n in lens]
    total = sum(npg)
    shape = (total + 5, hkv, P, D)
    kc = torch.randn(shape, device="cuda", generator=g).bfloat16()
    vc = torch.randn(shape, device="cuda", generator=g).bfloat16()
    perm = (torch.randperm(total, generator=torch.Generator().manual_seed(seed)) + 1).to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(npg), 0)
    last = torch.tensor([n - (m - 1) * P for n, m in zip(lens, npg)], dtype=torch.int32)
    return kc, vc, indptr, perm, last


def _reference(q, kc, vc, indptr, indices, lens) -> torch.Tensor:
    """fp32 softmax(q K^T / sqrt(D)) V per sequence, pages gathered in order, GQA by repetition."""
    B, hq, D = q.shape
    hkv = kc.shape[1]
    out = []
    for b, n in enumerate(lens):
        pg = indices[indptr[b]: indptr[b + 1]].long().cuda()
        k, v = kc[pg].transpose(1, 2), vc[pg].transpose(1, 2)
        k = k.reshape(-1, hkv, D)[:n].float().repeat_interleave(hq // hkv, 1)     # [n, Hq, D]
        v = v.reshape(-1, hkv, D)[:n].float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * D ** -0.5
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


@gpu
@pytest.mark.parametrize("hq,hkv,D,P", [(32, 8, 128, 16), (14, 2, 64, 16), (8, 8, 128, 1), (16, 2, 128, 32)])
@pytest.mark.parametrize("lens", [[1], [300], [17, 4099], [5, 16, 33, 1000], [1, 2, 3, 15, 16, 17, 64, 999, 2048],
                                  [(37 * i) % 1500 + 1 for i in range(50)]])
def test_triton_decode_matches_fp32_attention(hq, hkv, D, P, lens):
    """One rounding of the exact attention: within a bf16 step of the fp32 reference, for single-token,
    page-boundary and long sequences, every group size (1, 4, 7 padded to 8, 8), and
    batch sizes with many splits, a few, and one (written without the merge)."""
    from nbgen.kernels.triton_decode import TritonDecodeWrapper

    kc, vc, indptr, indices, last = _paged(lens, hkv, D, P, seed=len(lens) * D + P)
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * D, device="cuda").bfloat16()
    q = qkv[:, : hq * D].view(len(lens), hq, D)                  # strided rows, as the model passes q
    w = TritonDecodeWrapper(hq, hkv, D, P, torch.device("cuda"))
    for _ in range(2):                                            # the second launch reuses re-armed counters
        w.plan(indptr.pin_memory(), indices.pin_memory(), last.pin_memory())
        o = w.run(q, (kc, vc))
        ref = _reference(q, kc, vc, indptr, indices, lens)
        err = (o.float() - ref).abs()
        assert bool((err <= 2 ** -8 * ref.abs() + 6e-3).all()), err.max().item()   # P rounded to bf16
    assert int(w.count.sum()) == 0


def test_longest_first_orders_rows_by_kv_length():
    """The decode kernel's row order: KV length descending, ties in batch order."""
    from nbgen.kernels import triton_decode as td

    P, lens = 16, [5, 40, 16, 40, 1, 33]
    npg = [(n + P - 1) // P for n in lens]
    indptr = np.concatenate([[0], np.cumsum(npg)]).astype(np.int32)
    last = np.array([n - (m - 1) * P for n, m in zip(lens, npg)], dtype=np.int32)
    order = td.longest_first(indptr, last, P)
    assert order.dtype == np.int32 and order.tolist() == [1, 3, 5, 2, 0, 4]


@gpu
@pytest.mark.parametrize("lens", [[(37 * i) % 1500 + 1 for i in range(50)], [100 + 29 * i for i in range(100)]])
def test_triton_decode_row_order_changes_no_bit(lens):
    """Programs dispatched longest row first compute exactly what batch-order dispatch computes."""
    from nbgen.kernels import triton_decode as td

    hq, hkv, D, P = 16, 8, 128, 16
    kc, vc, indptr, indices, last = _paged(lens, hkv, D, P, seed=3)
    q = torch.randn(len(lens), hq, D, device="cuda").bfloat16()
    w = td.TritonDecodeWrapper(hq, hkv, D, P, torch.device("cuda"))
    outs = []
    for batch_order in (False, True):
        w.plan(indptr.pin_memory(), indices.pin_memory(), last.pin_memory())
        if batch_order:       # overwrite the planned longest-first order with the batch order
            w.order[: len(lens)].copy_(torch.arange(len(lens), dtype=torch.int32))
        outs.append(w.run(q, (kc, vc)).clone())
        order = w.order[: len(lens)].cpu()
        assert torch.equal(order, torch.arange(len(lens), dtype=torch.int32)) == batch_order
    assert torch.equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("bs", [3, 24, 64])
def test_triton_decode_graph_replays_follow_the_plan(bs):
    """Captured once (as the engine's decode graphs), replayed with new lengths and pages each step:
    every replay equals an eager launch over the same tables (split counters re-armed in the graph)."""
    from nbgen.kernels.triton_decode import TritonDecodeWrapper

    hq, hkv, D, P = 32, 8, 128, 16
    kc, vc, _ip, _ix, _l = _paged([4000] * bs, hkv, D, P, seed=1)
    buf_ip = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    buf_ix = torch.zeros(kc.shape[0], dtype=torch.int32, device="cuda")
    buf_l = torch.zeros(bs, dtype=torch.int32, device="cuda")
    w = TritonDecodeWrapper(hq, hkv, D, P, torch.device("cuda"), buf_ip, buf_ix, buf_l)
    eager = TritonDecodeWrapper(hq, hkv, D, P, torch.device("cuda"))
    q = torch.randn(bs, hq, D, device="cuda").bfloat16()
    w.plan(torch.arange(bs + 1, dtype=torch.int32), torch.ones(bs, dtype=torch.int32).cuda(),
           torch.ones(bs, dtype=torch.int32))
    w.run(q, (kc, vc))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = w.run(q, (kc, vc))
    for step, base in enumerate([[1, 2, 3], [700, 16, 1], [3999, 2500, 64], [33, 33, 33]]):
        lens = [base[i % 3] + i for i in range(bs)]
        npg = [(n + P - 1) // P for n in lens]
        ip = torch.zeros(bs + 1, dtype=torch.int32)
        ip[1:] = torch.cumsum(torch.tensor(npg), 0)
        ix = (torch.randperm(kc.shape[0] - 1, generator=torch.Generator().manual_seed(step))[: int(ip[-1])]
              + 1).to(torch.int32)
        last = torch.tensor([n - (m - 1) * P for n, m in zip(lens, npg)], dtype=torch.int32)
        buf_ix[: ix.numel()].copy_(ix)
        w.plan(ip, buf_ix[: ix.numel()], last)
        g.replay()
        eager.plan(ip, ix, last)
        assert torch.equal(out, eager.run(q, (kc, vc))), step
        ref = _reference(q, kc, vc, ip, ix, lens)
        assert (out.float() - ref).abs().max().item() < 2e-2, step


@gpu
@pytest.mark.parametrize("norm", [False, True])
def test_fused_rope_writes_rotated_k_and_v_into_the_cache(norm):
    """With a K/V target the fused kernel leaves q/k exactly as without one and stores the rotated k
    and the untouched v rows where the reference write puts them; without norm weights it is HF's
    Llama RoPE (rounded cos/sin and products) within two bf16 ulp of the products it sums."""
    from nbgen.kernels import qk_norm_rope as fq
    from nbgen.models.layers import get_rope

    torch.manual_seed(0)
    hq, hkv, D, P, T = 32, 8, 128, 16, 9
    qkv = torch.randn(T, (hq + 2 * hkv) * D, device="cuda").bfloat16() * 3
    pos = torch.randint(0, 4000, (T,), device="cuda")
    rope = get_rope(D, 4096, 5e5, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256}).cuda()
    wq = torch.rand(D, device="cuda").bfloat16() + 0.5 if norm else None
    wk = torch.rand(D, device="cuda").bfloat16() + 0.5 if norm else None
    shape = (40, hkv, P, D)
    kc, vc = torch.zeros(shape, device="cuda").bfloat16(), torch.zeros(shape, device="cuda").bfloat16()
    slots = torch.randperm(39 * P, device="cuda")[:T] + P
    plain = qkv.clone()
    fq.qk_norm_rope_(plain, pos, wq, wk, 1e-6, rope.cos_sin_cache, hq, hkv, D)
    fq.qk_norm_rope_(qkv, pos, wq, wk, 1e-6, rope.cos_sin_cache, hq, hkv, D, kv=(kc, vc, slots))
    assert torch.equal(qkv, plain)
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    write_kv_torch(qkv[:, hq * D: (hq + hkv) * D], qkv[:, (hq + hkv) * D:], ref_k, ref_v, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v) and kc.abs().sum() > 0
    if not norm:    # HF's Llama RoPE in bf16: the kernel rounds where torch's ops round
        x = torch.randn(T, (hq + 2 * hkv) * D, device="cuda").bfloat16() * 3
        q, k, _v = x.split([hq * D, hkv * D, hkv * D], dim=-1)
        cos, sin = rope._cos_sin(pos, torch.bfloat16)
        refs = (rope._rotate(q, cos, sin), rope._rotate(k, cos, sin))
        fq.qk_norm_rope_(x, pos, None, None, 0.0, rope.cos_sin_cache, hq, hkv, D)
        for got, ref in zip((q, k), refs):
            assert (got == ref).float().mean().item() > 0.99
            ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp(min=2 ** -60))) - 7)
            assert bool(((got.float() - ref.float()).abs() <= ulp).all())


@gpu
def test_engine_triton_decode_matches_flashinfer_decode(gpu_model_dir, monkeypatch):
    """Decode batches of 1-12 through nbgen's kernel (graphs and eager) agree with flashinfer's decode
    (the automatic fallback for head sizes the kernel does not take)."""
    from nbgen.kernels import triton_decode

    prompts = gpu_prompts(12)
    ours = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    eager = gpu_generate(gpu_model_dir, prompts, logprobs=True, disable_cuda_graph=True)
    monkeypatch.setattr(triton_decode, "supported", lambda head_dim: False)
    theirs = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    assert_close_runs(ours, theirs)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in eager]


def test_padded_batch_size_is_the_graph_size_a_batch_replays_at():
    """Kernels that pick splits by batch size use padded_batch_size, so it must name the CUDA graph
    a decode batch of n seqs replays (the smallest default graph size >= n) for every n."""
    from nbgen.kernels.batch_sizes import graph_batch_sizes, padded_batch_size

    for max_bs in (64, 128, 256, 512):
        sizes = graph_batch_sizes(max_bs)
        for n in range(1, max_bs + 1):
            assert padded_batch_size(n) == next(b for b in sizes if b >= n), (max_bs, n)
    assert padded_batch_size(3) == 4 and padded_batch_size(1000) == 1024
