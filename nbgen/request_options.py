"""Caller-side checks and per-request options of structured output and custom logit processors.

Runs on the caller's thread before anything is submitted: an invalid json_schema / regex / ebnf /
structural_tag / stop_regex, or a custom logit processor on an Engine that does not allow them,
raises here.
"""
from __future__ import annotations

from typing import Any

from nbgen.core.errors import ArgumentTypeError
from nbgen.core.logit_processor import load_processor
from nbgen.core.request import Request
from nbgen.core.sampling import GRAMMAR_KINDS, SamplingParams
from nbgen.runtime.grammar import check_grammar
from nbgen.runtime.stop_regex import compile_stop_regex


def check_structured(sp: SamplingParams, has_tokenizer: bool = True) -> None:
    """ValueError for an invalid grammar or stop_regex (xgrammar / regex parse, cached), and for stop
    strings, stop_regex or a grammar on an engine without a tokenizer (they match text; SGLang
    refuses stop and stop_regex there too)."""
    if not has_tokenizer:
        for name in ("stop", "stop_regex", *GRAMMAR_KINDS):
            if getattr(sp, name):
                raise ValueError(f"{name}={getattr(sp, name)!r:.60} needs the tokenizer, which this Engine does not "
                                 "load (skip_tokenizer_init=True): use stop_token_ids, or an Engine with a tokenizer")
    if sp.constrained:
        check_grammar(sp)
    if sp.stop_regex:
        compile_stop_regex([sp.stop_regex] if isinstance(sp.stop_regex, str) else sp.stop_regex)


def attach_options(reqs: list[Request], sps: list[SamplingParams], return_hidden_states: list[Any],
                   processors: list[Any], allow_processors: bool, allow_hidden_states: bool) -> None:
    """Set return_hidden_states / logit_processor on the Requests (n per prompt, prompt-major);
    each needs its Engine flag (SGLang's enable_return_hidden_states / enable_custom_logit_processor)."""
    loaded: dict[int, Any] = {}
    for i, spec in enumerate(processors):
        if spec is None:
            continue
        if not allow_processors:
            raise ValueError("custom_logit_processor runs caller-supplied code: create the Engine with "
                             "enable_custom_logit_processor=True to allow it")
        loaded[i] = load_processor(spec)
    for flag in return_hidden_states:
        if not isinstance(flag, bool):
            raise ArgumentTypeError(f"return_hidden_states must be a bool, got {flag!r}")
    if any(return_hidden_states) and not allow_hidden_states:
        raise ValueError("return_hidden_states=True needs an Engine created with enable_return_hidden_states=True "
                         "(as SGLang's --enable-return-hidden-states)")
    k = 0
    for i, sp in enumerate(sps):
        for _ in range(sp.n):
            reqs[k].return_hidden_states = return_hidden_states[i]
            reqs[k].logit_processor = loaded.get(i)
            k += 1
    assert k == len(reqs), (k, len(reqs))
