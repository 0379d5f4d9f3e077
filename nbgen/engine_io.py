"""Caller-side input handling for Engine: validate, tokenize and turn arguments into Requests.

Everything here runs on the caller's thread before anything is submitted, so a bad item in a batch
fails the whole call with a clear error and nothing runs.
"""
from __future__ import annotations

import dataclasses
import random
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Union

from nbgen.core.errors import ArgumentTypeError
from nbgen.core.request import LogprobRequest, Request
from nbgen.core.sampling import NONE_MEANS_DEFAULT, SamplingParams, check_text
from nbgen.core.scheduler_config import is_integral

PromptArg = Optional[Union[str, list[str]]]
IdsArg = Optional[Union[list[int], list[list[int]]]]


@dataclass
class ModelFacts:
    """What validation needs to know about the loaded model."""

    vocab_size: int
    context_length: int
    eos_ids: frozenset[int]
    generation_defaults: dict[str, Any]
    allow_context_overflow: bool = False
    allow_auto_truncate: bool = False      # a prompt past the context keeps its first context_length - 1 ids


def _is_id_list(x: Any) -> bool:
    """A list/tuple of ints (bools excluded). The element types are collected at C speed: a
    Python-level isinstance per element costs tens of ms on a batch of 100k+ prompt ids."""
    if not isinstance(x, (list, tuple)):
        return False
    types = set(map(type, x))
    return types <= {int} or all(issubclass(t, int) and not issubclass(t, bool) for t in types)


