"""Pixel patches from RGB bytes on the device (``models/vision_pixels.py``): the recipe read from the
processor reproduces its patches bit for bit for images it keeps at their size (tiny and real
Qwen2.5-VL-7B processors); prompts of such images carry RawImages, others the processor's patches;
a step's pixels in request order whatever the mix of kinds and sizes."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from nbgen.bench.tiny_vlm import make_tiny_vlm
from nbgen.engine_images import ImagePrep
from nbgen.engine_images_background import BackgroundPixels
from nbgen.engine_images_device import pixel_recipe, resized_rgb
from nbgen.models.model_config import read_model_config
from nbgen.models.registry import prepare_config
from nbgen.models.vision_pixels import RawImages, patch_layout, rgb_patches
from nbgen.runtime.vision_step import VisionStep
from tests.tiny_models import QWEN25_VL_7B_CONFIG, random_image



@pytest.mark.parametrize("where", ["tiny", "7b"])
def test_recipe_reproduces_the_processor(where, tmp_path):
    import transformers as tf

    d = make_tiny_vlm(str(tmp_path), "qwen2_5_vl") if where == "tiny" else QWEN25_VL_7B_CONFIG
    proc = tf.AutoImageProcessor.from_pretrained(d)
    recipe = pixel_recipe(proc)
    assert recipe is not None and recipe.lut.shape == (3, 256)
    sizes = [(56, 56), (28, 84), (84, 56)] if where == "tiny" else [(448, 448), (224, 336)]
    for i, (h, w) in enumerate(sizes):
        img = random_image(h, w, i)
        want = proc(images=[img], return_tensors="pt")["pixel_values"]
        got = rgb_patches(torch.from_numpy(np.array(img))[None], recipe.lut, recipe, torch.float32)
        assert torch.equal(got, want), (h, w)
        bf16 = rgb_patches(torch.from_numpy(np.array(img))[None], recipe.lut, recipe, torch.bfloat16)
        assert torch.equal(bf16, want.to(torch.bfloat16))                 # one rounding, as the cast


def test_patch_layout_is_the_processors(tmp_path):
    """Distinct values through ``patch_layout`` and through the processor's own patchify: the same places."""
    import transformers as tf

    proc = tf.AutoImageProcessor.from_pretrained(make_tiny_vlm(str(tmp_path), "qwen2_vl"))
    if not hasattr(proc, "patchify"):
        pytest.skip("this processor backend has no patchify method")
    x = torch.arange(56 * 84 * 3, dtype=torch.float32).view(1, 56, 84, 3)            # [B, H, W, C]
    want, gh, gw = proc.patchify(x[0].permute(2, 0, 1).numpy(), patch_size=14, merge_size=2, temporal_patch_size=2)
    assert (gh, gw) == (4, 6)
    assert torch.equal(patch_layout(x, 14, 2, 2), torch.from_numpy(np.ascontiguousarray(want)))


def test_recipe_refuses_a_processor_it_cannot_read():
    class NotAProcessor:
        patch_size, merge_size, temporal_patch_size = 14, 2, 2

        def __call__(self, **kw):
            return {"pixel_values": torch.randn(4, 3 * 2 * 14 * 14)}           # not a map of the bytes

    assert pixel_recipe(NotAProcessor()) is None
    assert pixel_recipe(object()) is None


@pytest.mark.parametrize("where", ["tiny", "7b"])
def test_resized_images_reproduce_the_processor(where, tmp_path):
    """The processor's own resize on the CPU, then the table on the device: its patches bit for bit, for
    sizes it scales up, down and to other aspect ratios."""
    import transformers as tf

    d = make_tiny_vlm(str(tmp_path), "qwen2_vl") if where == "tiny" else QWEN25_VL_7B_CONFIG
    proc = tf.AutoImageProcessor.from_pretrained(d)
    recipe = pixel_recipe(proc)
    assert recipe is not None and recipe.resize
    sizes = [(60, 90), (120, 40), (1000, 37), (29, 29), (333, 517)] if where == "tiny" else [(333, 517), (60, 90)]
    for i, (h, w) in enumerate(sizes):
        img = random_image(h, w, i)
        out = proc(images=[img], return_tensors="pt")
        grid = tuple(int(v) for v in out["image_grid_thw"][0].tolist())
        rgb = torch.from_numpy(resized_rgb(proc, img, grid))[None]
        assert torch.equal(rgb_patches(rgb, recipe.lut, recipe, torch.float32), out["pixel_values"]), (h, w)


def test_a_resize_that_differs_keeps_the_processor(tmp_path):
    """A processor whose resize the check cannot reproduce: the table is kept, resized images go through
    the processor."""
    import transformers as tf

    class OtherResize:                     # the processor, but its resize method unlike its own pipeline's
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def __call__(self, **kw):
            return self.real(**kw)

        def resize(self, x, size, resample, factor):
            return self.real.resize(x, size=size, resample=0, factor=factor)          # nearest

    proc = OtherResize(tf.AutoImageProcessor.from_pretrained(make_tiny_vlm(str(tmp_path), "qwen2_vl")))
    recipe = pixel_recipe(proc)
    assert recipe is not None and not recipe.resize
    prep_pixels = BackgroundPixels().submit(proc, [random_image(60, 90)], [(1, 4, 6)], None).result()
    assert isinstance(prep_pixels, torch.Tensor)


