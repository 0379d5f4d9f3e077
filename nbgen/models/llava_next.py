"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``, "anyres"): LLaVA-1.5's tower, projector and decoder
(``models/llava.py``) over several tiles per image. The image processor picks the grid resolution of
``image_grid_pinpoints`` that best fits the image, cuts it into tower-sized tiles and adds a resized
whole-image tile first. An image's slots: the whole-image tile's patches, then the tiles' patches laid
out as one feature map, cropped to the image's aspect ratio (the letterbox padding removed), each row
ended by the learned ``image_newline`` vector. ``next_layout`` gives that shape to both the engine's
token count and the model's packing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from nbgen.models.llava import LlavaForConditionalGeneration, flatten_llava_config
from nbgen.models.model_config import ModelConfig

LLAVA_NEXT_MODEL_TYPES = ("llava_next",)


@dataclass(frozen=True)
class NextLayout:
    """One image's anyres shape, in tower patches."""

    tiles_h: int          # grid tiles down and across (the whole-image tile not counted)
    tiles_w: int
    side: int             # patches along a tile's side
    rows: tuple[int, int]  # kept [start, end) of the tiles' feature-map rows and columns
    cols: tuple[int, int]

    @property
    def num_tiles(self) -> int:
        """Tower inputs of the image: the whole-image tile plus the grid."""
        return 1 + self.tiles_h * self.tiles_w

    @property
    def num_tokens(self) -> int:
        """Slots of the image: whole-image patches, kept feature map, one newline per kept row."""
        h, w = self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]
        return self.side * self.side + h * (w + 1)


def best_resolution(h: int, w: int, pinpoints: list[list[int]]) -> tuple[int, int]:
    """The (height, width) of ``pinpoints`` that keeps most of an h x w image and wastes least (as HF)."""
    best, most, waste = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        if kept > most or (kept == most and ph * pw - kept < waste):
            best, most, waste = (ph, pw), kept, ph * pw - kept
    return best


def next_layout(config: Any, h: int, w: int) -> NextLayout:
    """The anyres layout of an original h x w image for a flattened LLaVA-NeXT config."""
    v = config.vision_config
    side = v.image_size // v.patch_size
    bh, bw = best_resolution(h, w, config.image_grid_pinpoints)
    th, tw = bh // v.image_size, bw // v.image_size
    cur_h, cur_w = th * side, tw * side
    rows, cols = (0, cur_h), (0, cur_w)
    if w / h > cur_w / cur_h:              # wider than the grid: padding above and below
        pad = (cur_h - int(round(h * (cur_w / w), 7))) // 2
        rows = (pad, cur_h - pad)
    else:
        pad = (cur_w - int(round(w * (cur_h / h), 7))) // 2
        cols = (pad, cur_w - pad)
    return NextLayout(th, tw, side, rows, cols)


def flatten_llava_next_config(hf: Any) -> ModelConfig:
    """LlavaNextConfig -> the flat LLaVA config plus ``image_grid_pinpoints``."""
    cfg = flatten_llava_config(hf)
    if cfg.vision_feature_select_strategy != "default":
        raise ValueError("LLaVA-NeXT needs vision_feature_select_strategy='default' (the tiles' patch grid)")
    cfg.image_grid_pinpoints = [list(p) for p in hf.image_grid_pinpoints]
    return cfg


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA plus ``image_newline`` and the anyres packing; ``grids`` are (tiles, height, width) per image."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.image_newline = nn.Parameter(torch.zeros(config.hidden_size))

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Tiles of several images [sum tiles, C, S, S], grids (tiles, orig h, orig w) -> slots [N, H]."""
        feats = self.multi_modal_projector(self.vision_tower(pixel_values)[:, 1:])     # [tiles, side^2, H]
        out = []
        for f, (n, h, w) in zip(feats.split([g[0] for g in grids]), grids):
            lay = next_layout(self.config, h, w)
            s, d = lay.side, f.shape[-1]
            grid = f[1:].view(lay.tiles_h, lay.tiles_w, s, s, d).permute(4, 0, 2, 1, 3)
            grid = grid.reshape(d, lay.tiles_h * s, lay.tiles_w * s)                   # [H, rows, cols]
            grid = grid[:, lay.rows[0]:lay.rows[1], lay.cols[0]:lay.cols[1]]
            nl = self.image_newline.to(grid.dtype)[:, None, None].expand(d, grid.shape[1], 1)
            grid = torch.cat([grid, nl], dim=2).flatten(1, 2).t()                        # [rows * (cols+1), H]
            out += [f[0], grid]
        return torch.cat(out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], require_head: bool = True) -> set[str]:
        """LLaVA's names plus ``image_newline`` (``model.image_newline`` in transformers 5)."""
        got: list[bool] = []

        def rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name in ("model.image_newline", "image_newline"):
                    with torch.no_grad():
                        self.image_newline.copy_(t)
                    got.append(True)
                else:
                    yield name, t

        loaded = super().load_weights(rest(), require_head)
        if not got:
            raise ValueError("checkpoint lacks image_newline (a LLaVA-NeXT checkpoint has it)")
        return loaded | {"image_newline"}

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        super()._check_complete({k: v for k, v in params.items() if k != "image_newline"}, loaded)
