"""The Qwen2(.5)-VL tower's fast paths against their references.

- ``kernels/vision_ops.py``: the 2-D rotary and SiLU-and-mul Triton kernels under TRITON_INTERPRET=1 (in a
  subprocess: the interpreter is chosen when Triton loads) against the torch references; on the GPU
  (``gpu`` mark) in bf16.
- M-RoPE image steps: the LLM's fused RoPE kernel reading the step's M-RoPE table (interpreter: fp32;
  GPU: bf16 / fp16) against M-RoPE in torch.
- ``SegmentPlan``: attention per segment (views for back-to-back equal segments, gathers for scattered
  ones, empty segments) equals one SDPA per segment.
- The fused gate|up linear: HF's gate_proj / up_proj names resolve to its row halves for weight updates.
- GPU: the tower with flashinfer's norms and the kernels against HF's tower in bf16.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nbgen.kernels import vision_ops as vo
from nbgen.models.qwen2_vl_vision import padded_width
from nbgen.models.vision_plan import SegmentPlan
from tests.tiny_models import run_under_triton_interpreter


def _rope_want(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """HF's formula: q, k in fp32, x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), cast back."""
    N = qkv.shape[0]
    out = qkv.clone()
    qk = out.view(N, 3, heads, dim)[:, :2]
    xf = qk.float()
    c, s = torch.cat([cos, cos], -1)[:, None, None], torch.cat([sin, sin], -1)[:, None, None]
    rot = torch.cat([-xf[..., dim // 2:], xf[..., :dim // 2]], -1)
    qk.copy_((xf * c + rot * s).to(qkv.dtype))
    return out


def _kernel_cases(device: str) -> None:
    torch.manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        ulp = 0.0 if dt == torch.float32 else 2.0 ** -7      # the interpreter's bf16 casts truncate
        for N, H, D in ((7, 16, 80), (3, 2, 64), (1, 3, 10)):
            qkv = torch.randn(N, 3 * H * D, device=device).to(dt)
            f = torch.rand(N, D // 2, device=device) * 20
            cos, sin = f.cos(), f.sin()
            want = _rope_want(qkv, cos, sin, H, D)
            got = qkv.clone()
            vo.rope_2d_triton(got, cos, sin, H, D)
            torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=ulp)
            assert torch.equal(got[:, 2 * H * D:], qkv[:, 2 * H * D:])          # v untouched
        for N, I in ((5, 37), (4, 3420), (2, 8)):
            x = torch.randn(N, 2 * I, device=device).to(dt) * 3
            want = (F.silu(x[:, :I]) * x[:, I:]).float()                         # HF: two ops in the dtype
            torch.testing.assert_close(vo.silu_mul_triton(x).float(), want, atol=1e-6, rtol=2 * ulp + 1e-6)
    print("KERNELS_OK")


def _mrope_cases(device: str) -> None:
    """The LLM's fused RoPE kernel reading an M-RoPE step table at rows 0..T-1 (the image-step path of
    ``Qwen2VLAttention``) against M-RoPE in torch; with equal streams it equals 1-D RoPE's kernel."""
    from nbgen.kernels import qk_norm_rope as fr
    from nbgen.models.mrope import MRotaryEmbedding, mrope_positions

    torch.manual_seed(3)
    D, Hq, Hkv, T = 64, 4, 2, 30
    rope = MRotaryEmbedding(D, 4096, 10000.0, [8, 12, 12]).to(device)
    pos, _ = mrope_positions(T, [(3, 3 + 4 * 5)], [(1, 8, 10)], 2)
    positions = torch.tensor(pos, device=device)
    dtypes = (torch.float32,) if device == "cpu" else (torch.bfloat16, torch.float16)
    for dt in dtypes:      # the interpreter's bf16 casts truncate: bf16 is checked on the GPU
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=device).to(dt)
        q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], -1)
        wq, wk = rope(positions, q.reshape(T, Hq, D), k.reshape(T, Hkv, D))
        table, rows = rope.step_table(positions)
        assert rope.step_table(positions)[0] is table                      # built once per positions tensor
        got = qkv.clone()
        fr.qk_norm_rope_(got, rows, None, None, 0.0, table, Hq, Hkv, D)
        tol = 0.0 if dt == torch.float32 else 2.0 ** -7
        torch.testing.assert_close(got[:, :Hq * D], wq.reshape(T, -1), atol=1e-6, rtol=tol)
        torch.testing.assert_close(got[:, Hq * D:(Hq + Hkv) * D], wk.reshape(T, -1), atol=1e-6, rtol=tol)
    text = torch.arange(5, 5 + T, device=device)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=device).to(torch.bfloat16)
    one, three = qkv.clone(), qkv.clone()
    fr.qk_norm_rope_(one, text, None, None, 0.0, rope.cos_sin_cache, Hq, Hkv, D)
    table, rows = rope.step_table(text.expand(3, -1).contiguous())
    fr.qk_norm_rope_(three, rows, None, None, 0.0, table, Hq, Hkv, D)
    assert torch.equal(one, three)
    print("MROPE_OK")


