"""generate()'s ``image_data`` for LLaVA (``models/llava.py``) and LLaVA-NeXT (``models/llava_next.py``):
each image through the checkpoint's image processor (LLaVA: resized and cropped to the tower's square size;
NeXT: the whole image plus its anyres tiles), its ``<image>`` placeholder expanded to one slot per image
token (LLaVA: ``image_tokens_per_image``; NeXT: ``next_layout(...).num_tokens``, which depends on the
image's size), the slots filled with content-hash ids as for Qwen2-VL (``engine_images.py``); positions
stay 1-D.

A placeholder is a single ``image_token_index`` token (what a chat template writes) or a run already
expanded by the HF processor (the images' slots back to back). A prompt without any gets one ``<image>``
token per image prepended.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch

from nbgen.core.multimodal import ImageInputs
from nbgen.engine_images import ImagePrep, checkpoint_image_processor, image_prep_for, load_image
from nbgen.models.llava import image_tokens_per_image
from nbgen.models.llava_next import next_layout

LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")
_HASH_SPACE = 1 << 30


class LlavaImagePrep(ImagePrep):
    """LLaVA's image facts and CLIP image processor (loaded on first use) for ``image_data``."""

    def __init__(self, hf_config: Any, model_dir: str) -> None:
        self.model_dir = model_dir
        self.vocab_size = int(hf_config.vocab_size)
        self.image_token_id = int(hf_config.image_token_id)
        self.size = int(hf_config.vision_config.image_size)
        self.per_image = image_tokens_per_image(hf_config)
        self._processor: Optional[Any] = None

    @property
    def processor(self) -> Any:
        """The checkpoint's image processor; without one, CLIP's (PIL backend) at the tower's size."""
        if self._processor is None:
            self._processor = checkpoint_image_processor(
                self.model_dir, "CLIPImageProcessorPil",
                {"size": {"shortest_edge": self.size}, "crop_size": {"height": self.size, "width": self.size}})
        return self._processor

    def _pixels(self, images: list[Any], idx: int) -> tuple[Any, list[tuple[int, int, int]], list[bytes]]:
        """(pixels [N, C, S, S], one (1, 1, slots) grid per image, one identity per image)."""
        pil = self._load(images, idx)
        pv = self.processor(images=pil, return_tensors="pt")["pixel_values"]
        if tuple(pv.shape[-2:]) != (self.size, self.size):
            raise ValueError(f"the image processor gives {tuple(pv.shape[-2:])} pixels; the vision tower takes "
                             f"{self.size}x{self.size} (its crop_size must match vision_config.image_size)")
        return pv, [(1, 1, self.per_image)] * len(pil), self._idents(pil)

    def _load(self, images: list[Any], idx: int) -> list[Any]:
        where = f"image_data[{idx}]"
        if any(isinstance(im, dict) for im in images):
            raise ValueError(f"{where}: processor_output dicts are supported for Qwen2-VL only; pass images to LLaVA")
        return [load_image(im, where + (f"[{j}]" if len(images) > 1 else "")) for j, im in enumerate(images)]

    def _idents(self, pil: list[Any]) -> list[bytes]:
        return [img.tobytes() + str(img.size).encode() for img in pil]

    def slots(self, grid: tuple[int, int, int]) -> int:
        """Slots of one image given its grid (LLaVA-1.5: the same for every image)."""
        return self.per_image

    def _placeholders(self, ids: list[int], counts: list[int], idx: int) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, one [start, end) per image placeholder): single tokens, or runs holding the next images'
        slots back to back (HF's expanded form)."""
        if self.image_token_id not in ids:
            ids = [self.image_token_id] * len(counts) + ids
            return ids, [(i, i + 1) for i in range(len(counts))]
        out, i, k = [], 0, 0
        while i < len(ids):
            if ids[i] != self.image_token_id:
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] == self.image_token_id:
                j += 1
            if j - i == 1:
                out.append((i, j))
                k += 1
            else:
                a = i
                while k < len(counts) and a + counts[k] <= j:
                    out.append((a, a + counts[k]))
                    a, k = a + counts[k], k + 1
                if a != j:
                    raise ValueError(f"prompt[{idx}] has a run of {j - i} image tokens that does not match its "
                                     f"images' slot counts {counts}: use one <image> token per image")
            i = j
        return ids, out

    def _inputs(self, ids: list[int], images: list[Any], idx: int) -> tuple[list[int], ImageInputs, None]:
        pv, grids, idents = self._pixels(images, idx)
        counts = [self.slots(g) for g in grids]
        ids, runs = self._placeholders(ids, counts, idx)
        if len(runs) != len(grids):
            raise ValueError(f"prompt[{idx}] has {len(runs)} image placeholder(s) but image_data gives "
                             f"{len(grids)} image(s)")
        new, spans, hashes, first = [], [], [], 0
        for (a, b), n, ident in zip(runs, counts, idents):
            new.extend(ids[first:a])
            spans.append((len(new), len(new) + n))
            new.extend([self.image_token_id] * n)
            first = b
            digest = hashlib.sha256(ident)
            digest.update(f"llava,{self.size},{n}".encode())
            hashes.append(digest.hexdigest())
        new.extend(ids[first:])
        pads = [self.vocab_size + int(h[:15], 16) % _HASH_SPACE for h in hashes]
        return new, ImageInputs(pixel_values=pv, grids=grids, spans=spans, hashes=hashes, pad_values=pads,
                                positions=None, rope_delta=0), None


class LlavaNextImagePrep(LlavaImagePrep):
    """LLaVA-NeXT: the processor's tiles of each image (whole image first), slots from ``next_layout``."""

    def __init__(self, hf_config: Any, model_dir: str) -> None:
        super().__init__(hf_config, model_dir)
        self.config = hf_config

    @property
    def processor(self) -> Any:
        """The checkpoint's LLaVA-NeXT image processor (it carries the tiling); none is an error."""
        if self._processor is None:
            from transformers import AutoImageProcessor

            try:
                self._processor = AutoImageProcessor.from_pretrained(self.model_dir)
            except (OSError, ValueError) as e:
                raise ValueError(f"LLaVA-NeXT needs the checkpoint's image processor "
                                 f"(preprocessor_config.json in {self.model_dir}): {e}") from None
        return self._processor

    def _pixels(self, images: list[Any], idx: int) -> tuple[Any, list[tuple[int, int, int]], list[bytes]]:
        """(tiles [sum tiles, C, S, S], one (tiles, height, width) grid per image, identities)."""
        pil = self._load(images, idx)
        out = self.processor(images=pil, return_tensors="pt")
        tiles, grids = [], []
        for pv, (h, w) in zip(out["pixel_values"], out["image_sizes"].tolist()):
            n = next_layout(self.config, h, w).num_tiles
            tiles.append(pv[:n])                  # the processor pads every image to the most tiles
            grids.append((n, h, w))
        return torch.cat(tiles), grids, self._idents(pil)

    def slots(self, grid: tuple[int, int, int]) -> int:
        return next_layout(self.config, grid[1], grid[2]).num_tokens


def vision_prep_for(hf_config: Any, model_dir: str) -> Optional[ImagePrep]:
    """The image preparation of a vision-language model (LLaVA's or Qwen2-VL's), None for a text model."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs and archs[0] == "LlavaNextForConditionalGeneration":
        return LlavaNextImagePrep(hf_config, model_dir)
    if archs and archs[0] in LLAVA_ARCHITECTURES:
        return LlavaImagePrep(hf_config, model_dir)
    return image_prep_for(hf_config, model_dir)