def test_prompts_carry_raw_images_where_the_processor_keeps_the_size(tmp_path):
    d = make_tiny_vlm(str(tmp_path), "qwen2_vl")
    prep = ImagePrep(prepare_config(read_model_config(d)), d)
    _, inputs = prep.expand([[5, 6], [7], [8]], [[random_image(56, 56)], [random_image(60, 90)], [random_image(28, 84), random_image(60, 90)]])
    assert isinstance(inputs[0].pixel_values, RawImages)
    assert isinstance(inputs[1].pixel_values, Future) and isinstance(inputs[2].pixel_values, Future)
    same, other = prep.expand([[1], [1]], [[random_image(56, 56)], [random_image(56, 56, 1)]])[1]
    assert same.hashes == inputs[0].hashes and other.hashes != same.hashes
    assert np.array_equal(same.pixels().rgb[0], np.asarray(random_image(56, 56)))


def test_step_pixels_keep_request_order_across_kinds(tmp_path):
    """A step's pixels: runs of raw images of one size, processor patches, raw images of another size
    -> the processor's patches of all of them, in order."""
    import transformers as tf

    d = make_tiny_vlm(str(tmp_path), "qwen2_5_vl")
    proc = tf.AutoImageProcessor.from_pretrained(d)
    recipe = pixel_recipe(proc)
    ims = [random_image(56, 56, 0), random_image(56, 56, 1), random_image(60, 90, 2), random_image(28, 84, 3), random_image(56, 56, 4)]
    raw = [np.asarray(im) for im in ims]
    parts = [RawImages(raw[:2], recipe), proc(images=[ims[2]], return_tensors="pt")["pixel_values"],
             RawImages(raw[3:], recipe)]
    step = VisionStep(torch.nn.Identity(), torch.device("cpu"), torch.float32)
    got = step._pixels(parts)
    want = torch.cat([proc(images=[im], return_tensors="pt")["pixel_values"] for im in ims])
    assert torch.equal(got, want)


def test_submit_in_order_chunks_at_pending_ids():
    """Requests go in order; a chunk of at least SUBMIT_CHUNK goes when the next request's ids are still
    computed; each request's slots get its ids before it goes; a failure aborts what went."""
    import threading
    from concurrent.futures import Future

    from nbgen.core.multimodal import SUBMIT_CHUNK, ImageInputs, submit_in_order

    class Req:
        def __init__(self, i: int, fut):
            self.rid, self.prompt_ids = f"r{i}", [1, 7, 7, 2]
            self.images = ImageInputs(None, [(1, 2, 2)], [(1, 3)], [], [], None, 0, pending=fut)

    n = 2 * SUBMIT_CHUNK + 5
    futs = [Future() for _ in range(n)]
    reqs = [Req(i, f) for i, f in enumerate(futs)]
    for f in futs[:SUBMIT_CHUNK + 1]:
        f.set_result((["h"], [900]))
    sent: list[list[str]] = []

    def submit(chunk):
        sent.append([r.rid for r in chunk])
        assert all(r.prompt_ids == [1, 900, 900, 2] and r.images.pending is None for r in chunk)
        if len(sent) == 1:                               # the rest become ready after the first chunk went
            threading.Timer(0.01, lambda: [f.set_result((["h"], [900])) for f in futs[SUBMIT_CHUNK + 1:]]).start()

    submit_in_order(reqs, submit, lambda rids: None)
    assert sent[0] == [f"r{i}" for i in range(SUBMIT_CHUNK + 1)]
    assert sum(sent, []) == [r.rid for r in reqs]

    bad = [Req(i, Future()) for i in range(SUBMIT_CHUNK + 2)]
    for r in bad[:SUBMIT_CHUNK]:
        r.images.pending.set_result((["h"], [900]))
    late = bad[SUBMIT_CHUNK].images.pending
    aborted: list[str] = []
    with pytest.raises(RuntimeError, match="hash failed"):               # fails after the first chunk went
        submit_in_order(bad, lambda chunk: late.set_exception(RuntimeError("hash failed")), aborted.extend)
    assert aborted == [r.rid for r in bad[:SUBMIT_CHUNK]]


def test_pixel_bytes_view_pillow_memory_or_copy(monkeypatch):
    """An image's pixels without a copy where Pillow exports its memory, through ``tobytes`` otherwise: the
    same [H, W, 3] values either way, and images of equal content hash equal."""
    import pyarrow as pa

    from nbgen.engine_images_ids import image_ids, pixel_bytes

    img = random_image(60, 90, 5).convert("RGB")
    buf, view = pixel_bytes(img)
    assert np.array_equal(view, np.asarray(img)) and view.shape == (60, 90, 3)
    twin = random_image(60, 90, 5).convert("RGB")
    assert image_ids([img], [(1, 4, 6)], 1000, None)[0] == image_ids([twin], [(1, 4, 6)], 1000, None)[0]
    assert image_ids([img], [(1, 4, 6)], 1000, None)[0] != image_ids([random_image(60, 90, 6)], [(1, 4, 6)], 1000, None)[0]

    def refuse(*a, **kw):
        raise pa.ArrowInvalid("no export")

    monkeypatch.setattr(pa, "array", refuse)
    buf2, view2 = pixel_bytes(img)
    assert isinstance(buf2, bytes) and np.array_equal(view2, view)
