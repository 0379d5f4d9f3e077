"""What generate() needs to let the device make an image processor's patches (``models/vision_pixels.py``).

``pixel_recipe`` reads a Qwen2(.5)-VL processor's value map from its own output: an image holding each byte
value in each channel, run through the processor without resizing, gives the processor's value of every
(channel, byte); the table is kept only where the output is exactly that map laid out as
``patch_layout`` lays it out. The processor's resize (run by its own ``process_image`` and ``resize``
methods on the CPU) followed by the table is then checked against the processor's whole output for a few
images it resizes: where equal (``PixelRecipe.resize``), resized images skip the rest of the processor
too. A processor that fails either check keeps its own path, so patches never differ from its output.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
import torch

from nbgen.models.vision_pixels import PixelRecipe, patch_layout, rgb_patches

Grid = tuple[int, int, int]
_RESIZE_PROBES = [(37, 61), (90, 60), (200, 150)]          # (height, width): sizes the processor resizes


def _table(proc: Any, p: int, m: int, tp: int) -> Optional[torch.Tensor]:
    """[3, 256] fp32: the processor's value of each (channel, byte) (see the module docstring)."""
    from PIL import Image

    side = p * m
    h = side * -(-256 // (side * side))                     # at least 256 pixels, a multiple of the merge side
    v = np.arange(h * side).reshape(h, side, 1) + np.array([0, 85, 170])     # each channel sees all 256 values
    rgb = (v % 256).astype(np.uint8)
    try:
        theirs = proc(images=[Image.fromarray(rgb)], do_resize=False, return_tensors="pt")["pixel_values"].float()
    except Exception:   # noqa: BLE001 - a processor that cannot run this probe keeps its own path
        return None
    mine = patch_layout(torch.from_numpy(rgb)[None], p, tp, m).long()         # [N, D] byte values
    if tuple(theirs.shape) != tuple(mine.shape) or mine.shape[1] % 3:
        return None
    chan = torch.arange(mine.shape[1]) // (mine.shape[1] // 3)                 # columns: channel-major
    key = (chan * 256 + mine).reshape(-1)
    lut = torch.full((3 * 256,), float("nan"))
    lut[key] = theirs.reshape(-1)
    if lut.isnan().any() or not torch.equal(lut[key], theirs.reshape(-1)):
        return None
    return lut.view(3, 256)


def resized_rgb(proc: Any, img: Any, grid: Grid) -> np.ndarray:
    """The RGB bytes [H, W, 3] uint8 of PIL ``img`` resized by ``proc``'s own methods to ``grid``'s size."""
    p, m = int(proc.patch_size), int(proc.merge_size)
    x = proc.process_image(img, do_convert_rgb=True)                           # the backend's [3, h, w] uint8
    y = proc.resize(x, size=proc.size, resample=proc.resample, factor=p * m)
    out = np.ascontiguousarray(np.asarray(y).transpose(1, 2, 0))
    if out.shape != (grid[1] * p, grid[2] * p, 3) or out.dtype != np.uint8:
        raise RuntimeError(f"the image processor resized to {out.shape} {out.dtype}, the prompt was laid out for "
                           f"{grid[1] * p}x{grid[2] * p}")
    return out


def _resizes_exactly(proc: Any, recipe: PixelRecipe) -> bool:
    """True when ``resized_rgb`` + ``recipe`` gives ``proc``'s patches for images it resizes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for h, w in _RESIZE_PROBES:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        try:
            out = proc(images=[img], return_tensors="pt")
            grid = tuple(int(v) for v in out["image_grid_thw"][0].tolist())
            rgb = torch.from_numpy(resized_rgb(proc, img, grid))[None]
        except Exception:   # noqa: BLE001 - methods this processor does not have: its own path
            return False
        if not torch.equal(rgb_patches(rgb, recipe.lut, recipe, torch.float32), out["pixel_values"].float()):
            return False
    return True


def pixel_recipe(proc: Any) -> Optional[PixelRecipe]:
    """``proc``'s PixelRecipe (``resize`` set where its resize checks out), None where it has none."""
    try:
        p, m, tp = int(proc.patch_size), int(proc.merge_size), int(proc.temporal_patch_size)
    except (AttributeError, TypeError, ValueError):
        return None
    lut = _table(proc, p, m, tp)
    if lut is None:
        return None
    recipe = PixelRecipe(lut, p, tp, m)
    return dataclasses.replace(recipe, resize=_resizes_exactly(proc, recipe))
