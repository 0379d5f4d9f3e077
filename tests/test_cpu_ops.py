"""nbgen's C kernels for the CPU (nbgen/csrc/cpu_ops.c) against plain torch references."""
from __future__ import annotations

import pytest
import torch

from nbgen.runtime import cpu_ops

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
    assert tiny_engine._loop.runner.backend.cpu_kernels is True