def normalize_inputs(prompt: PromptArg, input_ids: IdsArg) -> tuple[list[Any], bool, str]:
    """-> (items, single, kind) where items are str prompts or id lists, kind 'prompt'|'input_ids'."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt or input_ids, got "
                         + ("both" if prompt is not None else "neither"))
    if prompt is not None:
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            return [prompt], True, "prompt"
        if not isinstance(prompt, (list, tuple)):
            raise ArgumentTypeError(f"prompt must be a str or a list of str, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be an empty list")
        for i, p in enumerate(prompt):
            if not isinstance(p, str):
                raise ArgumentTypeError(f"prompt[{i}] must be a str, got {type(p).__name__}")
            check_text(p, f"prompt[{i}]")
        return list(prompt), False, "prompt"
    if not isinstance(input_ids, (list, tuple)):
        raise ArgumentTypeError(f"input_ids must be a list of ints or a list of lists, got {type(input_ids).__name__}")
    if not input_ids:
        raise ValueError("input_ids must not be empty")
    if _is_id_list(input_ids):
        return [list(input_ids)], True, "input_ids"
    for i, ids in enumerate(input_ids):
        if not _is_id_list(ids):
            raise ArgumentTypeError(f"input_ids[{i}] must be a list of ints, got {ids!r:.60}")
        if not ids:
            raise ValueError(f"input_ids[{i}] must not be empty")
    return [list(x) for x in input_ids], False, "input_ids"


def per_item(name: str, value: Any, n: int) -> list[Any]:
    """Broadcast a per-call argument, or check a per-item list has one entry per prompt."""
    if isinstance(value, list) and (name != "token_ids_logprob" or (value and isinstance(value[0], list))):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def build_params(d: Any, facts: ModelFacts) -> SamplingParams:
    """User dict (+ the model's generation_config defaults for keys not given) -> SamplingParams."""
    if isinstance(d, SamplingParams):
        sp = d
    else:
        if d is not None and not isinstance(d, dict):
            raise ArgumentTypeError(f"sampling_params must be a dict or a list of dicts, got {type(d).__name__}")
        # a None that means "the default" is a key not given: the model's generation default applies
        given = {k: v for k, v in (d or {}).items() if not (v is None and k in NONE_MEANS_DEFAULT)}
        sp = SamplingParams.from_dict({**facts.generation_defaults, **given})
    sp.verify(facts.vocab_size)
    return sp


def check_ids(ids: list[int], idx: int, sp: SamplingParams, facts: ModelFacts) -> SamplingParams:
    """Token ids inside the vocab; prompt + max_new_tokens within the context length. With
    ``allow_auto_truncate`` a prompt past the context loses its tail (in place; SGLang keeps the
    first tokens too) and max_new_tokens is cut to fit."""
    if ids and (min(ids) < 0 or max(ids) >= facts.vocab_size):
        bad = [t for t in ids if not 0 <= t < facts.vocab_size]
        raise ValueError(f"input_ids[{idx}] has token ids outside the vocabulary [0, {facts.vocab_size}): {bad[:5]}")
    if not ids:
        raise ValueError(f"prompt[{idx}] is empty after tokenization")
    if facts.allow_auto_truncate and len(ids) >= facts.context_length:
        del ids[facts.context_length - 1:]
    room = facts.context_length - len(ids)
    if room <= 0:
        raise ValueError(f"prompt[{idx}] has {len(ids)} tokens, over the context length {facts.context_length}")
    if sp.max_new_tokens is None or sp.max_new_tokens > room:
        if sp.max_new_tokens is not None and not (facts.allow_context_overflow or facts.allow_auto_truncate):
            raise ValueError(f"max_new_tokens={sp.max_new_tokens} with a {len(ids)}-token prompt[{idx}] exceeds "
                             f"the context length {facts.context_length} (pass a smaller max_new_tokens or "
                             f"Engine(allow_context_overflow=True) to cut generation at the context length)")
        sp = dataclasses.replace(sp, max_new_tokens=room)
    return sp


def check_rids(rids: list[Any]) -> list[Optional[str]]:
    """Request ids are strings (or None: one is made up); anything else is a ValueError naming rid
    (SGLang's error for it)."""
    for r in rids:
        if r is not None and not isinstance(r, str):
            raise ValueError(f"rid must be a str or a list of str (one per prompt), got {r!r:.60}")
    return rids


def request_ids(rid: Any, n: int, single: bool) -> list[Optional[str]]:
    """One request id per prompt (None: one is made up). A str for a batch gives prompt i the id
    ``f"{rid}_{i}"`` (SGLang's rule); a list needs one str per prompt, without duplicates."""
    if isinstance(rid, str) and not single:
        rid = [f"{rid}_{i}" for i in range(n)]
    rids = check_rids(per_item("rid", rid, n))
    dups = [r for r, k in Counter(r for r in rids if r is not None).items() if k > 1]
    if dups:
        raise ValueError(f"rid {dups[0]!r} appears more than once in the call (request ids must be unique)")
    return rids


def check_priority(priority: Any) -> Optional[int]:
    """generate()'s ``priority``: None or one int for every prompt of the call (as SGLang's
    GenerateReqInput); anything else is a ValueError naming priority."""
    if priority is None:
        return None
    if not is_integral(priority):
        raise ValueError(f"priority must be an int or None (one value for the whole call), got {priority!r:.60}")
    return int(priority)


def make_requests(ids_list: list[list[int]], params: list[SamplingParams], logprobs: list[LogprobRequest],
                  rids: list[Optional[str]], facts: ModelFacts, rng: random.Random) -> list[Request]:
    """Prompt-major list of Requests; n > 1 samples share a group and get distinct seeds."""
    out: list[Request] = []
    for i, (ids, lp) in enumerate(zip(ids_list, logprobs)):
        if lp.logprob_start_len > len(ids):    # SGLang aborts such a request
            raise ValueError(f"logprob_start_len={lp.logprob_start_len} is past the end of prompt[{i}] "
                             f"({len(ids)} tokens)")
    for ids, sp, lp, rid in zip(ids_list, params, logprobs, rids):
        base = rid if rid is not None else uuid.uuid4().hex
        seed = sp.sampling_seed if sp.sampling_seed is not None else rng.getrandbits(31)
        # ignore_eos turns off every token stop, stop_token_ids too (SGLang's Req._check_token_based_finish)
        stop_ids = frozenset() if sp.ignore_eos else frozenset(sp.stop_token_ids or ()) | facts.eos_ids
        for j in range(sp.n):
            out.append(Request(rid=base if sp.n == 1 else f"{base}-{j}", prompt_ids=list(ids), params=sp,
                               stop_ids=stop_ids, logprobs=lp, seed=(seed + 1_000_003 * j) % (2**31),
                               group=base if sp.n > 1 else None))
    return out


def make_logprob_requests(n: int, return_logprob: Any, top_logprobs_num: Any, logprob_start_len: Any,
                          token_ids_logprob: Any, vocab_size: int,
                          return_text_in_logprobs: Any = False) -> list[LogprobRequest]:
    """Per-prompt logprob options, validated."""
    # None (SGLang's Engine default for these) means the default: no logprobs, 0 top, output only
    rl = [False if v is None else v for v in per_item("return_logprob", return_logprob, n)]
    tn = [0 if v is None else v for v in per_item("top_logprobs_num", top_logprobs_num, n)]
    ls = [-1 if v is None else v for v in per_item("logprob_start_len", logprob_start_len, n)]
    if is_integral(token_ids_logprob):      # one id for every prompt (SGLang's GenerateReqInput wraps it)
        token_ids_logprob = [int(token_ids_logprob)]
    ti = per_item("token_ids_logprob", token_ids_logprob, n)
    out = []
    for i in range(n):
        # any integer type (a numpy int) counts; a bool does not (topk would get k=True)
        if not is_integral(tn[i]) or tn[i] < 0:
            raise ValueError(f"top_logprobs_num must be an int >= 0, got {tn[i]!r}")
        if not is_integral(ls[i]) or ls[i] < -1:
            raise ValueError(f"logprob_start_len must be -1 or an int >= 0, got {ls[i]!r}")
        tn[i], ls[i] = int(tn[i]), int(ls[i])
        ids = ti[i]
        if ids is not None:
            if not _is_id_list(ids) or any(not 0 <= t < vocab_size for t in ids):
                raise ValueError(f"token_ids_logprob must be token ids in [0, {vocab_size}), got {ids!r:.80}")
        want = bool(rl[i])
        out.append(LogprobRequest(return_logprob=want, top_logprobs_num=tn[i] if want else 0,
                                  logprob_start_len=ls[i] if want else -1,
                                  token_ids_logprob=list(ids) if (want and ids) else None,
                                  return_text_in_logprobs=bool(return_text_in_logprobs)))
    return out
