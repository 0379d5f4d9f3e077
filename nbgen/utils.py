"""Helpers SGLang's notebooks import from sglang.utils."""
from __future__ import annotations

from typing import Any, AsyncIterator, Optional


def stream_and_merge(engine: Any, prompt: str, sampling_params: Optional[dict] = None) -> str:
    """Stream one prompt and return the whole text."""
    return "".join(chunk["text"] for chunk in engine.generate(prompt, sampling_params, stream=True))


async def async_stream_and_merge(engine: Any, prompt: str,
                                 sampling_params: Optional[dict] = None) -> AsyncIterator[str]:
    """Yield the text pieces of one streamed prompt as they arrive."""
    gen = await engine.async_generate(prompt, sampling_params, stream=True)
    async for chunk in gen:
        yield chunk["text"]
