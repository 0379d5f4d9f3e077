"""GPU fast path (CUDA only): flashinfer vs torch attention, graphs vs eager, overlap on/off, HF parity.

Models: random bf16 Llama / Qwen2 / Qwen3 with head_dim 128 (the head size of the benchmark models, so
the flashinfer kernels JIT-compiled here are the ones the benchmarks reuse).
"""
from __future__ import annotations

import random

import pytest
import torch

import nbgen

from tests.tiny_models import (GREEDY_SP, assert_close_prompt_logprobs, assert_close_runs, gpu_generate,
                               gpu_prompts, output_ids, teacher_forced_vs_hf, write_kv_torch)

gpu = pytest.mark.gpu

@gpu
def test_graph_eager_overlap(gpu_model_dir):
    prompts = gpu_prompts()
    # same kernels in the same order: overlap scheduling must not change a single token
    assert output_ids(gpu_generate(gpu_model_dir, prompts)) == output_ids(gpu_generate(gpu_model_dir, prompts, disable_overlap_schedule=True))
    base = gpu_generate(gpu_model_dir, prompts, logprobs=True)                     # decode through CUDA graphs
    assert_close_runs(gpu_generate(gpu_model_dir, prompts, logprobs=True, disable_cuda_graph=True), base)
    # chunked prefill over cached prefixes, then prefix-cache hits on a second run
    with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16,
                      chunked_prefill_size=64) as eng:
        a = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, use_tqdm=False)
        b = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, use_tqdm=False)
    assert_close_runs(a, base)
    assert_close_runs(b, a)
    assert b[-1]["meta_info"]["cached_tokens"] > 0 or len(prompts[-1]) < 16