@pytest.mark.parametrize("case", ["_kernel_cases", "_mrope_cases"])
def test_kernels_under_triton_interpreter(case: str) -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter(f"import tests.test_vision_ops as t; t.{case}('cpu')")
    assert "_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_torch_paths_match_hf_formulas() -> None:
    """The dispatchers on CPU tensors (torch) equal HF's formulas exactly."""
    torch.manual_seed(1)
    N, H, D = 6, 4, 80
    qkv = torch.randn(N, 3 * H * D)
    f = torch.rand(N, D // 2) * 20
    got = qkv.clone()
    vo.rope_2d_(got, f.cos(), f.sin(), H, D)
    assert torch.equal(got, _rope_want(qkv, f.cos(), f.sin(), H, D))
    x = torch.randn(3, 2 * 37)
    assert torch.equal(vo.silu_and_mul(x), F.silu(x[:, :37]) * x[:, 37:])


@pytest.mark.parametrize("lengths", [[16] * 5, [16, 16, 12, 16, 16, 12, 9], [0, 8, 0, 8, 4], [20],
                                     [8, 8, 4, 4, 8]])
def test_segment_plan_equals_per_segment_attention(lengths: list[int]) -> None:
    torch.manual_seed(2)
    N, H, D = sum(lengths), 3, 8
    qkv = torch.randn(N, 3, H, D)
    q, k, v = qkv.unbind(1)                                   # strided rows, as the tower's views
    want, pos = [], 0
    for n in lengths:
        if n:
            o = F.scaled_dot_product_attention(*(t[pos:pos + n].transpose(0, 1) for t in (q, k, v)))
            want.append(o.transpose(0, 1))
        pos += n
    got = SegmentPlan(lengths, q.device).attention(q, k, v)
    torch.testing.assert_close(got, torch.cat(want), atol=1e-6, rtol=1e-5)


def test_gate_up_names_resolve_to_row_halves(tmp_path: Path) -> None:
    from nbgen.bench.tiny_vlm import make_tiny_vlm
    from nbgen.models.model_config import read_model_config
    from nbgen.models.registry import get_model_class, prepare_config
    from nbgen.runtime.weight_names import WeightNames

    d = make_tiny_vlm(str(tmp_path), "qwen2_5_vl")
    cfg = prepare_config(read_model_config(d))
    model = get_model_class(cfg)(cfg)
    names = WeightNames(model)
    I = cfg.vision_config.intermediate_size
    for shard, hf in ((0, "gate_proj"), (1, "up_proj")):
        for kind in ("weight", "bias"):
            slot = names.resolve(f"visual.blocks.1.mlp.{hf}.{kind}")
            assert slot is not None and slot.param == f"visual.blocks.1.mlp.gate_up_proj.{kind}"
            assert slot.rows == (shard * padded_width(I), I)
    gu = model.visual.blocks[1].mlp["gate_up_proj"]
    Ip = padded_width(I)
    up = torch.randn(I, gu.in_features)
    gu.weight_loader(gu.weight, up, 1)
    assert torch.equal(gu.weight.data[Ip: Ip + I], up)
    # the padding rows of gate and up, and the down projection's padding columns, are zeros
    assert Ip > I and not gu.weight.data[I:Ip].any() and not gu.weight.data[Ip + I:].any()
    down = names.resolve("visual.blocks.1.mlp.down_proj.weight")
    assert down is not None and down.shape == (gu.in_features, I) and down.cols == (0, I)
    w = torch.randn(gu.in_features, I)
    model.visual.blocks[1].mlp["down_proj"].weight.weight_loader(model.visual.blocks[1].mlp["down_proj"].weight, w)
    assert torch.equal(names.read(down), w)
    assert not model.visual.blocks[1].mlp["down_proj"].weight.data[:, I:].any()


@pytest.mark.gpu
def test_kernels_cuda_bf16() -> None:
    _kernel_cases("cuda")
    _mrope_cases("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_tower_with_fused_kernels_close_to_hf(family: str, tmp_path: Path) -> None:
    """The tower in bf16 with flashinfer's norms on (as in an engine) and the Triton kernels, against HF's
    fp32 tower; images of mixed sizes (scattered segments) and of one size (views)."""
    import transformers as tf

    from nbgen.bench.tiny_vlm import make_tiny_vlm
    from nbgen.kernels import gpu_ops
    from nbgen.models.loader import iter_safetensors
    from nbgen.models.model_config import read_model_config
    from nbgen.models.registry import get_model_class, prepare_config
    from tests.tiny_models import random_images

    d = make_tiny_vlm(str(tmp_path), family, hidden_size=256, intermediate_size=512,
                      rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
    hf = tf.AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    proc = tf.AutoImageProcessor.from_pretrained(d)
    cfg = prepare_config(read_model_config(d))
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(iter_safetensors(d))
    ours = ours.to("cuda", torch.bfloat16)
    was = gpu_ops.fused_enabled(torch.empty(0, device="cuda", dtype=torch.bfloat16))
    gpu_ops.enable_fused(True)
    try:
        for ims in (random_images(4), [random_images(1)[0]] * 3):
            x = proc(images=ims, return_tensors="pt")
            with torch.no_grad():
                ref = torch.cat(hf.model.get_image_features(x["pixel_values"], x["image_grid_thw"]).pooler_output)
                got = ours.encode_images(x["pixel_values"].cuda(), [tuple(g) for g in x["image_grid_thw"].tolist()])
            err = (got.float().cpu() - ref).abs().max().item()
            assert err <= 3e-2 * ref.abs().max().item(), err
    finally:
        gpu_ops.enable_fused(was)


@pytest.mark.filterwarnings("ignore:.*other nbgen Engine")
def test_vlm_bench_profile_on_cpu(tmp_path: Path) -> None:
    """``--profile`` reruns the workload under the profiler and reports the tower's range (CPU: no kernels)."""
    from nbgen.bench.vlm import main

    res = main(["--tiny", "--device", "cpu", "--num-requests", "2", "--image-size", "56", "--output-len", "2",
                "--hf-requests", "0", "--profile", "--profile-dir", str(tmp_path)])
    prof = res["nbgen"]["profile"]
    assert prof["steps"] >= 2 and Path(prof["trace"]).exists() and prof["wall_s"] > 0
    assert prof["tower_forwards"] >= 1 and prof["tower_host_s"] > 0
    assert prof["images_per_tower_forward"] == 2 / prof["tower_forwards"]
    assert prof["gpu_busy_s"] == 0.0 and prof["tower_gpu_s"] == 0.0


def test_trace_summary_counts_union_and_tower(tmp_path: Path) -> None:
    import gzip
    import json

    from nbgen.bench.vlm_profile import summarize_trace

    ev = [{"ph": "X", "cat": "kernel", "name": "sm90_gemm_bf16", "ts": 4, "dur": 6},
          {"ph": "X", "cat": "kernel", "name": "flash_fwd", "ts": 5, "dur": 10},         # overlaps: union 11
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 30, "dur": 5},
          {"ph": "X", "cat": "kernel", "name": "rope", "ts": 40, "dur": 10},
          {"ph": "X", "cat": "gpu_user_annotation", "name": "nbgen::vision_tower", "ts": 38, "dur": 7},
          {"ph": "X", "cat": "user_annotation", "name": "nbgen::vision_tower", "ts": 30, "dur": 3},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    s = summarize_trace(str(path), wall_s=100e-6)
    assert s["gpu_busy_s"] == pytest.approx(26e-6) and s["gpu_busy_share"] == pytest.approx(0.26)
    assert s["first_gpu_work_after_s"] == pytest.approx(4e-6)           # first event at 0, first kernel at 4
    assert s["tower_gpu_s"] == pytest.approx(5e-6) and s["tower_forwards"] == 1
    assert s["tower_host_s"] == pytest.approx(3e-6)
    assert s["gpu_s_by_class"] == pytest.approx({"matmul": 6e-6, "attention": 10e-6, "other": 10e-6})
    assert s["top_kernels"][0]["calls"] == 1
