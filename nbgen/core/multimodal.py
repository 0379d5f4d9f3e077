"""ImageInputs: a request's images as the runner needs them (built on the caller's thread by
``engine_images.py``, read and extended on the loop thread by ``runtime/vision_step.py``).

The prompt's image slots hold ``pad_values`` — ids past the vocabulary derived from each image's content
hash — instead of the image token id, so the prefix cache (which keys pages by token ids) shares KV
between requests with the same image and never between different images. The model reads those slots
from the vision tower's embeddings, never from the token table.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class ImageInputs:
    """All images of one prompt, in prompt order."""

    pixel_values: Any                      # [N patches, C*tp*p*p] float tensor on the CPU (all images),
                                           # or a Future of it while the caller's processor still runs,
                                           # or RawImages (RGB bytes the device makes patches of)
    grids: list[tuple[int, int, int]]      # per image (t, h, w) in patches
    spans: list[tuple[int, int]]           # per image: its token range [start, end) in prompt_ids
    hashes: list[str]                      # per image: sha256 of its processed pixels and grid
    pad_values: list[int]                  # per image: the id filling its slots (>= vocab_size)
    positions: Optional[list[list[int]]]   # [3][len(prompt_ids)] M-RoPE positions (t, h, w); None: 1-D
    rope_delta: int                        # decode position p runs at p + rope_delta
    embeds: Optional[Any] = None           # [image tokens, H] on the device once encoded (loop thread)
    pending: Optional[Future] = None       # Future of (hashes, pad_values) while a pool computes them; the
                                           # slots hold the image token id until ``settle``

    def settle(self, prompt_ids: list[int]) -> None:
        """Take the pending hashes and put their ids into the image slots of ``prompt_ids`` (waits)."""
        if self.pending is not None:
            self.hashes, self.pad_values = self.pending.result()
            self.pending = None
            for (a, b), pad in zip(self.spans, self.pad_values):
                prompt_ids[a:b] = [pad] * (b - a)

    def pixels(self) -> Any:
        """The pixel patches, waiting for the background preprocessing if it is still running."""
        pv = self.pixel_values
        return pv.result() if isinstance(pv, Future) else pv

    @property
    def num_tokens(self) -> int:
        """Prompt tokens that are image slots."""
        return sum(e - s for s, e in self.spans)

    @property
    def end(self) -> int:
        """The first prompt position after the last image."""
        return self.spans[-1][1] if self.spans else 0


SUBMIT_CHUNK = 32        # requests a submission holds at least (but the last), while later images are hashed


def settle_all(reqs: list[Any]) -> None:
    """Settle every request's images (``ImageInputs.settle``), waiting for pending hashes."""
    for r in reqs:
        if r.images is not None:
            r.images.settle(r.prompt_ids)


def submit_in_order(reqs: list[Any], submit: Callable[[list[Any]], None], abort: Callable[[list[str]], None]) -> None:
    """``submit`` the requests in order, in chunks of at least SUBMIT_CHUNK whose images are settled: a
    chunk goes as soon as the next request's hashes are still being computed, so the engine starts on the
    first images while later ones are hashed. Interrupted or refused midway: the submitted ones are aborted."""
    chunk: list[Any] = []
    sent: list[str] = []
    try:
        for r in reqs:
            im = r.images
            if im is not None and im.pending is not None:
                if len(chunk) >= SUBMIT_CHUNK and not im.pending.done():
                    submit(chunk)
                    sent += [q.rid for q in chunk]
                    chunk = []
                im.settle(r.prompt_ids)
            chunk.append(r)
        if chunk:
            submit(chunk)
    except BaseException:
        if sent:
            abort(sent)
        raise
