"""kernels/triton_norm.py — RMSNorm, add+RMSNorm, SiLU-and-mul with HF's rounding — against the torch
path of models/layers.py: under TRITON_INTERPRET=1 (a subprocess; fp32 and fp16, since the interpreter's
bf16 casts truncate) and on the GPU (``gpu``) in bf16."""
from __future__ import annotations

import pytest
import torch

from tests.tiny_models import run_under_triton_interpreter

CHECK = r"""
import torch, torch.nn.functional as F
from nbgen.kernels import triton_norm as tn

def ref_norm(x, w, eps):
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

torch.manual_seed(0)
dev = DEVICE
for dt in DTYPES:
    tol = 1e-6 if dt == torch.float32 else 2e-3     # fp32: the sum order; half: one rounding
    for T, H in ((1, 64), (5, 96), (3, 576)):
        x = torch.randn(T, H, dtype=dt, device=dev)
        r = torch.randn(T, H, dtype=dt, device=dev)
        w = (1 + 0.1 * torch.randn(H, device=dev)).to(dt)
        torch.testing.assert_close(tn.rms_norm(x, w, 1e-6), ref_norm(x, w, 1e-6), atol=tol, rtol=tol)
        s = x + r
        want = ref_norm(s, w, 1e-6)
        x2, r2 = x.clone(), r.clone()
        tn.add_rms_norm_(x2, r2, w, 1e-6)
        assert torch.equal(r2, s)
        torch.testing.assert_close(x2, want, atol=tol, rtol=tol)
        gu = torch.randn(T, 2 * H, dtype=dt, device=dev)
        g, u = gu.chunk(2, dim=-1)
        torch.testing.assert_close(tn.silu_and_mul(gu), F.silu(g) * u, atol=tol, rtol=tol)
    # per-head norm on a strided view of a qkv projection: [T, heads, D] inside [T, 3 * heads * D]
    qkv = torch.randn(4, 3 * 2 * 32, dtype=dt, device=dev)
    q = qkv[:, : 64].view(4, 2, 32)
    wq = (1 + 0.1 * torch.randn(32, device=dev)).to(dt)
    out = tn.rms_norm(q, wq, 1e-6)
    assert out.is_contiguous() and out.shape == q.shape
    torch.testing.assert_close(out, ref_norm(q, wq, 1e-6), atol=tol, rtol=tol)
print("OK")
"""


def test_kernels_under_the_interpreter() -> None:
    code = CHECK.replace("DEVICE", "'cpu'").replace("DTYPES", "(torch.float32, torch.float16)")
    out = run_under_triton_interpreter(code)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_the_gpu_in_bf16() -> None:
    exec(CHECK.replace("DEVICE", "'cuda'").replace("DTYPES", "(torch.bfloat16, torch.float16)"), {})
