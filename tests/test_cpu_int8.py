"""8-bit LM head on the CPU (nbgen.models.cpu_int8): a tied output matrix on GGUF's Q8_0 grid is found and
read by the C GEMV at decode steps of a few rows; bf16 weights keep the bf16 head."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nbgen.kernels import cpu_ops
from nbgen.models import cpu_int8
from tests.tiny_models import gguf_round_trip, make_tiny_model, quantized_cpu_run_follows_fp32

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler: the kernels are not built")


def _q8_0(w: torch.Tensor) -> torch.Tensor:
    return gguf_round_trip(w, "Q8_0")


def test_q8_0_weight_is_found_and_multiplied() -> None:
    torch.manual_seed(0)
    deq = _q8_0(torch.randn(200, 96) * 0.05)
    q = cpu_int8.from_grid(deq.bfloat16())
    assert q is not None and q.q.shape == (200, 96) and q.scales.shape == (200, 3)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    ref = x.float() @ deq.t()                          # the GGUF's own values, fp32
    torch.testing.assert_close(cpu_int8.int8_linear(x, q).float(), ref, atol=1e-2 * ref.abs().max(), rtol=0)
    assert cpu_int8.use_int8(x, q) and not cpu_int8.use_int8(torch.zeros(cpu_int8.MAX_ROWS + 1, 96,
                                                                           dtype=torch.bfloat16), q)
    assert cpu_int8.from_grid(torch.randn(200, 96).bfloat16()) is None       # never quantized
    assert cpu_int8.from_grid(deq) is None                                    # fp32 weights
    assert cpu_int8.from_grid(torch.randn(20, 100).bfloat16()) is None        # K not a multiple of 32


def test_engine_with_a_q8_0_head_decodes_through_int8(tmp_path: Path) -> None:
    path = make_tiny_model("llama", str(tmp_path / "m"), tie_word_embeddings=True)
    sd = load_file(str(tmp_path / "m" / "model.safetensors"))
    sd = {k: _q8_0(v) if k == "model.embed_tokens.weight" else v for k, v in sd.items()}
    save_file(sd, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    quantized_cpu_run_follows_fp32(path, "int8_linears", 1)          # the tied head
