"""Qwen2-VL / Qwen2.5-VL on the GPU (skipped without CUDA): decode graphs and overlap (rope_delta in the
staged positions) against eager steps, bf16 CUDA against fp32 CPU, the vision tower in bf16 against HF."""
from __future__ import annotations

import pytest
import torch

from nbgen.bench.tiny_vlm import make_tiny_vlm
from tests.tiny_models import assert_close_runs, random_images, vlm_image_run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def gpu_vlm(request, tmp_path_factory) -> str:
    """head_dim 64 (flashinfer's sizes), mrope_section summing to 32."""
    return make_tiny_vlm(str(tmp_path_factory.mktemp(request.param)), request.param, hidden_size=256,
                         intermediate_size=512, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})


def test_graphs_and_overlap_match_eager_steps(gpu_vlm):
    fast = vlm_image_run(gpu_vlm, "cuda", "bfloat16", cuda_graph_max_bs=16)
    eager = vlm_image_run(gpu_vlm, "cuda", "bfloat16", disable_cuda_graph=True, disable_overlap_schedule=True)
    assert_close_runs(fast, eager)


def test_cuda_bf16_follows_cpu_fp32(gpu_vlm):
    gpu = vlm_image_run(gpu_vlm, "cuda", "bfloat16")
    cpu = vlm_image_run(gpu_vlm, "cpu", "float32")
    assert_close_runs(gpu, cpu)


def test_vision_tower_bf16_cuda_close_to_hf(gpu_vlm):
    import transformers as tf

    from nbgen.models.loader import iter_safetensors
    from nbgen.models.model_config import read_model_config
    from nbgen.models.registry import get_model_class, prepare_config

    hf = tf.AutoModelForImageTextToText.from_pretrained(gpu_vlm, dtype=torch.float32).eval()
    x = tf.AutoImageProcessor.from_pretrained(gpu_vlm)(images=random_images(4), return_tensors="pt")
    cfg = prepare_config(read_model_config(gpu_vlm))
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(iter_safetensors(gpu_vlm))
    ours = ours.to("cuda", torch.bfloat16)
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(x["pixel_values"], x["image_grid_thw"]).pooler_output)
        got = ours.encode_images(x["pixel_values"].cuda(), [tuple(g) for g in x["image_grid_thw"].tolist()])
    err = (got.float().cpu() - ref).abs().max().item()
    assert err <= 3e-2 * ref.abs().max().item(), err


def test_pixel_staging_reuses_pinned_buffers():
    """A step's pixels through the two reserved pinned buffers: the values the GPU cast gives, the buffers
    kept across steps (grown only for a larger step), any row shape."""
    from nbgen.runtime.vision_step import PixelStaging

    for dtype in (torch.bfloat16, torch.float32):
        st = PixelStaging(torch.device("cuda"), reserve_bytes=6 * 10 * dtype.itemsize)
        first = list(st.bufs)
        for rows in ([2, 3], [1], [4, 1], [3, 3]):               # the last one (60 elements) still fits
            parts = [torch.randn(r, 10) for r in rows]
            got = st.to_device(parts, dtype)
            assert got.dtype == dtype and torch.equal(got, torch.cat(parts).cuda().to(dtype))
        assert st.bufs[0] is first[0] and st.bufs[1] is first[1]
        big = [torch.randn(9, 10), torch.randn(2, 10)]
        assert torch.equal(st.to_device(big, dtype), torch.cat(big).cuda().to(dtype))
        assert st.bufs[0] is not first[0] or st.bufs[1] is not first[1]
        llava = [torch.randn(2, 3, 4, 4)]                        # [N, C, S, S] images
        assert torch.equal(st.to_device(llava, dtype), llava[0].cuda().to(dtype))
        rgb = [torch.randint(0, 256, (1, 8, 6, 3), dtype=torch.uint8) for _ in range(3)]
        assert torch.equal(st.to_device(rgb, torch.uint8), torch.cat(rgb).cuda())
        views = [t.numpy() for t in rgb]                         # RawImages' bytes: numpy views
        assert torch.equal(st.to_device(views, torch.uint8), torch.cat(rgb).cuda())


def test_rgb_patches_on_cuda_equal_the_processors(gpu_vlm):
    """RGB bytes staged through pinned memory and made patches on the GPU: the processor's patches in bf16."""
    import numpy as np
    import transformers as tf

    from nbgen.engine_images_device import pixel_recipe
    from nbgen.models.vision_pixels import RawImages
    from nbgen.runtime.vision_step import VisionStep

    proc = tf.AutoImageProcessor.from_pretrained(gpu_vlm)
    recipe = pixel_recipe(proc)
    ims = [im for im in random_images(8) if im.size in ((56, 56), (112, 112))]
    step = VisionStep(torch.nn.Identity(), torch.device("cuda"), torch.bfloat16, reserve_pixels=1 << 16)
    got = step._pixels([RawImages([np.asarray(im)], recipe) for im in ims])
    want = torch.cat([proc(images=[im], return_tensors="pt")["pixel_values"] for im in ims])
    assert torch.equal(got.cpu(), want.to(torch.bfloat16))
