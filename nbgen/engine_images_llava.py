"""generate()'s ``image_data`` for LLaVA (``models/llava.py``): each image resized and cropped by the
checkpoint's CLIP image processor to the tower's square size, its ``<image>`` placeholder expanded to one
slot per image token (``image_tokens_per_image``), the slots filled with content-hash ids as for Qwen2-VL
(``engine_images.py``); positions stay 1-D.

A placeholder is a single ``image_token_index`` token (what a chat template writes) or a run already
expanded by the HF processor (k images x slots per image). A prompt without any gets one ``<image>``
token per image prepended.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

from nbgen.core.multimodal import ImageInputs
from nbgen.engine_images import ImagePrep, image_prep_for, load_image
from nbgen.models.llava import image_tokens_per_image

LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration",)
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
            from transformers import AutoImageProcessor

            try:
                self._processor = AutoImageProcessor.from_pretrained(self.model_dir)
            except (OSError, ValueError):
                from transformers import CLIPImageProcessorPil
                self._processor = CLIPImageProcessorPil(size={"shortest_edge": self.size},
                                                        crop_size={"height": self.size, "width": self.size})
        return self._processor

    def _pixels(self, images: list[Any], idx: int) -> tuple[Any, list[tuple[int, int, int]], list[bytes]]:
        """(pixels [N, C, S, S], one (1, S/p, S/p)-like grid per image, one identity per image)."""
        where = f"image_data[{idx}]"
        if any(isinstance(im, dict) for im in images):
            raise ValueError(f"{where}: processor_output dicts are supported for Qwen2-VL only; pass images to LLaVA")
        pil = [load_image(im, where + (f"[{j}]" if len(images) > 1 else "")) for j, im in enumerate(images)]
        pv = self.processor(images=pil, return_tensors="pt")["pixel_values"]
        if tuple(pv.shape[-2:]) != (self.size, self.size):
            raise ValueError(f"the image processor gives {tuple(pv.shape[-2:])} pixels; the vision tower takes "
                             f"{self.size}x{self.size} (its crop_size must match vision_config.image_size)")
        return pv, [(1, 1, self.per_image)] * len(pil), [img.tobytes() + str(img.size).encode() for img in pil]

    def _placeholders(self, ids: list[int], n_images: int, idx: int) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, one [start, end) per image placeholder): single tokens, or runs of k x per-image slots."""
        if self.image_token_id not in ids:
            ids = [self.image_token_id] * n_images + ids
            return ids, [(i, i + 1) for i in range(n_images)]
        out, i = [], 0
        while i < len(ids):
            if ids[i] != self.image_token_id:
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] == self.image_token_id:
                j += 1
            if j - i == 1:
                out.append((i, j))
            elif (j - i) % self.per_image == 0:
                out += [(a, a + self.per_image) for a in range(i, j, self.per_image)]
            else:
                raise ValueError(f"prompt[{idx}] has a run of {j - i} image tokens: use one <image> token per "
                                 f"image or {self.per_image} per image (the expanded form)")
            i = j
        return ids, out

    def _inputs(self, ids: list[int], images: list[Any], idx: int) -> tuple[list[int], ImageInputs]:
        pv, grids, idents = self._pixels(images, idx)
        ids, runs = self._placeholders(ids, len(grids), idx)
        if len(runs) != len(grids):
            raise ValueError(f"prompt[{idx}] has {len(runs)} image placeholder(s) but image_data gives "
                             f"{len(grids)} image(s)")
        new, spans, hashes, first = [], [], [], 0
        for (a, b), ident in zip(runs, idents):
            new.extend(ids[first:a])
            spans.append((len(new), len(new) + self.per_image))
            new.extend([self.image_token_id] * self.per_image)
            first = b
            digest = hashlib.sha256(ident)
            digest.update(f"llava,{self.size}".encode())
            hashes.append(digest.hexdigest())
        new.extend(ids[first:])
        pads = [self.vocab_size + int(h[:15], 16) % _HASH_SPACE for h in hashes]
        return new, ImageInputs(pixel_values=pv, grids=grids, spans=spans, hashes=hashes, pad_values=pads,
                                positions=None, rope_delta=0)


def vision_prep_for(hf_config: Any, model_dir: str) -> Optional[ImagePrep]:
    """The image preparation of a vision-language model (LLaVA's or Qwen2-VL's), None for a text model."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs and archs[0] in LLAVA_ARCHITECTURES:
        return LlavaImagePrep(hf_config, model_dir)
    return image_prep_for(hf_config, model_dir)
