"""4-bit CPU weights (nbgen.models.cpu_int4): GGUF Q4_1 weights are found on their grid and read by
nbgen's VNNI kernel (or torch's int4 kernel) at decode steps of a few rows; other weights stay bf16 only."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import nbgen
from nbgen.models import cpu_int4
from tests.tiny_models import gguf_round_trip, make_tiny_model, quantized_cpu_run_follows_fp32

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="torch without the CPU int4 kernels")


def _q4_1(w: torch.Tensor) -> torch.Tensor:
    return gguf_round_trip(w, "Q4_1")


def test_q4_1_weight_is_found_and_multiplied() -> None:
    torch.manual_seed(0)
    deq = _q4_1(torch.randn(96, 128) * 0.05)                     # [N, K], on the Q4_1 grid
    q = cpu_int4.from_grid(deq.bfloat16())
    assert q is not None
    if q.nib is not None:                                         # nbgen's nibble layout (cpu_q4.q4_gemv)
        assert q.nib.shape == (96, 64) and q.d.shape == q.m.shape == (96, 128 // 32) and q.packed is None
    else:
        assert q.scale_zeros.shape == (128 // 32, 96, 2)
    # the int4 copy holds the GGUF values (up to bf16 rounding of scale and zero)
    w_back = cpu_int4.int4_linear(torch.eye(128, dtype=torch.bfloat16), q, None).float().t()
    span = deq.abs().amax()
    assert (w_back - deq).abs().max() <= span * 2 ** -7
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    ref = x.float() @ deq.t()
    torch.testing.assert_close(cpu_int4.int4_linear(x, q, None).float(), ref, atol=2e-2 * ref.abs().max(), rtol=0)
    bias = torch.randn(96, dtype=torch.bfloat16)
    torch.testing.assert_close(cpu_int4.int4_linear(x, q, bias).float(), ref + bias.float(),
                               atol=2e-2 * ref.abs().max(), rtol=0)
    assert cpu_int4.use_int4(x, q) and not cpu_int4.use_int4(torch.zeros(cpu_int4.MAX_ROWS + 1, 128,
                                                                             dtype=torch.bfloat16), q)


def test_weights_off_the_grid_stay_bf16() -> None:
    torch.manual_seed(1)
    assert cpu_int4.from_grid(torch.randn(64, 128).bfloat16()) is None
    # a Q4_1 weight with one value moved off its grid
    deq = _q4_1(torch.randn(64, 128))
    deq[5, 17] += (deq[5, :32].amax() - deq[5, :32].amin()) / 40
    assert cpu_int4.from_grid(deq.bfloat16()) is None
    assert cpu_int4.from_grid(torch.randn(64, 100).bfloat16()) is None        # K not a multiple of 32
    assert cpu_int4.from_grid(_q4_1(torch.randn(64, 128))) is None             # fp32 weights


def test_engine_with_q4_weights_decodes_through_int4(tmp_path: Path) -> None:
    path = make_tiny_model("llama", str(tmp_path / "m"))
    sd = load_file(str(tmp_path / "m" / "model.safetensors"))
    proj = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    sd = {k: _q4_1(v) if any(f".{p}." in k for p in proj) else v for k, v in sd.items()}
    save_file(sd, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    quantized_cpu_run_follows_fp32(path, "int4_linears", 4 * 2)     # qkv, o, gate|up, down per layer


def test_engine_with_plain_weights_has_no_int4(tmp_path: Path) -> None:
    path = make_tiny_model("llama", str(tmp_path / "m"))
    with nbgen.Engine(path, device="cpu", dtype="bfloat16") as eng:
        assert eng.get_server_info()["int4_linears"] == 0
