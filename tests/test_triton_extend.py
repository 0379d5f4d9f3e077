"""The causal chunk ("extend") attention kernel (kernels/triton_extend.py) against the fp32 causal
attention of the dequantized pages: chunks after cached prefixes that cross page boundaries, fresh
chunks, one-token rows, several sequences in one call, splits of the prefix, unit and non-unit scales.

CPU: under TRITON_INTERPRET=1 (small heads; fp16 and fp32 queries over model-dtype pages, fp16 over
e4m3 pages). GPU (``gpu``): Llama-3.1-8B heads, bf16 queries over bf16 and e4m3 pages."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nbgen.attention import kv_quant
from tests.tiny_models import run_under_triton_interpreter

FP8 = torch.float8_e4m3fn


def reference_extend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, qo: list[int], indptr: np.ndarray,
                     indices: np.ndarray, lens: list[int], k_scale: float, v_scale: float) -> torch.Tensor:
    """fp32 softmax(q (K k_scale)^T / sqrt(D) + causal mask) (V v_scale): chunk row t of sequence b
    (q_len rows, KV length n including them) sees keys [0, n - q_len + t]; GQA by repetition."""
    hq, hkv, D = q.shape[1], kc.shape[1], kc.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b, n in enumerate(lens):
        rows = slice(qo[b], qo[b + 1])
        ql = qo[b + 1] - qo[b]
        pg = torch.from_numpy(indices[indptr[b]: indptr[b + 1]]).long()
        k = kc.cpu()[pg].transpose(1, 2).reshape(-1, hkv, D)[:n].float().repeat_interleave(hq // hkv, 1) * k_scale
        v = vc.cpu()[pg].transpose(1, 2).reshape(-1, hkv, D)[:n].float().repeat_interleave(hq // hkv, 1) * v_scale
        s = torch.einsum("thd,nhd->htn", q[rows].float().cpu(), k) * D ** -0.5
        hidden = torch.arange(n)[None, :] > (n - ql + torch.arange(ql))[:, None]              # [ql, n]
        s = s.masked_fill(hidden[None], float("-inf"))
        out[rows] = torch.einsum("htn,nhd->thd", s.softmax(-1), v)
    return out


def _tables(rng: np.random.Generator, seqs: list[tuple[int, int]], P: int):
    """Page tables for (cached, chunk) per sequence, pages scattered over the pool (page 0 unused)."""
    lens = [c + t for c, t in seqs]
    per = [-(-n // P) for n in lens]
    perm = rng.permutation(sum(per)) + 1
    indptr = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(per, out=indptr[1:])
    last = np.array([n - (k - 1) * P for n, k in zip(lens, per)], dtype=np.int32)
    qo = [0] + np.cumsum([t for _, t in seqs]).tolist()
    return lens, qo, indptr, perm.astype(np.int32), last, sum(per) + 1


def check_extend(device: str, dtype: torch.dtype, cases: list, fp8: bool, shapes: tuple = (None,)) -> None:
    """Each case (hq, hkv, D, P, [(cached, chunk)], (k_scale, v_scale)) under every launch shape."""
    from nbgen.kernels.triton_extend import TritonExtendWrapper

    dev = torch.device(device)
    for i, (hq, hkv, D, P, seqs, (ks, vs)) in enumerate(cases):
        rng = np.random.default_rng(i)
        lens, qo, ip, idx, last, pages = _tables(rng, seqs, P)
        g = torch.Generator().manual_seed(i)
        kc = torch.randn(pages, hkv, P, D, generator=g) * 2
        vc = torch.randn(pages, hkv, P, D, generator=g) * 2
        if fp8:
            kc, vc = kv_quant.store(kc, ks, FP8), kv_quant.store(vc, vs, FP8)
        else:
            kc, vc = kc.to(dtype), vc.to(dtype)
        kc, vc = kc.to(dev), vc.to(dev)
        # q as a strided view of a fused qkv row (q heads, then k and v heads)
        qkv = torch.randn(qo[-1], hq + 2 * hkv, D, generator=g).to(dtype).to(dev)
        q = qkv[:, :hq]
        ref = reference_extend(q, kc, vc, qo, ip, idx, lens, ks, vs)
        tol = 2 ** -7 * ref.abs() + (2e-2 if dtype != torch.float32 else 1e-4) * vs
        for shape in shapes:
            w = TritonExtendWrapper(hq, hkv, D, P, dev, shape)
            w.plan(torch.tensor(qo, dtype=torch.int32), torch.from_numpy(ip), torch.from_numpy(idx),
                   torch.from_numpy(last))
            for _ in range(2):             # a second run: the split counters re-armed
                out = w.run(q, (kc, vc), k_scale=ks, v_scale=vs)
            err = (out.float().cpu() - ref).abs()
            assert bool((err <= tol).all()), (i, shape, w.planned.splits, err.max().item())


CPU_CASES = [
    # hq, hkv, D, P, [(cached, chunk tokens)], (k_scale, v_scale)
    (8, 2, 64, 4, [(37, 21), (0, 9), (6, 1), (64, 16)], (1.0, 1.0)),    # G 4: prefix across pages, fresh, one row
    (2, 2, 64, 8, [(0, 70), (129, 5)], (0.5, 2.0)),                      # G 1: 64-token blocks, a second block
    (6, 2, 32, 4, [(50, 13)], (1.0, 1.0)),                               # G 3: tile rows not a multiple of G
]


def _interpreted() -> None:
    from nbgen.kernels.triton_extend import ExtendShape

    shapes = (None, ExtendShape(16, 16, 4, 2, ahead=False, splits=4), ExtendShape(32, 32, 4, 3, splits=2))
    check_extend("cpu", torch.float16, CPU_CASES, fp8=False, shapes=shapes)
    check_extend("cpu", torch.float32, CPU_CASES[1:2], fp8=False)
    check_extend("cpu", torch.float16, CPU_CASES[:2], fp8=True, shapes=shapes[:2])
    check_extend("cpu", torch.float16, [(4, 1, 128, 16, [(40, 8)], (2.0, 0.5))], fp8=True)


def test_extend_kernel_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_triton_extend as t; t._interpreted()")
    assert res.returncode == 0, res.stderr[-3000:]


def test_plan_rejects_bad_tables() -> None:
    pytest.importorskip("triton")
    from nbgen.kernels.triton_extend import ExtendShape, TritonExtendWrapper

    w = TritonExtendWrapper(8, 2, 64, 16, torch.device("cpu"))
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)      # noqa: E731
    with pytest.raises(ValueError, match="qo_indptr"):
        w.plan(i32(0, 4, 2), i32(0, 1, 2), i32(1, 2), i32(4, 4))
    with pytest.raises(ValueError, match="kv_indptr"):
        w.plan(i32(0, 8), i32(0, 1), i32(1), i32(4))          # 8 chunk rows, 4 keys
    with pytest.raises(ValueError, match="kv_indptr"):
        w.plan(i32(0, 8), i32(0, 1, 2), i32(1, 2), i32(16))
    with pytest.raises(ValueError, match="num_q_heads"):
        TritonExtendWrapper(6, 4, 64, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="splits"):
        TritonExtendWrapper(8, 2, 64, 16, torch.device("cpu"), ExtendShape(splits=3)).plan(
            i32(0, 8), i32(0, 1), i32(1), i32(8))
    with pytest.raises(ValueError, match="block_m"):
        ExtendShape(block_m=24)
    w.plan(i32(0, 8), i32(0, 1), i32(1), i32(8))
    with pytest.raises(ValueError, match="q must be"):
        w.run(torch.zeros(7, 8, 64), (torch.zeros(2, 2, 16, 64),) * 2)


def test_plan_orders_blocks_longest_first() -> None:
    from nbgen.kernels.triton_extend import num_splits, plan_blocks

    seq, first, longest = plan_blocks(np.array([40, 1, 32]), np.array([40, 1001, 32]), 16)
    assert seq.tolist() == [1, 0, 0, 2, 0, 2] and first.tolist() == [0, 32, 16, 16, 0, 0]
    assert longest == 1001
    assert num_splits(6 * 8, 1001, 132) == 4 and num_splits(6 * 8, 200, 132) == 1
    assert num_splits(400, 5000, 132) == 1 and num_splits(1, 1 << 20, 132) == 8


def test_plan_stages_its_tables_in_one_buffer() -> None:
    """The tables and host page indices land in one int32 buffer (indices 16-byte aligned), across plans
    that grow the staging buffers; indices already on the device are read in place."""
    pytest.importorskip("triton")
    from nbgen.kernels.triton_extend import TritonExtendWrapper

    w = TritonExtendWrapper(8, 2, 64, 16, torch.device("cpu"))
    rng = np.random.default_rng(0)
    for B in (1, 40, 2, 3):
        lens, qo, ip, idx, last, _ = _tables(rng, [(int(rng.integers(0, 1000)), int(rng.integers(1, 130)))
                                                  for _ in range(B)], 16)
        w.plan(qo, ip.tolist(), idx.tolist(), last.tolist())
        tab, nb = w.tab.tolist(), len(w.planned.seq)
        assert tab[: 3 * B + 2] == qo + ip.tolist() + last.tolist()
        assert tab[3 * B + 2: 3 * B + 2 + 2 * nb] == w.planned.seq.tolist() + w.planned.first.tolist()
        assert w.indices.tolist() == idx.tolist() and (w.indices.data_ptr() - w.tab.data_ptr()) % 16 == 0
    on_device = torch.from_numpy(idx)
    w.plan(qo, ip, on_device, last)
    assert w.indices is on_device


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_extend_matches_reference(fp8):
    """Llama-3.1-8B heads (32/8/128, pages of 16): the small chunks of a mixed step after cached
    prefixes, a long chunk, several sequences; each under the default and two other launch shapes."""
    from nbgen.kernels.triton_extend import ExtendShape

    cases = [(32, 8, 128, 16, [(512, 128)], (1.0, 1.0)),
             (32, 8, 128, 16, [(896, 128)], (0.5, 2.0)),
             (32, 8, 128, 16, [(640, 64), (637, 61), (0, 1)], (1.0, 1.0)),
             (32, 8, 128, 16, [(1536, 512), (0, 300), (3000, 7)], (1.0, 1.0))]
    shapes = (None, ExtendShape(32, 64, 4, 3), ExtendShape(64, 64, 4, 3, splits=1))
    check_extend("cuda", torch.bfloat16, cases, fp8, shapes=shapes)
