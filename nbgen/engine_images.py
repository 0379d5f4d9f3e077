"""generate()'s ``image_data`` (SGLang's argument) on the caller's thread: images loaded, preprocessed
with the model's HF image processor, the prompt's image placeholders expanded to one slot per image
token, M-RoPE positions computed, and the slots filled with content-hash ids (``core/multimodal.py``).

An image is a path, a ``file://`` URL, an ``http(s)://`` URL (fetched when reachable), a base64 string
or data URL, raw bytes or a PIL image. A prompt takes one image or a list; a batch takes a list with
one entry (None, an image or a list) per prompt. Each image needs a ``<|vision_start|><|image_pad|>
<|vision_end|>`` placeholder in the prompt (the chat template writes it); a prompt without any gets
them prepended, one per image.
Where grids follow from image sizes, pixel work runs in the background (``engine_images_background.py``,
``engine_images_device.py``) and a batch's hashes on a pool (``engine_images_ids.py``) while it runs.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import functools
import io
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from nbgen.core.multimodal import ImageInputs
from nbgen.core.request import Request
from nbgen.engine_images_background import BackgroundPixels, pixels_ahead
from nbgen.engine_images_device import pixel_recipe
from nbgen.engine_images_ids import IdPool, image_ids
from nbgen.models.mrope import mrope_positions
from nbgen.models.registry import VISION_ARCHITECTURES
from nbgen.models.vision_pixels import PixelRecipe

_FETCH_TIMEOUT_S = 10.0
_PARALLEL_FROM = 4          # prompts with images from which preprocessing runs in a thread pool
_MAX_WORKERS = 8


def checkpoint_image_processor(model_dir: str, fallback: str, kwargs: dict[str, Any]) -> Any:
    """The image processor a model directory ships (``AutoImageProcessor``), else transformers'
    ``fallback`` class built with ``kwargs``."""
    import transformers

    try:
        return transformers.AutoImageProcessor.from_pretrained(model_dir)
    except (OSError, ValueError):
        return getattr(transformers, fallback)(**kwargs)


def load_image(item: Any, where: str) -> Any:
    """One image argument -> an RGB PIL image; ValueError naming ``where`` when it cannot be read."""
    from PIL import Image

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
    elif isinstance(item, os.PathLike):
        data = _read_file(os.fspath(item), where)
    elif isinstance(item, str):
        data = _bytes_of_string(item, where)
    else:
        raise ValueError(f"{where} must be a path, URL, base64 string, bytes or PIL image, got {type(item).__name__}")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:   # PIL raises several types for undecodable data
        raise ValueError(f"{where} is not a readable image ({type(e).__name__}: {e})") from None
    return img.convert("RGB")


def _read_file(path: str, where: str) -> bytes:
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{where}: cannot read image file {path!r} ({e.strerror or e})") from None


def _bytes_of_string(s: str, where: str) -> bytes:
    if s.startswith("data:"):
        head, _, payload = s.partition(",")
        if ";base64" not in head:
            raise ValueError(f"{where}: a data URL must be base64-encoded")
        return _b64(payload, where)
    if s.startswith("file://"):
        return _read_file(urllib.request.url2pathname(s[len("file://"):]), where)
    if s.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(s, timeout=_FETCH_TIMEOUT_S) as r:
                return r.read()
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ValueError(f"{where}: could not fetch {s!r} ({getattr(e, 'reason', e)}); pass a local path, "
                             "bytes, a base64 string or a PIL image instead") from None
    if os.path.exists(os.path.expanduser(s)) or "." in s or s.startswith("~"):   # base64 has no "." or "~"
        return _read_file(s, where)
    if len(s) > 64:
        return _b64(s, where)
    raise ValueError(f"{where}: {s!r} is neither an existing file, a URL nor a base64 image")


def _b64(payload: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: invalid base64 image data") from None


def per_prompt_images(image_data: Any, n: int, single: bool) -> list[list[Any]]:
    """image_data -> one list of images per prompt (empty where a prompt has none)."""
    if image_data is None:
        return [[] for _ in range(n)]
    if single:
        return [list(image_data) if isinstance(image_data, (list, tuple)) else [image_data]]
    if not isinstance(image_data, (list, tuple)) or len(image_data) != n:
        got = f"{len(image_data)} entries" if isinstance(image_data, (list, tuple)) else type(image_data).__name__
        raise ValueError(f"image_data for a batch of {n} prompts must be a list with one entry per prompt "
                         f"(None, an image or a list of images), got {got}")
    return [[] if x is None else list(x) if isinstance(x, (list, tuple)) else [x] for x in image_data]


class ImagePrep:
    """The model's image facts and processor (loaded on first use) for ``image_data``."""

    _background: Optional[BackgroundPixels] = None          # the pixel work's pool (None: all on the caller)

    def __init__(self, hf_config: Any, model_dir: str) -> None:
        self.model_dir = model_dir
        self.vocab_size = int(hf_config.vocab_size)
        self.image_token_id = int(hf_config.image_token_id)
        self.start_id = int(hf_config.vision_start_token_id)
        self.end_id = int(hf_config.vision_end_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        self._processor: Optional[Any] = None
        self._recipe: Optional[PixelRecipe] = None               # the processor's, for images kept at their size
        self._background = BackgroundPixels()                     # the processor's pixel work
        self._ids = IdPool()                                      # a batch's image hashes

    @property
    def processor(self) -> Any:
        """The HF image processor of the model directory (the PIL one when torchvision is missing)."""
        if self._processor is None:
            # Qwen2-VL's defaults (min/max pixels) where the directory has no processor config
            proc = checkpoint_image_processor(self.model_dir, "Qwen2VLImageProcessorPil", {})
            self._recipe, self._processor = pixel_recipe(proc), proc
        return self._processor

    def _pixels(self, images: list[Any], idx: int) -> tuple[Any, list[tuple[int, int, int]], list[Any]]:
        """(patches [N, D] or a Future of them or None, grids, the PIL images or one identity per image): loaded
        and run through the processor (None: images it keeps at their size, whose RGB bytes ``image_ids``
        keeps for the device), or SGLang's processor_output dicts."""
        where = f"image_data[{idx}]"
        if any(isinstance(im, dict) for im in images):
            return _processor_output(images, where)
        pil = [load_image(im, where + (f"[{j}]" if len(images) > 1 else "")) for j, im in enumerate(images)]
        ahead = pixels_ahead(self._background, self.processor, self._recipe, pil)
        if ahead is not None:
            return ahead[0], ahead[1], pil
        out = self.processor(images=pil, return_tensors="pt")
        return out["pixel_values"], [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()], pil

    def _inputs(self, ids: list[int], images: list[Any], idx: int) -> tuple[list[int], ImageInputs, Callable[[], Any]]:
        """(expanded ids, ImageInputs without its hashes, the ``image_ids`` job giving them)."""
        pv, grids, src = self._pixels(images, idx)
        runs = _runs(ids, self.image_token_id)
        if not runs:
            ids = [self.start_id, self.image_token_id, self.end_id] * len(grids) + ids
            runs = _runs(ids, self.image_token_id)
        if len(runs) != len(grids):
            raise ValueError(f"prompt[{idx}] has {len(runs)} image placeholder(s) but image_data gives "
                             f"{len(grids)} image(s)")
        new, spans, first = [], [], 0
        for (a, b), (t, h, w) in zip(runs, grids):
            n = t * h * w // (self.merge * self.merge)
            new.extend(ids[first:a])
            spans.append((len(new), len(new) + n))
            new.extend([self.image_token_id] * n)
            first = b
        new.extend(ids[first:])
        positions, delta = mrope_positions(len(new), spans, grids, self.merge)
        job = functools.partial(image_ids, src, grids, self.vocab_size, self._recipe if pv is None else None)
        return new, ImageInputs(pixel_values=pv, grids=grids, spans=spans, hashes=[], pad_values=[],
                                positions=positions, rope_delta=delta), job

    def expand(self, ids_list: list[list[int]], images: list[list[Any]]) -> tuple[list[list[int]], list[Optional[ImageInputs]]]:
        """Prompts with their placeholders expanded (image token ids, still in the vocabulary for the
        usual checks) and each prompt's ImageInputs (None for prompts without images). A batch's image
        ids come from the pool in prompt order (``ImageInputs.pending``), one prompt's at once."""
        todo = [i for i, ims in enumerate(images) if ims]
        bg = self._background
        with bg.held() if bg is not None else contextlib.nullcontext():   # pixels once every prompt is laid out
            if len(todo) >= _PARALLEL_FROM:   # decoding and resizing release the GIL for most of their time
                _ = self.processor            # loaded once, before the workers share it
                with ThreadPoolExecutor(min(_MAX_WORKERS, os.cpu_count() or 1)) as ex:
                    done = list(ex.map(lambda i: self._inputs(ids_list[i], images[i], i), todo))
            else:
                done = [self._inputs(ids_list[i], images[i], i) for i in todo]
        out_ids, inputs = list(ids_list), [None] * len(ids_list)
        for i, (new, inp, job) in zip(todo, done):
            if job is not None:                   # (LLaVA hashes while laying out)
                inp.pending, raw = self._ids.submit(job) if len(todo) >= _PARALLEL_FROM else (None, None)
                if inp.pending is None:
                    inp.hashes, inp.pad_values, raw = job()
                inp.pixel_values = raw if inp.pixel_values is None else inp.pixel_values
            out_ids[i], inputs[i] = new, inp
        return out_ids, inputs


def _processor_output(items: list[Any], where: str) -> tuple[Any, list[tuple[int, int, int]], list[tuple[bytes, ...]]]:
    """SGLang's ``dict(processor_output, format="processor_output")``: the HF processor's
    ``pixel_values`` and ``image_grid_thw`` used as they are (prompts then come as ``input_ids`` with
    the placeholders already expanded)."""
    if not all(isinstance(d, dict) for d in items):
        raise ValueError(f"{where}: processor_output dicts and images cannot be mixed in one prompt")
    pvs, grids = [], []
    for d in items:
        fmt = d.get("format")
        if fmt != "processor_output":
            raise ValueError(f"{where}: image dict format {fmt!r} is not supported (only 'processor_output'; "
                             "precomputed embeddings are not)")
        if "pixel_values" not in d or "image_grid_thw" not in d:
            raise ValueError(f"{where}: a processor_output dict needs pixel_values and image_grid_thw")
        pvs.append(torch.as_tensor(d["pixel_values"]).float())
        grids += [tuple(int(v) for v in g) for g in torch.as_tensor(d["image_grid_thw"]).reshape(-1, 3).tolist()]
    pv = torch.cat(pvs)
    rows = [0]
    for t, h, w in grids:
        rows.append(rows[-1] + t * h * w)
    if rows[-1] != pv.shape[0]:
        raise ValueError(f"{where}: pixel_values has {pv.shape[0]} patches, image_grid_thw says {rows[-1]}")
    return pv, grids, [(pv[a:b].numpy().tobytes(),) for a, b in zip(rows[:-1], rows[1:])]


def _runs(ids: list[int], tok: int) -> list[tuple[int, int]]:
    """[start, end) of each run of ``tok`` in ids (one run = one image placeholder)."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == tok:
            j = i
            while j < len(ids) and ids[j] == tok:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def attach_images(reqs: list[Request], counts: list[int], inputs: list[Optional[ImageInputs]]) -> None:
    """Give each request (``counts[i]`` of them for prompt i, prompt-major) its own ImageInputs and put
    the hash ids into its prompt's image slots."""
    it = iter(reqs)
    for n, inp in zip(counts, inputs):
        for _ in range(n):
            req = next(it)
            if inp is None:
                continue
            if inp.end > len(req.prompt_ids):
                raise ValueError(f"prompt of {len(req.prompt_ids)} tokens (after allow_auto_truncate) cuts into "
                                 f"its image slots ending at {inp.end}: shorten the text or the image")
            req.images = dataclasses.replace(inp)
            req.rope_delta = inp.rope_delta
            for (a, b), pad in zip(inp.spans, inp.pad_values):     # none yet while pending (``settle``)
                req.prompt_ids[a:b] = [pad] * (b - a)


def prepare_images(prep: Optional[ImagePrep], model_name: str, ids_list: list[list[int]], image_data: Any,
                   single: bool, logprobs: list[Any], text_only_features: bool
                   ) -> tuple[list[list[int]], Optional[list[Optional[ImageInputs]]]]:
    """generate()'s image_data checked and applied: (prompt ids with expanded placeholders, each prompt's
    ImageInputs) or the ids unchanged and None without images. ``text_only_features``: the call uses
    sessions or a LoRA adapter, which run text-only requests."""
    images = per_prompt_images(image_data, len(ids_list), single)
    if not any(images):
        return ids_list, None
    if prep is None:
        refuse_images(model_name)
    if any(lp.logprob_start_len >= 0 for lp, ims in zip(logprobs, images) if ims):
        raise ValueError("logprob_start_len >= 0 (prompt logprobs) is not available with image_data: "
                         "image slots are not tokens; output logprobs are")
    if text_only_features:
        raise ValueError("image_data cannot be combined with session_params / session_id or lora_path "
                         "(sessions and LoRA adapters run text-only requests)")
    return prep.expand(ids_list, images)


def image_prep_for(hf_config: Any, model_dir: str) -> Optional[ImagePrep]:
    """An ImagePrep for a vision-language model, None for a text model."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return ImagePrep(hf_config, model_dir) if archs and archs[0] in VISION_ARCHITECTURES else None


def refuse_images(model_name: str) -> None:
    """image_data given to a text-only model: ValueError naming what takes images."""
    raise ValueError(f"image_data needs a vision-language model; {model_name} takes text only "
                     f"(supported vision-language architectures: {', '.join(VISION_ARCHITECTURES)})")
