"""LLaVA-1.5 and LLaVA-NeXT on the GPU (skipped without CUDA): decode graphs and overlap against eager steps, bf16 CUDA
against fp32 CPU, tower + projector in bf16 against HF."""
from __future__ import annotations

import pytest
import torch

from nbgen.bench.tiny_vlm import make_tiny_llava
from tests.tiny_models import assert_close_runs, random_images, vlm_image_run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["llama", "qwen2", "next_llama"])
def gpu_llava(request, tmp_path_factory) -> str:
    """head_dim 64 (flashinfer's sizes); ``next_*``: LLaVA-NeXT."""
    return make_tiny_llava(str(tmp_path_factory.mktemp(f"llava_{request.param}")), request.param.replace("next_", ""),
                           anyres=request.param.startswith("next_"), hidden_size=256, intermediate_size=512)


def test_graphs_and_overlap_match_eager_steps(gpu_llava):
    fast = vlm_image_run(gpu_llava, "cuda", "bfloat16", cuda_graph_max_bs=16)
    eager = vlm_image_run(gpu_llava, "cuda", "bfloat16", disable_cuda_graph=True, disable_overlap_schedule=True)
    assert_close_runs(fast, eager)


def test_cuda_bf16_follows_cpu_fp32(gpu_llava):
    gpu = vlm_image_run(gpu_llava, "cuda", "bfloat16")
    cpu = vlm_image_run(gpu_llava, "cpu", "float32")
    assert_close_runs(gpu, cpu)


def test_tower_bf16_cuda_close_to_hf(gpu_llava):
    import transformers as tf

    from nbgen.models.loader import iter_safetensors
    from nbgen.models.model_config import read_model_config
    from nbgen.models.registry import get_model_class, prepare_config

    from nbgen.models.llava_next import next_layout

    hf = tf.AutoModelForImageTextToText.from_pretrained(gpu_llava, dtype=torch.float32).eval()
    x = tf.AutoImageProcessor.from_pretrained(gpu_llava)(images=random_images(4), return_tensors="pt")
    cfg = prepare_config(read_model_config(gpu_llava))
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(iter_safetensors(gpu_llava))
    ours = ours.to("cuda", torch.bfloat16)
    pv, grids, kw = x["pixel_values"], [(1, 1, 16)] * 4, {}
    if "image_sizes" in x:                     # NeXT: the processor pads every image to the most tiles
        lays = [next_layout(cfg, h, w) for h, w in x["image_sizes"].tolist()]
        pv = torch.cat([p[:lay.num_tiles] for p, lay in zip(pv, lays)])
        grids = [(lay.num_tiles, h, w) for lay, (h, w) in zip(lays, x["image_sizes"].tolist())]
        kw = {"image_sizes": x["image_sizes"]}
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(x["pixel_values"], **kw).pooler_output)
        got = ours.encode_images(pv.cuda(), grids)
    err = (got.float().cpu() - ref).abs().max().item()
    assert err <= 3e-2 * ref.abs().max().item(), err
