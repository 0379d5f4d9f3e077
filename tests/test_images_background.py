"""The image processor's pixel work in the background (``engine_images_background.py``): grids known
ahead from image sizes equal the processor's, for the tiny test processor and the real Qwen2.5-VL-7B
one, across sizes and aspect ratios; the background result is the caller-thread result; a prompt's
ImageInputs carries a Future that ``pixels()`` resolves."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from nbgen.bench.tiny_vlm import make_tiny_vlm
from nbgen.engine_images import ImagePrep
from nbgen.engine_images_background import BackgroundPixels, grids_ahead
from nbgen.models.model_config import read_model_config
from nbgen.models.registry import prepare_config
from nbgen.models.vision_pixels import rgb_patches
from tests.tiny_models import QWEN25_VL_7B_CONFIG, random_image

SIZES = [(448, 448), (60, 90), (120, 40), (1000, 37), (29, 29), (333, 517), (3000, 2000)]


@pytest.mark.parametrize("where", ["tiny", "7b"])
def test_grids_ahead_are_the_processors(where, tmp_path):
    import transformers as tf

    d = make_tiny_vlm(str(tmp_path), "qwen2_5_vl") if where == "tiny" else QWEN25_VL_7B_CONFIG
    proc = tf.AutoImageProcessor.from_pretrained(d)
    sizes = SIZES if where == "tiny" else SIZES[:6]         # the 7B rule keeps 3000x2000 large: slow
    ims = [random_image(h, w, i) for i, (h, w) in enumerate(sizes)]
    got = grids_ahead(proc, ims)
    assert got is not None
    want = [tuple(int(v) for v in g) for g in proc(images=ims, return_tensors="pt")["image_grid_thw"].tolist()]
    assert got == want


def test_background_pixels_equal_the_callers(tmp_path):
    import transformers as tf

    d = make_tiny_vlm(str(tmp_path), "qwen2_vl")
    proc = tf.AutoImageProcessor.from_pretrained(d)
    ims = [random_image(60, 90), random_image(120, 40, 1)]
    fut = BackgroundPixels().submit(proc, ims, grids_ahead(proc, ims))
    assert torch.equal(fut.result(), proc(images=ims, return_tensors="pt")["pixel_values"])
    with pytest.raises(RuntimeError, match="laid out"):                  # a grid mismatch is not silent
        BackgroundPixels().submit(proc, ims, [(1, 2, 2), (1, 2, 2)]).result()


def test_prompt_inputs_carry_pending_pixels(tmp_path):
    d = make_tiny_vlm(str(tmp_path), "qwen2_vl")
    cfg = prepare_config(read_model_config(d))
    prep = ImagePrep(cfg, d)
    ids, inputs = prep.expand([[5, 6, 7]], [[random_image(60, 90)]])
    inp = inputs[0]
    assert isinstance(inp.pixel_values, Future)
    want = prep.processor(images=[random_image(60, 90)], return_tensors="pt")["pixel_values"]
    raw = inp.pixels()                                                   # resized RGB bytes (RawImages)
    got = rgb_patches(torch.from_numpy(raw.rgb[0])[None], raw.recipe.lut, raw.recipe, torch.float32)
    assert torch.equal(got, want) and inp.num_tokens == inp.grids[0][1] * inp.grids[0][2] // 4


def test_held_pixel_jobs_start_when_the_layout_ends(tmp_path):
    """Jobs submitted while a layout holds the pool wait (nested holds: until the outer one ends), then run
    in order with the same results as unheld ones."""
    import transformers as tf

    d = make_tiny_vlm(str(tmp_path), "qwen2_vl")
    proc = tf.AutoImageProcessor.from_pretrained(d)
    ims = [[random_image(60, 90, i)] for i in range(3)]
    bg = BackgroundPixels()
    with bg.held():
        with bg.held():
            futs = [bg.submit(proc, im, grids_ahead(proc, im)) for im in ims]
        assert bg.held_jobs == 3 and not any(f.running() or f.done() for f in futs)
    assert bg.held_jobs == 0
    for f, im in zip(futs, ims):
        assert torch.equal(f.result(), proc(images=im, return_tensors="pt")["pixel_values"])
    assert isinstance(bg.submit(proc, ims[0], grids_ahead(proc, ims[0])), Future)
