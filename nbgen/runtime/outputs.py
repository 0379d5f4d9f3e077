"""Output dicts in SGLang's shape (generate and encode), built from a finished (or streaming) Request."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from nbgen.core.finish import finish_dict
from nbgen.core.request import Request

Decode = Optional[Callable[[int], str]]


def _entry(lp: Optional[float], tok: int, decode: Decode) -> tuple[Optional[float], int, Optional[str]]:
    return (lp, tok, decode(tok) if decode else None)


def _tops(tops: list[list[tuple[float, int]]], decode: Decode) -> list[list[tuple]]:
    return [[_entry(lp, t, decode) for lp, t in row] for row in tops]


def logprob_fields(req: Request, decode: Decode, start: int = 0) -> dict[str, Any]:
    """SGLang's logprob lists: (logprob, token_id, text|None); ``start`` skips already-streamed output."""
    lp = req.logprobs
    out: dict[str, Any] = {}
    if lp.logprob_start_len >= 0 and start == 0:
        first = lp.logprob_start_len
        inp = [_entry(v, t, decode) for v, t in req.input_token_logprobs]
        if first == 0 and req.prompt_ids:
            # the first prompt token has no prediction (SGLang reports None for it)
            inp = [_entry(None, req.prompt_ids[0], decode)] + inp
        out["input_token_logprobs"] = inp
        if lp.top_logprobs_num > 0:
            pad = [None] if first == 0 and req.prompt_ids else []
            out["input_top_logprobs"] = pad + _tops(req.input_top_logprobs, decode)
        if lp.token_ids_logprob:
            pad = [None] if first == 0 and req.prompt_ids else []
            out["input_token_ids_logprobs"] = pad + _tops(req.input_ids_logprobs, decode)
    if lp.return_logprob and lp.logprob_start_len < 0 and start == 0:
        # no prompt position asked for: SGLang still reports the prompt lists, empty
        out["input_token_logprobs"] = []
        if lp.top_logprobs_num > 0:
            out["input_top_logprobs"] = []
        if lp.token_ids_logprob:
            out["input_token_ids_logprobs"] = []
    if lp.return_logprob:
        out["output_token_logprobs"] = [_entry(v, t, decode) for v, t in req.output_token_logprobs[start:]]
        if lp.top_logprobs_num > 0:
            out["output_top_logprobs"] = _tops(req.output_top_logprobs[start:], decode)
        if lp.token_ids_logprob:
            out["output_token_ids_logprobs"] = _tops(req.output_ids_logprobs[start:], decode)
    return out


def spec_fields(req: Request) -> dict[str, Any]:
    """SGLang's speculative meta_info: verify steps, accepted / proposed drafts, their rate, tokens
    per verify step, and the histogram of accepted drafts per step (with SGLang's aliases)."""
    n, acc, prop = req.spec_verify_ct, req.spec_accepted, req.spec_proposed
    return {"spec_verify_ct": n, "spec_accept_length": len(req.output_ids) / n,
            "spec_accept_rate": acc / prop if prop else 0.0,
            "spec_accepted_drafts": acc, "spec_proposed_drafts": prop,
            "spec_num_correct_drafts": acc, "spec_num_proposed_drafts": prop,
            "spec_accept_token_num": acc, "spec_draft_token_num": prop,
            "spec_accept_histogram": list(req.spec_histogram),
            "spec_correct_drafts_histogram": list(req.spec_histogram)}


def embedding_output(req: Request) -> dict[str, Any]:
    """SGLang's encode() dict: the vector (None when the request was aborted) and its meta_info."""
    return {"embedding": req.embedding,
            "meta_info": {"id": req.rid, "finish_reason": finish_dict(req.finish_reason, 0),
                          "prompt_tokens": len(req.prompt_ids), "cached_tokens": req.cached_tokens,
                          "weight_version": req.weight_version, "num_retractions": req.num_retractions,
                          "e2e_latency": time.perf_counter() - req.arrival}}


def build_output(req: Request, text: Optional[str], output_ids: list[int], decode: Decode,
                 finished: bool, logprob_start: int = 0) -> dict[str, Any]:
    """The dict a caller receives: text, output_ids and meta_info (finish_reason None while running);
    ``text`` None (no tokenizer: skip_tokenizer_init) leaves the text key out, as SGLang; for an
    embedding request the ``embedding_output`` dict."""
    if req.embed is not None:
        return embedding_output(req)
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "reasoning_tokens": 0,               # SGLang counts them with a reasoning parser; nbgen has none
        "num_retractions": req.num_retractions,
        "finish_reason": finish_dict(req.finish_reason, len(req.output_ids)) if finished else None,
        "weight_version": req.weight_version,
        "e2e_latency": time.perf_counter() - req.arrival,
    }
    if req.spec_verify_ct:
        meta.update(spec_fields(req))
    if req.logprobs.return_logprob or req.logprobs.logprob_start_len >= 0:
        meta.update(logprob_fields(req, decode, logprob_start))
    if req.images is not None:     # prompt tokens that are image slots (vision-language models)
        meta["image_tokens"] = req.images.num_tokens
    if req.return_hidden_states:   # SGLang's: [0] every prompt position's state, then one per later token
        meta["hidden_states"] = req.hidden_states[logprob_start:len(req.output_ids)]
    if text is None:
        return {"output_ids": output_ids, "meta_info": meta}
    return {"text": text, "output_ids": output_ids, "meta_info": meta}
