"""The torch stand-in for flashinfer's paged prefill (attention/prefill_standin.py) against a plain causal
attention per sequence (CPU), and against flashinfer's wrapper (``gpu``)."""
from __future__ import annotations

import math

import pytest
import torch

from nbgen.attention.prefill_standin import SdpaPrefill

P, HQ, HKV, D = 4, 4, 2, 16
GPU_D = 128          # flashinfer's prefill kernels take head sizes 64 / 128 / 256


def _case(dtype: torch.dtype, device: str, kv_lens=(5, 9, 16, 3), q_lens=(5, 2, 7, 1), d: int = D):
    g = torch.Generator().manual_seed(0)
    need = sum(math.ceil(n / P) for n in kv_lens)
    pages = (1 + torch.randperm(2 * need, generator=g)[:need]).tolist()      # scattered, page 0 unused
    kc = torch.randn(2 * need + 1, HKV, P, d, generator=g).to(device, dtype)
    vc = torch.randn(2 * need + 1, HKV, P, d, generator=g).to(device, dtype)
    qo, ip, idx, last, k = [0], [0], [], [], 0
    for n, m in zip(kv_lens, q_lens):
        np_ = math.ceil(n / P)
        idx += pages[k: k + np_]
        k += np_
        ip.append(ip[-1] + np_)
        qo.append(qo[-1] + m)
        last.append(n - (np_ - 1) * P)
    q = torch.randn(qo[-1], HQ, d, generator=g).to(device, dtype)
    return q, kc, vc, qo, ip, idx, last


def _reference(q, kc, vc, qo, ip, idx, last, scale):
    out = torch.empty_like(q, dtype=torch.float32)
    for i in range(len(last)):
        n = (ip[i + 1] - ip[i] - 1) * P + last[i]
        pg = torch.tensor(idx[ip[i]: ip[i + 1]])
        k = kc[pg].permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :n].float().repeat_interleave(HQ // HKV, 0)
        v = vc[pg].permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :n].float().repeat_interleave(HQ // HKV, 0)
        qs = q[qo[i]: qo[i + 1]].float().transpose(0, 1)                  # [HQ, m, D]
        m = qs.shape[1]
        s = qs @ k.transpose(1, 2) * scale
        pos = torch.arange(n - m, n)[:, None]
        s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        out[qo[i]: qo[i + 1]] = (s.softmax(-1) @ v).transpose(0, 1)
    return out


def _plan(w: SdpaPrefill, qo, ip, idx, last, d: int = D) -> None:
    t = lambda x: torch.tensor(x, dtype=torch.int32)   # noqa: E731
    w.plan(t(qo), t(ip), t(idx), t(last), HQ, HKV, d, P, causal=True, sm_scale=d ** -0.5, non_blocking=True)


def test_matches_causal_attention_per_sequence() -> None:
    q, kc, vc, qo, ip, idx, last = _case(torch.float32, "cpu")
    w = SdpaPrefill(torch.device("cpu"))
    _plan(w, qo, ip, idx, last)
    want = _reference(q, kc, vc, qo, ip, idx, last, D ** -0.5)
    torch.testing.assert_close(w.run(q, (kc, vc)), want, atol=1e-5, rtol=1e-5)
    out = torch.zeros_like(q)                                               # into the caller's buffer
    assert w.run(q, (kc, vc), out=out) is out
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # an fp8 pool: pages widened and scaled as flashinfer's k_scale / v_scale do
    k8, v8 = (kc / 2).to(torch.float8_e4m3fn), (vc / 4).to(torch.float8_e4m3fn)
    want8 = _reference(q, k8.float() * 2, v8.float() * 4, qo, ip, idx, last, D ** -0.5)
    torch.testing.assert_close(w.run(q, (k8, v8), k_scale=2.0, v_scale=4.0), want8, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_matches_flashinfer_prefill_on_the_gpu() -> None:
    flashinfer = pytest.importorskip("flashinfer")
    q, kc, vc, qo, ip, idx, last = _case(torch.bfloat16, "cuda", kv_lens=(37, 130, 64, 9), q_lens=(37, 20, 1, 9),
                                         d=GPU_D)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")   # noqa: E731
    fi = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "HND")
    fi.plan(t(qo), t(ip), t(idx), t(last), HQ, HKV, GPU_D, P, causal=True, sm_scale=GPU_D ** -0.5,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    w = SdpaPrefill(torch.device("cuda"))
    _plan(w, qo, ip, idx, last, d=GPU_D)
    torch.testing.assert_close(w.run(q, (kc, vc)), fi.run(q, (kc, vc)), atol=2e-2, rtol=2e-2)
