"""The vision tower's plans (``models/vision_plan.py``): rotary tables, window order and attention
segments planned once per grid signature and cached (least recently used dropped)."""
from __future__ import annotations

import torch

from nbgen.bench.tiny_vlm import make_tiny_vlm
from nbgen.models.loader import iter_safetensors
from tests.tiny_models import random_image
from nbgen.models.model_config import read_model_config
from nbgen.models.registry import get_model_class, prepare_config


def _model(family: str, tmp_path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    d = make_tiny_vlm(str(tmp_path / family), family)
    cfg = prepare_config(read_model_config(d))
    model = get_model_class(cfg)(cfg)
    model.load_weights(iter_safetensors(d))
    return d, model.to(device, dtype).eval()


def test_plans_are_cached_per_grid_signature(tmp_path):
    _, model = _model("qwen2_5_vl", tmp_path)
    tower, cpu = model.visual, torch.device("cpu")
    a, b = [(1, 4, 6)] * 2, [(1, 8, 8)]
    pa = tower.plan(a, cpu)
    assert tower.plan(list(a), cpu) is pa and tower.plan(b, cpu) is not pa
    for i in range(1, 12):                                 # the least recently used plans are dropped
        tower.plan([(1, 2 * i, 2)], cpu)
    assert tower.plan(a, cpu) is not pa


def test_vision_sdpa_leaves_cudnn_out_on_cuda_only() -> None:
    """cuDNN's attention builds a plan per new shape (each tower batch size): towers run flash on CUDA."""
    from nbgen.models.vision_plan import vision_sdpa

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with vision_sdpa(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with vision_sdpa(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_pixels_per_token_matches_the_processor(tmp_path):
    """The pixel staging's reservation unit: pixel values behind one image token, as the processor lays them out."""
    import transformers as tf

    from nbgen.runtime.vision_step import vision_step_for

    d, model = _model("qwen2_5_vl", tmp_path)
    x = tf.AutoImageProcessor.from_pretrained(d)(images=[random_image(56, 84)], return_tensors="pt")
    per_token = x["pixel_values"].numel() // (int(x["image_grid_thw"].prod()) // model.merge ** 2)
    assert model.pixels_per_token == per_token
    step = vision_step_for(model, torch.device("cpu"), torch.float32, 64)
    assert step is not None and step.staging is None                    # CPU: no pinned staging
    assert vision_step_for(torch.nn.Linear(2, 2), torch.device("cpu"), torch.float32, 64) is None
