"""Qwen2(.5)-VL pixel patches computed on the device from an image's RGB bytes.

The HF image processor rescales and normalises every pixel value on its own (an elementwise map of the
256 values of each channel), then cuts the image into patches (merge blocks of patch x patch squares,
each repeated over ``temporal_patch_size`` frames). So from an image's uint8 RGB bytes at the processor's
size (as given, or after the processor's own resize on the host) the same patches follow on the device:
a per-channel table of the 256 values (``lut``, taken from the processor's own output, see
``engine_images_device.py``) and a permutation. The host copies a quarter of the bytes the bf16 patches
take and runs none of the processor's per-pixel Python.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class PixelRecipe:
    """How a processor turns RGB bytes into patches (its value map and its patch layout); compared and
    hashed by identity (one per processor)."""

    lut: torch.Tensor          # [3, 256] fp32: channel c's processed value of byte v (CPU)
    patch: int                 # patch side in pixels
    temporal: int              # frames per patch (a still image is repeated)
    merge: int                 # merge side in patches
    resize: bool = False       # the processor's own resize, then this table, gives its output (checked)


@dataclass
class RawImages:
    """A prompt's images as RGB bytes, for ``rgb_patches`` on the device."""

    rgb: list[np.ndarray]      # per image [H, W, 3] uint8 (any strides: a view of its bytes or of
                               # Pillow's RGBX memory), H and W multiples of patch * merge
    recipe: PixelRecipe


def patch_layout(rgb: torch.Tensor, patch: int, temporal: int, merge: int) -> torch.Tensor:
    """[B, H, W, C] -> [B * gh * gw, C * temporal * patch * patch] in the processor's patch order (rows:
    merge blocks row-major, the merge x merge patches of a block consecutive; columns: channel, frame,
    row, column). Any dtype; one copy."""
    B, H, W, C = rgb.shape
    gh, gw = H // patch, W // patch
    x = rgb.view(B, gh // merge, merge, patch, gw // merge, merge, patch, C)
    # (B, gh/m, gw/m, m, m, C, p, p): block row, block column, row in block, column in block, channel, pixel
    x = x.permute(0, 1, 4, 2, 5, 7, 3, 6)
    x = x.unsqueeze(6).expand(*x.shape[:6], temporal, patch, patch)           # the still frame repeated
    return x.reshape(B * gh * gw, C * temporal * patch * patch)


def rgb_patches(rgb: torch.Tensor, lut: torch.Tensor, recipe: PixelRecipe, dtype: torch.dtype) -> torch.Tensor:
    """Images of one size, [B, H, W, 3] uint8 -> their patches [B * gh * gw, D] in ``dtype`` (the
    processor's fp32 values, rounded once: the table is rounded, then read); ``lut``: ``recipe.lut``
    on ``rgb``'s device."""
    rows = torch.arange(0, 3 * 256, 256, dtype=torch.int32, device=rgb.device)   # channel c reads row c
    vals = lut.to(dtype).view(-1)[rgb.int() + rows]                           # [B, H, W, 3]; int32: half the bytes
    return patch_layout(vals, recipe.patch, recipe.temporal, recipe.merge)