@gpu
def test_piecewise_prefill_graphs(gpu_model_dir):
    """Steps with prefill chunks replayed as graph pieces around an eager attention per layer give the
    eager forward's logprobs: several token buckets (padding rows), chunks over cached prefixes, mixed
    steps with decodes (their decode rows attended inside the pieces; placeholder ids under overlap)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (3, 31, 100, 257, 600, 1000)]
    prompts += [p[: len(p) // 2] + [7, 8, 9] for p in prompts[3:]]      # shared prefixes

    staged: list[int] = []

    def run(logprobs: bool, **cfg) -> tuple[dict, list[dict]]:
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16,
                          chunked_prefill_size=512, **cfg) as eng:
            info = eng.get_server_info()
            kw = {"return_logprob": True, "logprob_start_len": 0} if logprobs else {}
            out = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False, **kw)
            pieces = eng.loop.runner.prefill_graphs
            staged.append(pieces.decodes.staged if pieces is not None and pieces.decodes is not None else 0)
            return info, out

    info, on = run(True)
    info_off, off = run(True, disable_piecewise_cuda_graph=True)
    assert info["piecewise_cuda_graph_tokens"] == [32, 64, 128, 256, 384, 512]
    assert info_off["piecewise_cuda_graph_tokens"] == [] and info_off["cuda_graph_batch_sizes"]
    assert_close_prompt_logprobs(on, off, prompts, "graphs vs eager")
    assert_close_runs(on, off)
    assert staged[0] > 0 and staged[1] == 0     # mixed steps whose decode rows the pieces attended
    # the overlap path (no logprobs): greedy tokens of graph and eager prefill steps. A mixed step's decode
    # rows split their KV by the captured row count in the pieces and by their own count eagerly, so a
    # near-tie can fork a sequence (one H100: llama 1.0000, qwen2 0.8819 of the tokens equal); a broken
    # kernel forks nearly every sequence at once
    a, b = output_ids(run(False)[1]), output_ids(run(False, disable_piecewise_cuda_graph=True)[1])
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t)) / sum(len(s) for s in a)
    print(f"greedy tokens equal: {same:.4f}")
    assert same >= 0.85


@gpu
def test_mixed_steps_split_decode_rows(gpu_model_dir, monkeypatch):
    """Mixed steps send their leading decode rows through the Triton decode kernel and only the
    prefill chunks through flashinfer's prefill kernel: the tokens and logprobs of the same steps run
    whole through the prefill kernel (no leading decode rows split off)."""
    from nbgen.attention import flashinfer_backend as fb

    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 40, 300, 700, 90, 1000)]
    splits: list[int] = []
    leading = fb.FlashInferBackend._leading_decodes

    def spy(self, seqs):
        d = leading(self, seqs)
        splits.append(d)
        return d

    monkeypatch.setattr(fb.FlashInferBackend, "_leading_decodes", spy)
    split = gpu_generate(gpu_model_dir, prompts, logprobs=True, chunked_prefill_size=128)
    assert sum(d > 0 for d in splits) >= 5, splits        # mixed steps with decode rows were split
    monkeypatch.setattr(fb.FlashInferBackend, "_leading_decodes", lambda self, seqs: 0)
    whole = gpu_generate(gpu_model_dir, prompts, logprobs=True, chunked_prefill_size=128)
    assert_close_runs(split, whole)


@gpu
def test_flashinfer_matches_torch_backend(gpu_model_dir):
    prompts = gpu_prompts()
    assert_close_runs(gpu_generate(gpu_model_dir, prompts, logprobs=True),
                      gpu_generate(gpu_model_dir, prompts, logprobs=True, attention_backend="torch",
                                   disable_cuda_graph=True))


@gpu
@pytest.mark.parametrize("heads,dim,page", [(8, 128, 16), (2, 64, 64), (5, 64, 16)])
def test_kv_write_kernel(heads, dim, page):
    """The Triton K/V write puts every row where the torch indexing write does (strided k/v rows)."""
    from nbgen.kernels.kv_write import write_kv

    torch.manual_seed(0)
    n_pages, T = 50, 37
    shape = (n_pages, heads, page, dim)
    qkv = torch.randn(T, 6 * heads * dim, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, 4 * heads * dim: 5 * heads * dim], qkv[:, 5 * heads * dim:]    # strided views
    slots = torch.randperm(n_pages * page - page, device="cuda")[:T] + page       # never page 0
    got = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    ref = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    write_kv(k, v, got[0], got[1], slots)
    write_kv_torch(k, v, ref[0], ref[1], slots)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[0].abs().sum() > 0


@gpu
@pytest.mark.parametrize("chunk", [None, 64])
def test_hf_parity_teacher_forced(gpu_model_dir, chunk):
    r = teacher_forced_vs_hf(gpu_model_dir, chunk)
    # random models have many near-ties; top-1 must agree wherever HF's top-2 gap exceeds bf16 noise
    assert r["agree"] >= 0.95 and r["clear"] >= 0.5
    assert r["agree_clear"] >= 0.99
    assert r["dlp"] <= 0.05


def test_prefill_token_buckets():
    """CPU: buckets rise to the budget, end at it, and pad a step by at most 1/3 (1/8 above 4k)."""
    from nbgen.runtime.prefill_graphs import token_buckets

    b = token_buckets(8192)
    assert b[0] == 32 and b[-1] == 8192 and b == sorted(set(b))
    assert all(y / x <= 1.5 for x, y in zip(b[3:], b[4:])) and all(y / x <= 1.25 for x, y in zip(b, b[1:]) if x >= 4096)
    assert token_buckets(512) == [32, 64, 128, 256, 384, 512]
    assert token_buckets(100) == [32, 64, 100] and token_buckets(16) == [16]
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens"):
        nbgen.Engine("unused", piecewise_cuda_graph_max_tokens=0)


def test_decode_tables_match_page_lists():
    """CPU: the numpy decode page tables equal the list-built ones while pages grow, get replaced
    (preemption) and get rewritten in place after a prompt step (prefix-cache swap)."""
    from nbgen.attention.base import AttentionBackend
    from nbgen.attention.page_tables import DecodeTables, page_tables
    from nbgen.core.batch import ScheduledBatch, SeqWork
    from nbgen.core.request import Request
    from nbgen.core.sampling import SamplingParams

    P, rng = 4, random.Random(0)
    reqs = [Request(str(i), [1] * rng.randint(1, 9), SamplingParams()) for i in range(6)]
    for r in reqs:
        r.pages = [rng.randrange(1, 1000) for _ in range(-(-len(r.prompt_ids) // P))]
    tables = DecodeTables(P)
    kv = {r.rid: len(r.prompt_ids) for r in reqs}
    for step in range(60):
        live = [r for r in reqs if rng.random() < 0.8]
        if step % 7 == 3:                     # a prompt step: entries of its seqs are forgotten, then swapped
            r = live[0] if live else reqs[0]
            tables.forget(ScheduledBatch([SeqWork(r, [1, 1], 0, r.pages, True)], P))
            r.pages[0] = rng.randrange(1, 1000)
        if step % 11 == 5 and live:           # preemption hands the request a new list
            live[-1].pages = list(live[-1].pages)
        seqs = []
        for r in live:
            kv[r.rid] += 1
            while len(r.pages) * P < kv[r.rid]:
                r.pages.append(rng.randrange(1, 1000))
            r.output_ids = [0] * (kv[r.rid] - len(r.prompt_ids))
            seqs.append(SeqWork(r, [0], kv[r.rid] - 1, r.pages, True))
        if not seqs:
            continue
        batch = ScheduledBatch(seqs, P)
        indptr, idx, last, pos, slots = tables.build(batch.seqs)
        _, ref_ptr, ref_idx, ref_last = page_tables(batch.seqs, P)
        assert indptr.tolist() == ref_ptr and idx.tolist() == ref_idx and last.tolist() == ref_last
        assert slots.tolist() == AttentionBackend.slot_mapping(tables_backend(P), batch)
        assert pos.tolist() == [s.start_pos for s in seqs]


def tables_backend(P: int):
    class _B:
        spec = type("S", (), {"page_size": P})()
    return _B()


@gpu
@pytest.mark.parametrize("heads", [(16, 8), (14, 2)])
def test_direct_replan_matches_public_plan(heads):
    """The graph wrappers' direct re-plan (flashinfer's C++ planner called directly) produces the
    same plan and the same attention output as flashinfer's public plan(), step after step."""
    from nbgen.attention.base import KVCacheSpec
    from nbgen.attention.flashinfer_backend import FlashInferBackend

    hq, hkv = heads
    P, bs, dev = 16, 24, torch.device("cuda")
    spec = KVCacheSpec(1, 4096, P, hq, hkv, 128, torch.bfloat16, dev)
    be = FlashInferBackend(spec)
    be.triton_decode = False   # flashinfer's graph wrappers (the fallback for head sizes nbgen's kernel lacks)
    if not be.use_tensor_cores:
        pytest.skip("direct re-plan covers tensor-core decode only")
    bufs = [(torch.zeros(bs + 1, dtype=torch.int32, device=dev), torch.zeros(bs * 200, dtype=torch.int32, device=dev),
             torch.zeros(bs, dtype=torch.int32, device=dev)) for _ in range(2)]
    ws = [be.make_decode_wrapper(*b) for b in bufs]
    torch.manual_seed(0)
    be.k_cache[0].normal_()
    be.v_cache[0].normal_()
    rng = random.Random(1)
    for step in range(4):
        lens = [rng.randint(1, 3000) for _ in range(bs)]
        npages = [-(-n // P) for n in lens]
        indptr = torch.tensor([0] + list(torch.tensor(npages).cumsum(0)), dtype=torch.int32).pin_memory()
        last = torch.tensor([n - (p - 1) * P for n, p in zip(lens, npages)], dtype=torch.int32).pin_memory()
        idx = torch.randint(1, 4096, (int(indptr[-1]),), dtype=torch.int32, device=dev)
        outs, infos = [], []
        for w, b in zip(ws, bufs):
            b[1][: idx.numel()].copy_(idx)
            if step == 0:       # first plan of a wrapper: always the public one
                be.plan_decode(w, indptr, b[1][: idx.numel()], last)
            elif w is ws[1]:
                assert be.direct_replan(w, indptr, last)
            else:
                w.plan(indptr, b[1][: idx.numel()], last, hq, hkv, 128, P, pos_encoding_mode="NONE",
                           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=be.scale,
                           non_blocking=True)
            q = torch.randn(bs, hq, 128, dtype=torch.bfloat16, device=dev, generator=torch.Generator(dev).manual_seed(step))
            outs.append(w.run(q, (be.k_cache[0], be.v_cache[0])))
            infos.append(list(w._plan_info))
        torch.cuda.synchronize()
        assert infos[0] == infos[1], step
        assert torch.equal(outs[0], outs[1]), step


@gpu
@pytest.mark.parametrize("hq,hkv", [(16, 8), (14, 2)])
def test_fused_qk_norm_rope_matches_hf_arithmetic(hq, hkv):
    """Qwen3's fused q/k norm + RoPE kernel follows HF's bf16 arithmetic (RMSNorm then rotate_half
    RoPE with rounded cos/sin): mostly bit-identical, else within two bf16 ulp of the products it
    sums (a single-rounding RoPE scores ~70 % / 2 ulp, flashinfer's norm + RoPE ~55 % / 3 ulp,
    a sign error ~6 % / 500 ulp in a CPU emulation of this check); v untouched.
    (Measured on an H100: 82 % bit-identical while the kernel was compiled with FMA contraction;
    without it the RoPE part is exact (tests/test_triton_decode.py). The flashinfer norm + RoPE it
    replaces are not exact either; end-to-end agreement with HF is test_hf_parity_teacher_forced's job.)"""
    from nbgen.kernels import qk_norm_rope as fq
    from nbgen.models.layers import RMSNorm, get_rope

    torch.manual_seed(0)
    D, T, dev = 128, 77, "cuda"
    qkv = torch.randn(T, (hq + 2 * hkv) * D, device=dev, dtype=torch.bfloat16) * 3
    pos = torch.randint(0, 4000, (T,), device=dev)
    qn, kn = RMSNorm(D, 1e-6).to(dev, torch.bfloat16), RMSNorm(D, 1e-6).to(dev, torch.bfloat16)
    with torch.no_grad():
        qn.weight.uniform_(0.5, 1.5)
        kn.weight.uniform_(0.5, 1.5)
    rope = get_rope(D, 4096, 1e6, None).to(dev)
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
    ref_nq = qn._norm(q.reshape(T, hq, D)).reshape(T, -1)         # the torch path = HF's formula
    ref_nk = kn._norm(k.reshape(T, hkv, D)).reshape(T, -1)
    cos, sin = rope._cos_sin(pos, torch.bfloat16)
    ref_q, ref_k = rope._rotate(ref_nq, cos, sin), rope._rotate(ref_nk, cos, sin)
    v0 = v.clone()
    assert fq.supported(qkv, D)
    fq.qk_norm_rope_(qkv, pos, qn.weight, kn.weight, 1e-6, rope.cos_sin_cache, hq, hkv, D)
    for got, ref, normed in ((q, ref_q, ref_nq), (k, ref_k, ref_nk)):
        diff = (got.float() - ref.float()).abs()
        # the scale of the two rounded products each output sums (|x1 cos| + |x2 sin|): a one-ulp
        # difference upstream shows at that scale, also where the sum itself cancels to ~0
        n = normed.float().abs().view(T, -1, D)
        c, sn = cos.float().abs(), sin.float().abs()
        n1, n2 = n[..., : D // 2], n[..., D // 2:]
        scale = torch.cat([n1 * c + n2 * sn, n2 * c + n1 * sn], dim=-1).view(T, -1)
        ulp = torch.exp2(torch.floor(torch.log2(scale.clamp(min=2 ** -60))) - 7)
        assert (diff == 0).float().mean() > 0.75                     # mostly bit-identical
        assert bool((diff <= 2 * ulp).all()), float((diff / ulp).max())   # else within two bf16 ulp
    assert torch.equal(v, v0)
