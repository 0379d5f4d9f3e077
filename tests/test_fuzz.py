"""Seeded fuzz of ``Engine.generate`` on a tiny random Llama (never sample a banned token, never hang,
never accept what cannot run).

Every case must end within ``TIMEOUT_S`` as EITHER a valid output (right shape and count, a finish
reason, no banned token, no stop id before the end, within max_new_tokens, text inside its grammar)
OR a ValueError / TypeError whose message names the argument at fault. After every case nothing may
be left running and a greedy canary must still give the ids it gave at the start.

CI runs 300 random cases from seed 0, in chunks of 50 (one test each), then a few pinned cases (rare
in the random stream). More cases: ``pytest tests/test_fuzz.py --fuzz-cases 3000`` (the option is
added in tests/conftest.py); another case set: ``NBGEN_FUZZ_SEED=7 pytest tests/test_fuzz.py``. A
failing chunk lists each failing case's number, expectation, the exact call and what went wrong. When
the engine stops serving (a hang, a dead loop) that chunk fails and the next one starts a fresh engine.
"""
from __future__ import annotations

import functools
import math
import os
import random
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import pytest

import nbgen

SEED = int(os.environ.get("NBGEN_FUZZ_SEED", "0"))
CHUNK = 50
TIMEOUT_S = 60.0      # generous: CI machines are loaded; a hang fails the case instead of the suite
CANARY = ("The capital of France is", {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
FINISH_TYPES = {"stop", "length", "abort"}
INF = float("inf")
NAN = float("nan")

WORDS = ["the", "cat", "Paris", "capital", "def", "add(a, b):", "return", "caf\u00e9", "\u65e5\u672c\u8a9e",
         "\U0001F600", "1000", "!?", ",", "\n", "  ", "\t", "na\u00efve", "<|im_end|>", "<|endoftext|>"]
WEIRD = ["\x00\x01\x02", "\x1b[31mred\x1b[0m", "\u200b\u200d\ufeff", "a\u0301e\u0301", "\u202eevil",
         "\U0010ffff", "\ufffd", "\x7f\x85", "\u0000" * 5, "\U0001F468\u200d\U0001F469\u200d\U0001F467"]
ASCII_WORDS = ["the", "cat", "Paris", "capital", "of", "France", "is", "hello", "world", "add", "return"]
STOPS = ["\n", " ", "e", "the", ".", "\U0001F600", "caf\u00e9", "<|im_end|>", "zz", "a\u0301", "is"]
# grammar -> a regex every prefix of a conforming text matches (the text may be cut by a stop or length)
PREFIX_OF = {"[a-z]+": "[a-z]*", "[0-9]{1,3}": "[0-9]{0,3}", "(yes|no)": "|y|ye|yes|n|no",
             'root ::= "yes" | "no"': "|y|ye|yes|n|no"}
SCHEMAS = ['{"type": "object"}',
           '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, '
           '"required": ["name"]}']


@dataclass
class Case:
    """One generated call and what it must end as."""

    idx: Any                      # its number (random cases) or name (pinned cases)
    kwargs: dict[str, Any]
    mode: str                     # call | stream | stream_close | iter_close
    outs: list[dict[str, Any]]    # the sampling params of each expected output (prompt-major, n each)
    single: bool                  # a lone prompt: a dict comes back when there is one output
    expect: str = "ok"            # ok: must return | raise: must raise | either
    names: tuple[str, ...] = ()   # a raised error must name one of these
    note: str = "valid"           # what was injected

    def __repr__(self) -> str:
        fn = "generate_iter" if self.mode == "iter_close" else "generate"
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.kwargs.items())
        want = self.expect + (f" naming {'/'.join(self.names)}" if self.names else "")
        return f"case {self.idx} [{self.note}; expect {want}; {self.mode}] engine.{fn}({args})"


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 400 else f"{r[:200]}...<{len(r)} chars>...{r[-80:]}"


# ---- case generation ---------------------------------------------------------------------------
def _text(r: random.Random) -> str:
    pool = WORDS + WEIRD if r.random() < 0.3 else WORDS
    return " ".join(r.choice(pool) for _ in range(r.randint(1, 12)))


def _item(r: random.Random, kind: str, vocab: int, ctx: int) -> tuple[Any, bool]:
    """One prompt (str) or id list, and whether it may not fit the context with max_new_tokens."""
    roll = r.random()
    if kind == "prompt":
        if roll < 0.04:
            return "x" * 3000, True                        # likely over the context length
        if roll < 0.10:                                    # <= 600 tokens: fits with max_new_tokens <= 64
            return " ".join(r.choice(ASCII_WORDS) for _ in range(100))[:600], False
        return _text(r), False
    if roll < 0.04:
        return [r.randrange(vocab) for _ in range(r.randint(ctx - 30, ctx + 100))], True
    if roll < 0.10:
        return [r.randrange(vocab) for _ in range(r.randint(200, 500))], False
    return [r.randrange(vocab) for _ in range(r.randint(1, 40))], False


def _logit_bias(r: random.Random, vocab: int, avoid: set[int]) -> tuple[dict[Any, float], str]:
    mode = r.choice(["few", "few", "ban_some", "ban_most", "ban_all", "huge"])
    key: Callable[[int], Any] = (lambda t: t) if r.random() < 0.5 else str   # SGLang's JSON gives str keys
    if mode == "few":
        return {key(r.randrange(vocab)): r.choice([-100.0, -1.5, 0.0, 2.0, 100.0, -INF])
                for _ in range(r.randint(1, 5))}, mode
    if mode == "ban_some":
        return {key(t): -INF for t in r.sample(range(vocab), r.randint(10, 100))}, mode
    if mode == "ban_most":   # a few allowed tokens, none of them a stop id (min_new_tokens masks those)
        allowed = set(r.sample(sorted(set(range(vocab)) - avoid), r.randint(1, 3)))
        return {key(t): -INF for t in range(vocab) if t not in allowed}, mode
    if mode == "ban_all":
        return {key(t): -INF for t in range(vocab)}, mode
    return {key(r.randrange(vocab)): r.choice([3.4e38, -1e308, 3.0e38]) for _ in range(r.randint(1, 2))}, mode


def _params(r: random.Random, vocab: int, eos: set[int], allow_n: bool) -> tuple[dict[str, Any], str]:
    """Valid sampling params (often extreme) and a tag: '' | 'ban_all' | 'grammar+bias'."""
    p: dict[str, Any] = {}
    mnt = r.choice([0, 1, 2, 3, 5, 8, 8, 16, 16, 32, 64])
    if r.random() < 0.015:
        p["max_new_tokens"] = None                        # up to the context length
    elif r.random() < 0.9:
        p["max_new_tokens"] = mnt
    if r.random() < 0.2:
        p["min_new_tokens"] = r.randint(0, mnt if "max_new_tokens" in p and p["max_new_tokens"] is not None else 8)
    if r.random() < 0.7:
        p["temperature"] = r.choice([0, 0.0, 1e-300, 5e-324, 1e-7, 1e-6, 0.3, 0.7, 1, 1.0, 2.0, 10.0, 1e300])
    if r.random() < 0.3:
        p["top_p"] = r.choice([1.0, 0.95, 0.5, 0.1, 1e-9, 5e-324])
    if r.random() < 0.3:
        p["top_k"] = r.choice([-1, 1, 2, 40, vocab - 1, vocab, vocab + 1, 2**31, 2**63, 2**100])
    if r.random() < 0.2:
        p["min_p"] = r.choice([0.0, 0.05, 0.5, 0.99, 1.0])
    for name in ("frequency_penalty", "presence_penalty"):
        if r.random() < 0.15:
            p[name] = r.choice([-2.0, -0.5, 0.0, 0.5, 2, 2.0])
    if r.random() < 0.15:
        p["repetition_penalty"] = r.choice([1.0, 0.5, 1.2, 2.0, 1e-9])
    if r.random() < 0.2:
        p["stop"] = r.choice(STOPS) if r.random() < 0.4 else r.sample(STOPS, r.randint(1, 3))
    if r.random() < 0.15:
        ids = [r.randrange(vocab) for _ in range(r.randint(0, 5))] + ([min(eos)] if r.random() < 0.3 else [])
        p["stop_token_ids"] = ids if r.random() < 0.8 else tuple(ids)
    if r.random() < 0.3:
        p["ignore_eos"] = r.random() < 0.5
    for name in ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if r.random() < 0.08:
            p[name] = r.random() < 0.5
    if allow_n and r.random() < 0.25:
        p["n"] = r.choice([1, 2, 3])
    if r.random() < 0.3:
        p["sampling_seed"] = r.choice([0, 1, r.randrange(2**31), 2**31 - 1, 2**63 - 1])
    if r.random() < 0.12:
        g = r.random()
        if g < 0.5:
            p["regex"] = r.choice([k for k in PREFIX_OF if "::=" not in k])
        elif g < 0.85:
            p["json_schema"] = r.choice(SCHEMAS)
        else:
            p["ebnf"] = 'root ::= "yes" | "no"'
    if r.random() < 0.04:
        p["stop_regex"] = r.choice(["[0-9]", "ab+", ["x{2}", "\\."]])
    tag = ""
    if r.random() < 0.2:
        avoid = set(eos) | set(p.get("stop_token_ids") or ())
        p["logit_bias"], mode = _logit_bias(r, vocab, avoid)
        if mode == "ban_all":
            tag = "ban_all"
        elif any(k in p for k in ("regex", "json_schema", "ebnf")) and mode != "few":
            tag = "grammar+bias"   # the bans may leave the grammar no token: an abort (or an error) is fine
    return p, tag


def bad_values(vocab: int) -> list[tuple[str, Any]]:
    """(key, bad value) pairs: the call must raise naming key. (None is SGLang's "the default" for the
    numeric and bool parameters, and a None stop_token_ids entry is dropped: not bad.)"""
    return [
        *[("temperature", v) for v in (NAN, INF, -INF, -1, -1e-9, "0.5", [1], {}, 1j, True)],
        *[("top_p", v) for v in (0, 0.0, -0.1, 1.5, NAN, INF, "1", [0.5])],
        *[("top_k", v) for v in (0, -2, -(2**63), 1.5, "5", True, 5.0)],
        *[("min_p", v) for v in (-0.1, 1.1, NAN, INF, "0")],
        *[(k, v) for k in ("frequency_penalty", "presence_penalty") for v in (2.5, -3, NAN, INF, -INF, "x")],
        *[("repetition_penalty", v) for v in (0, -1, 2.5, NAN, INF)],
        *[("max_new_tokens", v) for v in (-1, 1.5, "8", NAN, INF, [8], True, 10**30, 2**63, 5000)],
        *[("min_new_tokens", v) for v in (-1, "1", 1.0, 10**9)],
        *[("n", v) for v in (0, -1, 2**40, 1.0, "2", True, NAN)],
        *[("stop", v) for v in ("", [""], [1], 5, ["ok", None], {"a": 1}, "\ud800", ["x", "\udfff"], ("a", ""))],
        *[("stop_token_ids", v) for v in ([-1], [vocab], [10**9], "12", 12, [1.5], [True], {1: 2})],
        *[("stop_regex", v) for v in ("(", "", [""], 5, ["ok", "[a-"])],
        *[(k, v) for k in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
            for v in ("yes", 1, 0)],
        *[("logit_bias", v) for v in ([1, 2], "x", 5, {"abc": 1.0}, {None: 1.0}, {(1, 2): 1.0}, {1: NAN},
                                      {1: INF}, {"2": "x"}, {3: None}, {vocab: 1.0}, {-1: -INF},
                                      {10**9: 0.0}, {"1e3": 1.0}, {5: [1]}, {"7": INF}, {"9": 1e308})],
        *[("sampling_seed", v) for v in ("1", 1.5, NAN, [1])],
        *[("regex", v) for v in ("(", "[a-", "", 5, ["[a-z]"])],
        *[("json_schema", v) for v in ("not json", "{", "[1, 2]", "5", '"str"', "", "null", 5)],
        *[("ebnf", v) for v in ("root ::= ", 'root ::= "a" (', 'x ::= "a"', "", 5)],
    ]
# (key, odd value) -> returning or raising naming key are both fine
ODD_VALUES: list[tuple[str, Any]] = [
    ("sampling_seed", 2**200), ("sampling_seed", -1), ("logit_bias", {1.7: 1.0}), ("logit_bias", {True: 1.0}),
    ("json_schema", {"type": "object"}), ("custom_params", 5), ("custom_params", {"a": [1]}),
    ("stop_token_ids", {1, 2}), ("stop", ("a", "b")), ("max_new_tokens", None),
]
UNKNOWN_KEYS = ["temprature", "max_tokens", "foo", "Temperature", "top-p", "", "stop_strs", "\ud800", "n "]
NON_STR_KEYS = [5, None, (1, 2), 1.5, b"top_k", frozenset()]
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf")


class _Builder:
    """Mutable state of one case while faults are injected."""

    def __init__(self, r: random.Random, idx: int, vocab: int, ctx: int, eos: set[int]) -> None:
        self.r, self.idx, self.vocab, self.ctx, self.eos = r, idx, vocab, ctx, eos
        self.mode = r.choices(["call", "stream", "stream_close", "iter_close"], [70, 12, 8, 10])[0]
        streaming = self.mode.startswith("stream")
        self.kind = "input_ids" if r.random() < 0.25 else "prompt"
        self.batch = not streaming and r.random() < 0.45
        n_items = r.randint(1, 4) if self.batch else 1
        self.items, risky = [], False
        for _ in range(n_items):
            item, big = _item(r, self.kind, vocab, ctx)
            self.items.append(item)
            risky |= big
        self.expect, self.names, self.notes = "ok", [], []
        self.raw_items = False   # items is the prompt / input_ids argument as given (a bad one)
        if risky:
            self.soft("prompt", "input_ids", "max_new_tokens", note="maybe over the context")
        tags = []
        if self.batch and r.random() < 0.25:
            self.sps: list[Optional[dict]] = []
            for _ in self.items:
                p, tag = _params(r, vocab, eos, allow_n=True)
                self.sps.append(p)
                tags.append(tag)
            self.sp_arg: Any = self.sps
        else:
            p, tag = _params(r, vocab, eos, allow_n=not streaming)
            self.sp_arg = None if r.random() < 0.08 else p
            self.sps = [self.sp_arg] * n_items
            tags.append(tag if self.sp_arg is not None else "")
        if "ban_all" in tags:
            self.soft("logit_bias", note="every token banned")
        if "grammar+bias" in tags:
            self.soft("logit_bias", *GRAMMAR_KEYS, note="grammar with bans")
        self.extra: dict[str, Any] = {}
        if r.random() < 0.15:
            self.extra["return_logprob"] = True
            self.extra["top_logprobs_num"] = r.choice([0, 1, 5, vocab])
            self.extra["logprob_start_len"] = r.choice([-1, 0, 1])
            if r.random() < 0.3:
                self.extra["token_ids_logprob"] = r.sample(range(vocab), r.randint(1, 4))
        if r.random() < 0.2:   # one rid per prompt (a one-entry list for a lone prompt is fine too)
            self.extra["rid"] = ([f"fz{idx}-{i}" for i in range(n_items)] if self.batch or r.random() < 0.2
                                 else f"fz{idx}")

    # -- expectations
    def hard(self, *names: str, note: str) -> None:
        self.expect = "raise"
        self.names += names
        self.notes.append(note)

    def soft(self, *names: str, note: str) -> None:
        if self.expect == "ok":
            self.expect = "either"
        self.names += names
        self.notes.append(note)

    def a_dict(self) -> dict[str, Any]:
        """One of the case's sampling-param dicts (made if there is none) to put a fault in."""
        if isinstance(self.sp_arg, list):
            i = self.r.randrange(len(self.sps))
            self.sps[i] = self.sps[i] if self.sps[i] is not None else {}
            return self.sps[i]
        if self.sp_arg is None:
            self.sp_arg = {}
            self.sps = [self.sp_arg] * len(self.items)
        return self.sp_arg

    def flatten(self) -> None:
        """Drop per-item lists, so that a changed prompt count is the only fault."""
        if isinstance(self.sp_arg, list):
            self.sp_arg = self.sps[0]
        for k in ("rid", "token_ids_logprob"):
            if isinstance(self.extra.get(k), list):
                self.extra.pop(k)

    # -- faults
    def fault(self) -> None:
        r = self.r
        kinds = ["bad_value"] * 8 + ["odd_value", "unknown_key", "non_str_key", "whole_params", "grammars",
                                     "rid", "logprob", "hidden", "inputs", "inputs", "capacity"]
        if self.mode.startswith("stream"):
            kinds += ["stream_many"] * 2
        kind = r.choice(kinds)
        if kind == "bad_value":
            key, value = r.choice(bad_values(self.vocab))
            d = self.a_dict()
            d[key] = value
            if key == "min_new_tokens" and value == 10**9:
                d["max_new_tokens"] = 4
            self.hard(key, note=f"bad {key}")
        elif kind == "odd_value":
            key, value = r.choice(ODD_VALUES)
            self.a_dict()[key] = value
            self.soft(key, note=f"odd {key}")
        elif kind == "unknown_key":
            key = r.choice(UNKNOWN_KEYS)
            self.a_dict()[key] = 1
            self.hard(repr(key), note="unknown key")
        elif kind == "non_str_key":
            self.a_dict()[r.choice(NON_STR_KEYS)] = 1
            self.hard("sampling_params", note="non-string key")
        elif kind == "whole_params":
            choice = r.randrange(4)
            if choice == 0:
                self.sp_arg = r.choice(["temperature=0", 5, 1.5, ("a",), {1, 2}, b"x", True])
            elif choice == 1:       # a list for a lone prompt, or one entry too many for a batch
                base = self.sps[0] if isinstance(self.sps[0], dict) else {}
                self.sp_arg = [dict(base) for _ in range(len(self.items) + (1 if self.batch else 0))]
            elif choice == 2 and self.batch:
                self.sp_arg = [dict(s or {}) for s in self.sps]
                self.sp_arg[r.randrange(len(self.sp_arg))] = r.choice([5, "x", [{}], ()])
            else:
                self.sp_arg = [{}] * (len(self.items) + 1)
            self.hard("sampling_params", note="bad sampling_params")
        elif kind == "grammars":
            d = self.a_dict()
            keys = r.sample(GRAMMAR_KEYS, r.randint(2, 3))
            valid = {"json_schema": SCHEMAS[0], "regex": "[a-z]+", "ebnf": 'root ::= "a"'}
            for k in GRAMMAR_KEYS:
                d.pop(k, None)
            for k in keys:
                d[k] = valid[k]
            self.hard(*keys, note="several grammars")
        elif kind == "rid":
            self.rid_fault()
        elif kind == "logprob":
            self.logprob_fault()
        elif kind == "hidden":
            self.extra["return_hidden_states"] = r.choice([1, "yes", None, 0.0])
            self.hard("return_hidden_states", note="bad return_hidden_states")
        elif kind == "inputs":
            self.inputs_fault()
        elif kind == "capacity":
            self.capacity_case()
        else:  # stream_many: a batch or n > 1 streams every request, chunks tagged with their index
            if r.random() < 0.5:
                self.items = self.items + [self.items[0]]
                self.batch = True
                self.sp_arg = self.sps[0]
            else:
                self.a_dict()["n"] = 2
            self.flatten()
            self.notes.append("stream with several outputs")

    def rid_fault(self) -> None:
        r = self.r
        k = len(self.items)
        choice = r.randrange(5)
        if choice == 0 and k >= 2:   # the same id twice, or one string for several prompts
            self.extra["rid"] = ["same"] * k if r.random() < 0.5 else "same"
            self.hard("rid", note="duplicate rids")
        elif choice == 1:
            self.extra["rid"] = [f"r{i}" for i in range(k + 1)]
            self.hard("rid", note="rid list of the wrong length")
        elif choice == 2 and k >= 2 and not self.mode.startswith("stream"):
            # "c" with n=2 becomes "c-0" and "c-1": the first prompt's own rid "c-0" collides
            base = [dict(s or {}) for s in self.sps]
            for d in base:
                d.pop("n", None)
            base[1]["n"] = 2
            self.sp_arg = self.sps = base
            self.extra["rid"] = ["c-0", "c"] + [f"c{i}" for i in range(2, k)]
            self.hard("rid", note="rid collides with an n>1 sample's rid")
        else:
            self.extra["rid"] = r.choice([5, 1.5, {"a": 1}, b"x", ("a", "b"), "", [None] * k,
                                          [[i] for i in range(k)], [i for i in range(k)], [{"a": i} for i in range(k)]])
            self.soft("rid", note="odd rid")

    def logprob_fault(self) -> None:
        r = self.r
        self.extra["return_logprob"] = True
        choice = r.randrange(4)
        if choice == 0:
            self.extra["top_logprobs_num"] = r.choice([-1, "3", 1.5])
            self.hard("top_logprobs_num", note="bad top_logprobs_num")
        elif choice == 1:
            self.extra["logprob_start_len"] = r.choice([-2, "0", 1.5])
            self.hard("logprob_start_len", note="bad logprob_start_len")
        elif choice == 2:
            self.extra["token_ids_logprob"] = r.choice([[self.vocab], [-1], "abc", [1.5],
                                                        [[1]] * (len(self.items) + 1)])
            self.hard("token_ids_logprob", note="bad token_ids_logprob")
        else:
            key, value = r.choice([("top_logprobs_num", 10**9), ("top_logprobs_num", self.vocab + 5),
                                   ("logprob_start_len", 10**6), ("return_logprob", "yes"),
                                   ("return_logprob", None), ("top_logprobs_num", True)])
            self.extra[key] = value
            self.soft(key, note=f"odd {key}")

    def inputs_fault(self) -> None:
        r = self.r
        choice = r.randrange(10)
        if choice == 0:
            self.extra["both"] = True
            self.hard("prompt", "input_ids", note="prompt and input_ids")
            return
        if choice == 1:
            self.extra["neither"] = True
            self.hard("prompt", "input_ids", note="no prompt")
            return
        if self.kind == "prompt":
            if choice == 2 and self.batch:   # "" may tokenize to nothing: an error naming prompt is fine
                self.items[r.randrange(len(self.items))] = ""
                self.soft("prompt", note="empty prompt in a batch")
                return
            if choice == 3:
                self.items, self.batch = [""], False
                self.flatten()
                self.soft("prompt", note="empty prompt")
                return
            bad = r.choice([5, 1.5, b"hello", {"a": 1}, True, ["a", 5], [], ["ok", "\ud800x"], "\ud800",
                            "a\udfffb", [["nested"]], [None], ("a", None)])
        else:
            bad = r.choice([[-1], [1, 10**9], [2**70], [[1, 2], [-5]], [], [[]], [[1], []], [1.0, 2.0],
                            [True, False], ["a"], [None], [[[1]]], [1, [2]], "abc", 5, {1: 2}, [[1, 2], "ab"]])
        self.items, self.batch = bad, isinstance(bad, (list, tuple)) and not (
            bad and all(isinstance(t, int) for t in bad))
        self.raw_items = True
        self.flatten()
        self.hard(self.kind, note=f"bad {self.kind}")

    def capacity_case(self) -> None:
        """Context and KV-cache edges, on fresh params (no other fault)."""
        r, ctx, vocab = self.r, self.ctx, self.vocab
        self.kind, self.extra = "input_ids", {}
        self.expect, self.names, self.notes = "ok", [], []
        mnt = r.randint(2, 4)    # >= 2: one token over the room is then still under the context
        p: dict[str, Any] = {"max_new_tokens": mnt, "ignore_eos": r.random() < 0.5}
        edges = ["exact", "over_ctx", "over_room"]
        edge = r.choice(edges if self.mode.startswith("stream") else edges + ["kv_batch", "no_limit_n"])

        def ids(k: int) -> list[int]:
            return [r.randrange(vocab) for _ in range(k)]

        self.batch, self.items = False, [ids(ctx - mnt)]
        if edge == "over_ctx":
            self.items = [ids(ctx)]
            self.hard("prompt", "input_ids", note="prompt of exactly the context length")
        elif edge == "over_room":
            self.items = [ids(ctx - mnt + 1)]
            self.hard("max_new_tokens", note="prompt + max_new_tokens one over the context")
        elif edge == "kv_batch":   # 12 requests of ~560 tokens each: 3x the KV cache, must queue
            self.batch, self.items = True, [ids(r.randint(400, 500)) for _ in range(4)]
            p = {"max_new_tokens": 64, "n": 3, "ignore_eos": True, "temperature": 1.0}
            self.notes.append("batch over the KV cache")
        elif edge == "no_limit_n":  # 3 samples up to the context each: more than the KV cache holds
            self.items = [ids(r.randint(1, 300))]
            p = {"max_new_tokens": None, "n": 3, "ignore_eos": True, "temperature": 1.0}
            self.notes.append("n=3 to the context length")
        else:
            self.notes.append("prompt + max_new_tokens == context")
        self.sp_arg, self.sps = p, [p] * len(self.items)

    # -- the case
    def build(self) -> Case:
        kw: dict[str, Any] = {}
        items: Any = self.items if (self.batch or self.raw_items) else self.items[0]
        if self.extra.pop("neither", False):
            pass
        elif self.extra.pop("both", False):
            kw["prompt"], kw["input_ids"] = "hi", [1, 2]
        else:
            kw[self.kind] = items
        kw["sampling_params"] = self.sp_arg
        kw.update(self.extra)
        if self.mode.startswith("stream"):
            kw["stream"] = True
        elif self.mode == "call":
            kw["use_tqdm"] = False
        outs: list[dict[str, Any]] = []
        if isinstance(self.items, list):
            sps = self.sp_arg if isinstance(self.sp_arg, list) else [self.sp_arg] * len(self.items)
            for sp in sps:
                d = sp if isinstance(sp, dict) else {}
                n = d.get("n", 1)
                outs += [d] * (n if isinstance(n, int) and 1 <= n <= 16 else 1)
        return Case(self.idx, kw, self.mode, outs, single=not self.batch, expect=self.expect,
                    names=tuple(dict.fromkeys(self.names)), note="; ".join(self.notes) or "valid")


def make_case(r: random.Random, idx: int, vocab: int, ctx: int, eos: set[int]) -> Case:
    b = _Builder(r, idx, vocab, ctx, eos)
    if r.random() < 0.55:
        b.fault()
    return b.build()


# ---- running and checking ----------------------------------------------------------------------
def _bounded(fn: Callable[[], Any]) -> tuple[str, Any]:
    """fn() on a daemon thread: ('returned', value) | ('raised', exception) | ('hung', None)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            box["error"] = e

    t = threading.Thread(target=target, name="fuzz-case", daemon=True)   # daemon: a hang can't block exit
    t.start()
    t.join(TIMEOUT_S)
    if t.is_alive():
        return "hung", None
    return ("raised", box["error"]) if "error" in box else ("returned", box.get("value"))


def _call(engine: Any, case: Case) -> Any:
    kw = case.kwargs
    if case.mode == "call":
        return engine.generate(**kw)
    if case.mode == "stream":
        return list(engine.generate(**kw))
    if case.mode == "stream_close":   # read one chunk, then hang up: the request is aborted
        it = engine.generate(**kw)
        first = next(it, None)
        it.close()
        return first
    it = engine.generate_iter(**kw)   # iter_close: take the first finished output, abort the rest
    first = next(it, None)
    it.close()
    return first


class Fuzz:
    """The engine under test and what a healthy engine answers."""

    def __init__(self, make_engine: Callable[[], Any]) -> None:
        self.make_engine = make_engine
        self.engine = engine = make_engine()
        info = engine.get_model_info()
        self.vocab, self.ctx = int(info["vocab_size"]), int(info["context_length"])
        eos = engine.hf_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) | {engine.tokenizer.eos_token_id}
        self.eos.discard(None)
        self.canary = engine.generate(*CANARY)["output_ids"]
        self.broken: Optional[str] = None   # set once the engine stops serving (a hang, a dead loop)

    def restart(self) -> None:
        """A fresh engine after one stopped serving (that case already failed), so later cases run."""
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - the old engine is broken; its shutdown may be too
            pass
        self.engine = self.make_engine()
        self.broken = None

    @functools.lru_cache(maxsize=None)
    def cases(self, n: int) -> list[Case]:
        r = random.Random(SEED)
        return [make_case(r, i, self.vocab, self.ctx, self.eos) for i in range(n)]

    def run(self, case: Case) -> list[str]:
        how, value = _bounded(lambda: _call(self.engine, case))
        problems = self.judge(case, how, value)
        if how == "hung":
            self.broken = f"case {case.idx} hung"
            return problems
        stats = self.engine.stats()
        if stats["running"] or stats["waiting"]:
            problems.append(f"after the call returned: running={stats['running']} waiting={stats['waiting']}")
        how, value = _bounded(lambda: self.engine.generate(*CANARY))
        if how != "returned" or value["output_ids"] != self.canary:
            problems.append(f"canary {how}: {_short(value)}; expected output_ids {self.canary}")
            self.broken = f"the canary failed after case {case.idx}"
        return problems

    def judge(self, case: Case, how: str, value: Any) -> list[str]:
        if how == "hung":
            return [f"no answer within {TIMEOUT_S:.0f} s (a hang)"]
        if how == "raised":
            e = value
            text = f"{type(e).__name__}: {str(e)[:300]}"
            if case.expect == "ok":
                return [f"raised {text} (a valid call)"]
            if not isinstance(e, (ValueError, TypeError)):
                return [f"raised {text} (only ValueError / TypeError may)"]
            if not any(name in str(e) for name in case.names):
                return [f"raised {text}, which names none of {list(case.names)}"]
            return []
        if case.expect == "raise":
            return [f"returned {_short(value)[:300]} instead of raising naming {list(case.names)}"]
        try:
            return self.check_outputs(case, value)
        except Exception as e:  # noqa: BLE001 - a malformed output must fail the case, not the chunk
            return [f"malformed output ({type(e).__name__}: {e}): {_short(value)}"]

    def check_outputs(self, case: Case, value: Any) -> list[str]:
        if case.mode == "call":
            if case.single and len(case.outs) == 1:
                if not isinstance(value, dict):
                    return [f"a dict expected, got {type(value).__name__}"]
                value = [value]
            if not isinstance(value, list) or len(value) != len(case.outs):
                return [f"{len(case.outs)} outputs expected, got {_short(value)[:200]}"]
            return [p for o, sp in zip(value, case.outs) for p in self.check_one(o, sp, case.kwargs)]
        if case.mode == "stream":
            if not value or not all(isinstance(c, dict) for c in value):
                return [f"stream gave no chunks or non-dicts: {_short(value)}"]
            if len(case.outs) > 1:    # several requests: each one's chunks carry its index
                if sorted({c.get("index") for c in value}, key=str) != list(range(len(case.outs))):
                    return [f"stream chunks' indexes {sorted({str(c.get('index')) for c in value})} for "
                            f"{len(case.outs)} outputs"]
                return [p for i, sp in enumerate(case.outs)
                        for p in self.check_stream([c for c in value if c["index"] == i], sp, case.kwargs)]
            return self.check_stream(value, case.outs[0], case.kwargs)
        if case.mode == "stream_close":
            if not isinstance(value, dict) or not isinstance(value.get("text"), str):
                return [f"first chunk is not an output dict: {_short(value)}"]
            if value["meta_info"]["finish_reason"] is not None:
                return self.check_one(value, case.outs[value.get("index", 0)], case.kwargs)
            return []
        if not (isinstance(value, tuple) and len(value) == 2 and value[0] in range(len(case.outs))):
            return [f"generate_iter gave {_short(value)}; expected (index < {len(case.outs)}, output)"]
        return self.check_one(value[1], case.outs[value[0]], case.kwargs)

    def check_stream(self, value: list[dict[str, Any]], sp: dict[str, Any], kw: dict[str, Any]) -> list[str]:
        """The chunks of one streamed request: only the last finished, the ids a prefix, the whole valid."""
        early = [c["meta_info"]["finish_reason"] for c in value[:-1]]
        if any(fr is not None for fr in early):
            return [f"a chunk before the last has a finish_reason: {early}"]
        streamed = [t for c in value[:-1] for t in c["output_ids"]]
        final = dict(value[-1], text="".join(c["text"] for c in value))
        if final["output_ids"][:len(streamed)] != streamed:
            return [f"streamed ids {streamed} are not a prefix of the final ids {final['output_ids']}"]
        return self.check_one(final, sp, kw)

    def check_one(self, o: Any, sp: dict[str, Any], kw: dict[str, Any]) -> list[str]:
        """The invariants of one finished output given its sampling params."""
        if not (isinstance(o, dict) and isinstance(o.get("text"), str) and isinstance(o.get("output_ids"), list)
                and isinstance(o.get("meta_info"), dict)):
            return [f"not an output dict: {_short(o)}"]
        ids, meta, bad = o["output_ids"], o["meta_info"], []
        fr = meta.get("finish_reason")
        if not isinstance(fr, dict) or fr.get("type") not in FINISH_TYPES:
            return [f"finish_reason {fr!r}"]
        if fr["type"] == "abort" and not isinstance(fr.get("message"), str):
            bad.append(f"abort without a message: {fr!r}")
        if not all(isinstance(t, int) and 0 <= t < self.vocab for t in ids):
            bad.append(f"output_ids outside the vocabulary: {ids}")
        if meta.get("completion_tokens") != len(ids):
            bad.append(f"completion_tokens {meta.get('completion_tokens')} != {len(ids)} output ids")
        banned = set()
        for k, v in (sp.get("logit_bias") or {}).items() if isinstance(sp.get("logit_bias"), dict) else ():
            if v == -INF:
                banned.add(int(k))
        if banned & set(ids):
            bad.append(f"sampled banned token(s) {sorted(banned & set(ids))} ({len(banned)} banned): ids {ids}")
        mnt = sp.get("max_new_tokens", 128)
        if isinstance(mnt, int) and not isinstance(mnt, bool):
            if len(ids) > mnt or (fr["type"] == "length" and len(ids) != mnt):
                bad.append(f"{len(ids)} tokens with max_new_tokens={mnt}, finish {fr}")
        # ignore_eos turns off every token stop, stop_token_ids too (as SGLang)
        stop_ids = set() if sp.get("ignore_eos") is True else self.eos | {
            int(t) for t in (sp.get("stop_token_ids") or ())}
        early = [t for t in ids[:-1] if t in stop_ids]
        if early:
            bad.append(f"stop id(s) {early} before the end: ids {ids}")
        matched = fr.get("matched")
        # a finished grammar ends on EOS even with ignore_eos (as SGLang: matched = the last token)
        enders = stop_ids | (self.eos if any(sp.get(k) is not None for k in GRAMMAR_KEYS) else set())
        if fr["type"] == "stop" and isinstance(matched, int):
            if matched not in enders or not ids or ids[-1] != matched:
                bad.append(f"stopped on {matched}, stop ids {sorted(stop_ids)}, ids {ids}")
            # a grammar that is complete ends the request, min_new_tokens or not
            if len(ids) < sp.get("min_new_tokens", 0) and not any(sp.get(k) is not None for k in GRAMMAR_KEYS):
                bad.append(f"stopped after {len(ids)} < min_new_tokens={sp['min_new_tokens']} tokens")
        bad += self.check_text(o["text"], fr, sp)
        if kw.get("return_logprob") is True and not bad:
            bad += self.check_logprobs(meta, ids, kw)
        return bad

    @staticmethod
    def check_text(text: str, fr: dict[str, Any], sp: dict[str, Any]) -> list[str]:
        """Grammar prefix and stop-string rules (skipped for aborts and when special tokens show)."""
        if fr["type"] == "abort" or sp.get("skip_special_tokens", True) is not True or sp.get("stop_regex"):
            return []
        bad = []
        grammar = sp.get("regex") or sp.get("ebnf")
        if grammar in PREFIX_OF and not re.fullmatch(PREFIX_OF[grammar], text):
            bad.append(f"text {text!r} leaves the grammar {grammar!r}")
        if sp.get("json_schema") in SCHEMAS and text.strip() and not text.lstrip().startswith("{"):
            bad.append(f"text {text!r} does not start a JSON object")
        stops = sp.get("stop")
        stops = [stops] if isinstance(stops, str) else list(stops or [])
        if sp.get("no_stop_trim") is not True:
            seen = [s for s in stops if isinstance(s, str) and s and s in text]
            if seen:
                bad.append(f"text {text!r} contains stop string(s) {seen}")
        return bad

    def check_logprobs(self, meta: dict[str, Any], ids: list[int], kw: dict[str, Any]) -> list[str]:
        lps = meta.get("output_token_logprobs")
        if not isinstance(lps, list) or len(lps) != len(ids):
            return [f"output_token_logprobs {_short(lps)[:200]} for {len(ids)} ids"]
        bad = [f"logprob entry {e!r} for id {t}" for e, t in zip(lps, ids)
               if not (isinstance(e[0], float) and not math.isnan(e[0]) and e[0] <= 1e-4 and e[1] == t)]
        k = kw.get("top_logprobs_num", 0)
        if isinstance(k, int) and not isinstance(k, bool) and k > 0:
            tops = meta.get("output_top_logprobs")
            if not isinstance(tops, list) or len(tops) != len(ids):
                bad.append(f"output_top_logprobs has {len(tops) if isinstance(tops, list) else tops} rows "
                           f"for {len(ids)} ids")
            elif any(len(row) != min(k, self.vocab) for row in tops):
                bad.append(f"top-logprob rows of {sorted({len(row) for row in tops})} entries for "
                           f"top_logprobs_num={k}")
        return bad[:3]


# ---- tests -------------------------------------------------------------------------------------
def _n_cases(config: pytest.Config) -> int:
    return int(config.getoption("--fuzz-cases", default=300))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "chunk" in metafunc.fixturenames:
        n = _n_cases(metafunc.config)
        chunks = list(range(math.ceil(n / CHUNK)))
        metafunc.parametrize("chunk", chunks, ids=[f"cases{c * CHUNK}-{min(n, (c + 1) * CHUNK) - 1}" for c in chunks])


@pytest.fixture(scope="module")
def fuzz(tiny_llama_dir: str) -> Iterator[Fuzz]:
    # a small KV cache (2x the context) so that batches and n > 1 run out of pages
    f = Fuzz(lambda: nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", random_seed=0,
                                  max_total_tokens=2048))
    try:
        yield f
    finally:
        f.engine.shutdown()


def test_fuzz_generate(fuzz: Fuzz, chunk: int, request: pytest.FixtureRequest) -> None:
    if fuzz.broken:     # reported by the chunk where it happened
        fuzz.restart()
    cases = fuzz.cases(_n_cases(request.config))[chunk * CHUNK:(chunk + 1) * CHUNK]
    failures = []
    for case in cases:
        problems = fuzz.run(case)
        if problems:
            failures.append(f"{case!r}\n    -> " + "\n    -> ".join(problems))
        if fuzz.broken:
            failures.append(f"stopped: {fuzz.broken}")
            break
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)


# ---- pinned cases: rare in the random stream, checked on every run ------------------------------
HOT = 1e300   # a finite temperature as a Python float, inf in float32
PINNED: dict[str, tuple[Any, dict[str, Any], Any, tuple[str, ...]]] = {
    # name: (prompt, sampling_params (logit_bias "all" = every token -inf), rid, names an error may give)
    "ban_all": ("hi", {"max_new_tokens": 4, "logit_bias": "all"}, None, ("logit_bias",)),
    "ban_all_regex": ("hi", {"max_new_tokens": 4, "regex": "[a-z]+", "logit_bias": "all"}, None,
                      ("logit_bias", "regex")),
    "huge_temperature_ban": ("hi", {"temperature": HOT, "max_new_tokens": 6, "logit_bias": {"5": -INF}}, None,
                             ("temperature",)),
    "huge_temperature_min_new_tokens": ("hi", {"temperature": HOT, "max_new_tokens": 6, "min_new_tokens": 6},
                                        None, ("temperature",)),
    "rid_dict": ("hi", {"max_new_tokens": 2}, {"a": 1}, ("rid",)),
    "rid_lists": (["a", "b"], {"max_new_tokens": 2}, [[0], [1]], ("rid",)),
    "rid_dict_n3": ("def", {"max_new_tokens": 4, "n": 3}, [{"a": 0}], ("rid",)),
}


def pinned_case(name: str, vocab: int) -> Case:
    prompt, sp, rid, names = PINNED[name]
    sp = dict(sp)
    if sp.get("logit_bias") == "all":
        sp["logit_bias"] = {t: -INF for t in range(vocab)}
    kw: dict[str, Any] = {"prompt": prompt, "sampling_params": sp}
    if rid is not None:
        kw["rid"] = rid
    kw["use_tqdm"] = False
    outs = [sp] * (len(prompt) if isinstance(prompt, list) else 1) * sp.get("n", 1)
    return Case(f"pinned:{name}", kw, "call", outs, single=isinstance(prompt, str), expect="either",
                names=names, note=name)


@pytest.mark.parametrize("name", list(PINNED))
def test_pinned_case(fuzz: Fuzz, name: str) -> None:
    if fuzz.broken:
        fuzz.restart()
    case = pinned_case(name, fuzz.vocab)
    problems = fuzz.run(case)
    assert not problems, f"{case!r}\n    -> " + "\n    -> ".join(problems)
