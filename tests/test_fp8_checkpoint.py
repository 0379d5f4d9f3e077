"""FP8 checkpoints on the CPU (nbgen.models.fp8_checkpoint): tiny models whose linear weights the test
quantizes to float8 e4m3 (HF block-wise ``weight_scale_inv``; compressed-tensors per-channel
``weight_scale`` with an ``input_scale``; HF per-tensor) load into fp8 linears holding the checkpoint's
own e4m3 bytes (its scales expanded to 1x128 groups, ``models/fp8_linear.py``), and greedy output equals
HF transformers running the dequantized weights in fp32."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import nbgen
from nbgen.core.config import EngineConfig
from nbgen.models.loader import load_model
from nbgen.models.fp8_scaled import Fp8ScaledWeight
from nbgen.models.fp8_checkpoint import Fp8Format, dequantize, dequantize_stream, fp8_format
from tests.tiny_models import make_tiny_model

F8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, scale) with w ~= weight * scale per block (or per row when block is None)."""
    if block is None:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0          # [out, 1]
        return (w / scale).to(F8), scale
    bo, bi = block
    out, inp = w.shape
    scale = torch.empty((out + bo - 1) // bo, (inp + bi - 1) // bi)
    q = torch.empty_like(w, dtype=F8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (blk / s).to(F8)
    return q, scale


def _fp8_copy(src: str, dst: str, method: str) -> str:
    """``dst``: ``src`` with its decoder linears in float8 (see the module docstring); returns the
    directory of the same model holding the dequantized values in fp32 (the reference)."""
    shutil.copytree(src, dst)
    ref = dst + "_ref"
    shutil.copytree(src, ref)
    sd = load_file(os.path.join(src, "model.safetensors"))
    fp8, deq = {}, {}
    block = (16, 128) if method == "fp8" else None   # "fp8-tensor": HF fp8 with one scale per tensor
    for name, t in sd.items():
        if name.endswith(".weight") and any(f".{p}." in name for p in LINEARS):
            q, s = _quantize(t.float(), block)
            if method == "fp8-tensor":
                s = t.float().abs().max() / 448.0
                q = (t.float() / s).to(F8)
            fp8[name] = q
            if method.startswith("fp8"):
                fp8[name + "_scale_inv"] = s
            else:
                fp8[name + "_scale"] = s
                fp8[name.replace(".weight", ".input_scale")] = torch.tensor([1.0])
            deq[name] = dequantize(q, s, block).to(t.dtype)
        else:
            fp8[name] = deq[name] = t
    if method.startswith("fp8"):   # a KV-cache scale, as fp8 checkpoints with an fp8 KV cache carry
        fp8["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    save_file(fp8, os.path.join(dst, "model.safetensors"))
    save_file(deq, os.path.join(ref, "model.safetensors"))
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 128]}
        if method == "fp8" else
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if method == "fp8-tensor" else
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
                                                                          "strategy": "channel"}}}})
    json.dump(cfg, open(cfg_path, "w"))
    return ref


@pytest.mark.parametrize("method", ["fp8", "fp8-tensor", "compressed-tensors"])
def test_fp8_checkpoint_greedy_equals_hf_on_the_dequantized_weights(tmp_path, method) -> None:
    from transformers import AutoModelForCausalLM

    src = make_tiny_model("llama", str(tmp_path / "base"))
    ref = _fp8_copy(src, str(tmp_path / "fp8"), method)
    prompt = [5, 17, 42, 99, 3, 250]
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    with nbgen.Engine(str(tmp_path / "fp8"), dtype="float32", device="cpu") as eng:
        got = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                              "ignore_eos": True})["output_ids"]
    assert got == want
    # the quantization changed the weights (else this test would not test the dequantization)
    assert not torch.equal(load_file(os.path.join(src, "model.safetensors"))["model.layers.0.mlp.up_proj.weight"],
                           load_file(os.path.join(ref, "model.safetensors"))["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("method", ["fp8", "fp8-tensor", "compressed-tensors"])
def test_fp8_checkpoint_loads_its_own_e4m3_bytes(tmp_path, method) -> None:
    # the checkpoint's linears run as fp8 GEMMs on the stored e4m3 values (no requantization), also
    # inside the fused q|k|v and gate|up projections; quantization="fp8" on the dequantized values
    # picks its own scales, which round block and per-tensor values differently
    src = make_tiny_model("llama", str(tmp_path / "base"))
    ref = _fp8_copy(src, str(tmp_path / "fp8"), method)
    cpu = torch.device("cpu")
    got = load_model(EngineConfig(model_path=str(tmp_path / "fp8"), dtype="bfloat16"), cpu).model
    requant = load_model(EngineConfig(model_path=ref, dtype="float32", quantization="fp8"), cpu).model
    raw = load_file(os.path.join(tmp_path / "fp8", "model.safetensors"))
    layer = got.model.layers[0]
    checked = 0
    for fused, parts in ((layer.self_attn.qkv_proj, {"q_proj": "q", "k_proj": "k", "v_proj": "v"}),
                         (layer.mlp.gate_up_proj, {"gate_proj": 0, "up_proj": 1}),
                         (layer.mlp.down_proj, {"down_proj": None})):
        assert fused.fp8 is not None and fused.weight.dtype == F8
        for part, shard in parts.items():
            kind = "self_attn" if part.endswith(("q_proj", "k_proj", "v_proj")) else "mlp"
            stored = raw[f"model.layers.0.{kind}.{part}.weight"]
            off, size = fused.shard_rows(shard) if shard is not None else (0, stored.shape[0])
            assert torch.equal(fused.fp8.q[off:off + size].view(torch.uint8), stored.view(torch.uint8))
            checked += 1
    assert checked == 6
    # scales constant along each row (per tensor, per channel, blocks as wide as these K): the
    # per-feature form for cuBLAS; per tensor, the fused q|k|v parts keep their three scales per row
    assert all(isinstance(m.fp8, Fp8ScaledWeight) for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
    if method == "fp8-tensor":
        assert layer.mlp.down_proj.fp8.scale is not None and layer.self_attn.qkv_proj.fp8.scale is None
    if method != "compressed-tensors":   # per channel, the stored values already sit on amax / 448's grid
        mine = requant.model.layers[0].mlp.down_proj.fp8.q.view(torch.uint8)
        assert not torch.equal(mine, layer.mlp.down_proj.fp8.q.view(torch.uint8))


def test_block_dequantize_covers_ragged_edges() -> None:
    w = torch.randn(40, 70)
    q, s = _quantize(w, (16, 32))
    assert s.shape == (3, 3)
    d = dequantize(q, s, (16, 32))
    assert d.shape == w.shape and (d - w).abs().max() <= 0.07 * w.abs().max()   # e4m3: 3 mantissa bits


def test_scale_before_weight_and_missing_scale() -> None:
    q, s = _quantize(torch.randn(4, 8), None)
    out = dict(dequantize_stream([("a.weight_scale", s), ("a.weight", q), ("b.bias", torch.ones(2))],
                                 Fp8Format("compressed-tensors")))
    assert torch.equal(out["a.weight"], q.float() * s) and "b.bias" in out
    with pytest.raises(ValueError, match="no scale for"):
        list(dequantize_stream([("a.weight", q)], Fp8Format("fp8", (16, 16))))


def test_unsupported_quantization_is_a_clear_error() -> None:
    class Cfg:
        quantization_config = {"quant_method": "awq", "bits": 4}
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        fp8_format(Cfg())
    assert fp8_format(object()) is None
