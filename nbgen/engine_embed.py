"""SGLang's ``encode`` / ``async_encode``: one embedding per prompt from an ``is_embedding=True`` engine.

Embedding requests run through the same scheduler as generation, as prefill-only requests
(continuous batching, chunked prefill, the prefix cache where the pooling allows it); the runner
pools the final hidden states as the model declares (``models/pooling_config.py``,
``runtime/embed_step.py``). Each result is ``{"embedding": [float, ...], "meta_info": {"id",
"finish_reason", "prompt_tokens", "cached_tokens", "weight_version", "e2e_latency"}}``; a request the engine had to
abort (say, longer than the whole KV cache) has ``embedding`` None and an abort finish_reason.
"""
from __future__ import annotations

import uuid
from typing import Any, Iterator, Optional, Union

from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.engine_io import check_ids, normalize_inputs, request_ids
from nbgen.models.pooling_config import check_dimensions

EmbedOutput = dict[str, Any]
Prompts = Optional[Union[str, list[str]]]
Ids = Optional[Union[list[int], list[list[int]]]]
EmbedResult = Union[EmbedOutput, list[EmbedOutput]]
_UNSUPPORTED = ("image_data", "audio_data", "video_data", "lora_path")


def _has_data(value: Any) -> bool:
    """SGLang's ``has_valid_data``: None, and (nested) lists holding only None, give nothing (a
    ``lora_path`` of ``[None] * n`` means the base model for every prompt)."""
    if isinstance(value, (list, tuple)):
        return any(_has_data(v) for v in value)
    return value is not None


class EmbedMixin:
    """encode() / async_encode() / encode_iter() for Engine (uses its config, pooling, _tokenize_all,
    _facts, _check_alive, _run_sync and _asubmit)."""

    def _embed_requests(self, prompt: Any, input_ids: Any, dimensions: Any, rid: Any,
                        unsupported: dict[str, Any]) -> tuple[list[Request], bool]:
        """Validate an encode() call and build its Requests (nothing is submitted on an error)."""
        self._check_alive()
        if not self.config.is_embedding:
            raise ValueError("encode() needs an embedding engine: this model was loaded for generation; create it "
                             "with nbgen.Engine(model_path, is_embedding=True). For token ids use "
                             "llm.tokenizer.encode(text).")
        for name in _UNSUPPORTED:
            if _has_data(unsupported.get(name)):
                raise ValueError(f"{name} is not supported by encode() yet; pass text prompts or input_ids")
        dims = check_dimensions(dimensions, self.pooling, self.model_name)
        items, single, kind = normalize_inputs(prompt, input_ids)
        rids = request_ids(rid, len(items), single)
        ids_list = self._tokenize_all(items) if kind == "prompt" else items
        params = SamplingParams(max_new_tokens=0)        # prefill only: finished after the prompt
        for i, ids in enumerate(ids_list):
            check_ids(ids, i, params, self._facts)
        spec = self.pooling.request(dims)
        reqs = [Request(rid=r if r is not None else uuid.uuid4().hex, prompt_ids=list(ids), params=params,
                        embed=spec) for ids, r in zip(ids_list, rids)]
        return reqs, single

    def encode(self, prompt: Prompts = None, image_data: Any = None, audio_data: Any = None,
               video_data: Any = None, dimensions: Optional[int] = None, lora_path: Any = None,
               external_trace_header: Optional[dict[str, Any]] = None, rid: Optional[Union[str, list[str]]] = None,
               input_ids: Ids = None) -> EmbedResult:
        """Embed one prompt (-> dict) or a list (-> list of dicts in order): ``{"embedding": [...],
        "meta_info": {...}}``. ``dimensions``: keep the first k components, then normalise
        (Matryoshka models only). image/audio/video data and LoRA are not supported yet (None, or
        lists of None, are accepted). ``external_trace_header`` is SGLang's tracing context: nbgen
        traces no requests, so it is accepted and has no effect."""
        reqs, single = self._embed_requests(prompt, input_ids, dimensions, rid, {
            "image_data": image_data, "audio_data": audio_data, "video_data": video_data, "lora_path": lora_path})
        results = dict(self._run_sync(reqs, progress=False))
        outs = [results[r.rid] for r in reqs]
        return outs[0] if single else outs

    async def async_encode(self, prompt: Prompts = None, image_data: Any = None, audio_data: Any = None,
                           video_data: Any = None, dimensions: Optional[int] = None, lora_path: Any = None,
                           external_trace_header: Optional[dict[str, Any]] = None,
                           rid: Optional[Union[str, list[str]]] = None, input_ids: Ids = None) -> EmbedResult:
        """Awaitable twin of encode(); cancelling the awaiting task aborts its requests."""
        reqs, single = self._embed_requests(prompt, input_ids, dimensions, rid, {
            "image_data": image_data, "audio_data": audio_data, "video_data": video_data, "lora_path": lora_path})
        results: dict[str, EmbedOutput] = {}
        async for upd in self._asubmit(reqs, stream=False):
            results[upd.rid] = upd.output
        outs = [results[r.rid] for r in reqs]
        return outs[0] if single else outs

    def encode_iter(self, prompt: Prompts = None, *, dimensions: Optional[int] = None,
                    input_ids: Ids = None) -> Iterator[tuple[int, EmbedOutput]]:
        """Yield ``(index, output)`` as each embedding finishes; closing early aborts the rest."""
        reqs, _ = self._embed_requests(prompt, input_ids, dimensions, None, {})
        index = {r.rid: i for i, r in enumerate(reqs)}
        for rid, out in self._run_sync(reqs, progress=False):
            yield index[rid], out
