"""VisionStep: the runner's path for steps holding prompt chunks of requests with images.

Per such step: the vision tower encodes, in one forward, the images of every request whose chunk reaches
an image and whose embeddings are not cached yet (they stay on the request, ``ImageInputs.embeds``, for
its later prefill chunks, and are dropped once its last image slot is computed; a preempted request
encodes again); the step's token embeddings take those rows at the image slots; positions are 3-D
(M-RoPE) for every row of the step, or 1-D for models without M-RoPE (``model.mrope`` False: LLaVA).
Steps without such chunks never come here: decode rows and text after a prompt's last image
run at ``p + rope_delta`` on the ordinary path (``step_inputs.flatten``).
Nothing here waits for the GPU: index lists and positions go through pinned memory, so the tower's
launches queue behind the previous step's work (overlap scheduling) instead of after it finished.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch

from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.models.mrope import step_positions
from nbgen.models.vision_pixels import PixelRecipe, RawImages, rgb_patches
from nbgen.models.vision_plan import to_device_async
from nbgen.runtime.step_inputs import FlatStep, to_device

TOWER_RANGE = "nbgen::vision_tower"      # the profiler range around each tower forward
PIXELS_RANGE = "nbgen::vision_pixels"    # ... around waiting for a tower batch's pixels and staging them
IMAGE_STEP_RANGE = "nbgen::image_step"   # ... around a step with image prompt chunks (tower + LLM forward)


def has_image_prefill(batch: ScheduledBatch) -> bool:
    """True when a seq of the batch computes prompt tokens up to an image's last slot. A chunk starting
    after the last image (a prompt's text tail) is plain text at positions p + rope_delta: the ordinary
    path (piecewise prefill graphs) runs it, as decode steps (``step_inputs.flatten``)."""
    return any(s.req.images is not None and s.start_pos < s.req.images.end for s in batch.seqs)


def _needs_encoding(s: SeqWork) -> bool:
    im = s.req.images
    return im is not None and im.embeds is None and s.start_pos < im.end and s.kv_len > im.spans[0][0]


class PixelStaging:
    """Pinned host buffers that a step's pixel patches are gathered into and copied to the GPU from, two
    used in turn and kept: a step's staging then never waits for the host allocator (pinning a new
    ~256 MB block costs tens of milliseconds on the loop thread, and blocks of a new size class would
    be pinned during the first large batch). A buffer is reused two steps later, when the GPU has run
    the copy that read it (the overlap stepper resolved the step behind it); its event guards that.
    Buffers are bytes, viewed as the dtype staged: float patches are cast to the model dtype while
    they are gathered (bf16 halves the bytes of fp32 and rounds exactly as the cast on the GPU did);
    RGB bytes (``RawImages``) are staged as they are, a quarter of their bf16 patches."""

    SLOTS = 2
    MAX_RESERVE_BYTES = 256 << 20        # per buffer reserved up front; larger steps grow it

    def __init__(self, device: torch.device, reserve_bytes: int = 0) -> None:
        self.device = device
        n = min(reserve_bytes, self.MAX_RESERVE_BYTES)
        self.bufs = [torch.empty(n, dtype=torch.uint8, pin_memory=True) if n else None for _ in range(self.SLOTS)]
        self.events: list[Optional[torch.cuda.Event]] = [None] * self.SLOTS
        self.turn = 0

    def to_device(self, parts: list[Any], dtype: torch.dtype) -> torch.Tensor:
        """``parts`` (tensors, or numpy arrays of ``dtype``) concatenated on the device in ``dtype``,
        queued without a host sync."""
        i, self.turn = self.turn, (self.turn + 1) % self.SLOTS
        rows = sum(p.shape[0] for p in parts)
        shape = (rows, *parts[0].shape[1:])
        nbytes = rows * math.prod(shape[1:]) * dtype.itemsize
        if self.events[i] is not None:
            self.events[i].synchronize()           # the copy two steps back: done long ago
        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[i] = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, pin_memory=True)
        host = buf[:nbytes].view(dtype).view(shape)
        if isinstance(parts[0], np.ndarray):
            np.concatenate(parts, out=host.numpy())    # RGB bytes (read-only views of the image bytes)
        else:
            torch.cat(parts, out=host)                 # cast while gathered (all cores)
        out = host.to(self.device, non_blocking=True)
        ev = self.events[i] = torch.cuda.Event()
        ev.record()
        return out


class VisionStep:
    """Image encoding and embedding merge for one model (``encode_images``, ``embed``, 3-D positions).
    ``reserve_pixels``: pixel values a step may stage (CUDA: pinned up front, see ``PixelStaging``)."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype, reserve_pixels: int = 0) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.staging = PixelStaging(device, reserve_pixels * dtype.itemsize) if device.type == "cuda" else None
        self.luts: dict[PixelRecipe, torch.Tensor] = {}                  # each recipe's table on the device

    def _stage(self, parts: list[Any], dtype: torch.dtype) -> torch.Tensor:
        """``parts`` (tensors, or numpy arrays of ``dtype``) as one tensor on the device in ``dtype``. On CUDA they are gathered into pinned memory
        in that dtype and copied asynchronously: a copy from pageable memory would wait for the GPU's
        queued work and leave it idle during the transfer."""
        if self.staging is None:
            both = torch.from_numpy(np.concatenate(parts)) if isinstance(parts[0], np.ndarray) else torch.cat(parts)
            return both.to(self.device, dtype)
        return self.staging.to_device(parts, dtype)

    def _lut(self, recipe: PixelRecipe) -> torch.Tensor:
        lut = self.luts.get(recipe)
        if lut is None:
            lut = self.luts[recipe] = to_device_async(recipe.lut, self.device)   # once per processor, no sync
        return lut

    def _pixels(self, parts: list[Any]) -> torch.Tensor:
        """The requests' pixel patches [N, D] on the device in the model dtype, in request order: patch
        tensors staged as they are, RGB bytes (``RawImages``) staged and made patches there, one run
        of consecutive parts of a kind (and image size) at a time."""
        runs: list[tuple[Any, list[Any]]] = []           # (recipe and size, or None: patches; parts)
        for part in parts:
            for key, t in (((part.recipe, tuple(im.shape)), im[None]) for im in part.rgb) \
                    if isinstance(part, RawImages) else ((None, part),):
                if runs and runs[-1][0] == key:
                    runs[-1][1].append(t)
                else:
                    runs.append((key, [t]))
        out = [self._stage(ts, self.dtype) if key is None else
               rgb_patches(self._stage(ts, torch.uint8), self._lut(key[0]), key[0], self.dtype) for key, ts in runs]
        return out[0] if len(out) == 1 else torch.cat(out)

    def _encode(self, seqs: list[SeqWork]) -> None:
        """One tower forward over the images of ``seqs``' requests; each request keeps its rows."""
        reqs = [s.req for s in seqs]
        with torch.profiler.record_function(PIXELS_RANGE):
            pv = self._pixels([r.images.pixels() for r in reqs])       # waits for pending preprocessing
        grids = [g for r in reqs for g in r.images.grids]
        with torch.profiler.record_function(TOWER_RANGE):            # a profile's tower share (bench.vlm --profile)
            out = self.model.encode_images(pv, grids)                    # [sum image tokens, H]
        for r, part in zip(reqs, out.split([r.images.num_tokens for r in reqs])):
            r.images.embeds = part

    def hidden_states(self, batch: ScheduledBatch, flat: FlatStep, input_ids: torch.Tensor, meta: Any) -> torch.Tensor:
        """Hidden states [T, H] of a step with image prompt chunks (``input_ids`` [T] on the device)."""
        with torch.profiler.record_function(IMAGE_STEP_RANGE):
            return self._hidden_states(batch, flat, input_ids, meta)

    def _hidden_states(self, batch: ScheduledBatch, flat: FlatStep, input_ids: torch.Tensor, meta: Any) -> torch.Tensor:
        todo = [s for s in batch.seqs if _needs_encoding(s)]
        if todo:
            self._encode(todo)
        x = self.model.embed(input_ids)                                  # [T, H]
        rows, srcs, pos = [], [], [[], [], []]
        for s, first in zip(batch.seqs, flat.starts):
            req, im = s.req, s.req.images
            n_prompt = len(req.prompt_ids)
            for r, p in zip(pos, step_positions(im.positions if im else None, n_prompt, req.rope_delta,
                                                s.start_pos, s.kv_len)):
                r.extend(p)
            if im is None or s.start_pos >= im.end:
                continue
            done = 0                                                     # image tokens before this span
            for a, b in im.spans:
                lo, hi = max(a, s.start_pos), min(b, s.kv_len)
                if lo < hi:
                    rows.append(np.arange(first + lo - s.start_pos, first + hi - s.start_pos))
                    srcs.append(im.embeds[done + lo - a: done + hi - a])
                done += b - a
        if rows:
            x.index_copy_(0, to_device(np.concatenate(rows), self.device), torch.cat(srcs).to(x.dtype))
        for s in batch.seqs:                 # last image slot computed: the cached embeddings go
            im = s.req.images
            if im is not None and im.embeds is not None and s.kv_len >= im.end:
                im.embeds = None
        positions = to_device(pos if self.model.mrope else pos[0], self.device)   # [3, T] or [T]
        return self.model(input_ids, positions, meta, input_embeds=x)


def vision_step_for(model: Any, device: torch.device, dtype: torch.dtype, step_tokens: int) -> Optional[VisionStep]:
    """The VisionStep of a vision-language model (None for a text model); its pixel staging reserves a
    step of ``step_tokens`` image tokens (the model's ``pixels_per_token``, where it has one)."""
    if not hasattr(model, "encode_images"):
        return None
    return VisionStep(model, device, dtype, step_tokens * int(getattr(model, "pixels_per_token", 0)))
