"""Sampling parameters (SGLang names and defaults), normalised and validated at the edge."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

from nbgen.core.config import unknown_key_error
from nbgen.core.errors import ArgumentTypeError


def _num(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number, got {v!r}")
    if math.isnan(v):
        raise ValueError(f"{name} must not be NaN, got {v!r}")
    return float(v)


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ArgumentTypeError(f"{name} must be an int, got {v!r}")
    return int(v)


# temperatures below this sample as greedy (SGLang's rule): dividing logits by ~0 overflows to inf
GREEDY_TEMPERATURE = 1e-6
# the structured-output parameters; at most one per request
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# the largest finite float32: a larger logit bias is +inf in the logits
FLOAT32_MAX = 3.4028234663852886e38
# samples per prompt (n): each is a request holding a copy of its prompt until it finishes
MAX_N = 4096
# parameters whose None means "the default" (SGLang's SamplingParams accepts None for these)
NONE_MEANS_DEFAULT = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                      "repetition_penalty", "min_new_tokens", "n", "ignore_eos", "skip_special_tokens",
                      "spaces_between_special_tokens", "no_stop_trim")


def check_text(text: str, name: str) -> None:
    """ValueError when ``text`` cannot be encoded as UTF-8 (a lone surrogate), naming its position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: {text[e.start]!r} (a lone surrogate) at "
                         f"character {e.start}") from None


@functools.lru_cache(maxsize=None)
def _init_names(cls: type) -> dict[str, None]:
    """The dataclass's constructor argument names, in order (looked up once per class)."""
    return dict.fromkeys(f.name for f in fields(cls) if f.init)


@functools.lru_cache(maxsize=None)
def _defaults(cls: type) -> dict[str, Any]:
    """The dataclass's plain field defaults by name (looked up once per class)."""
    return {f.name: f.default for f in fields(cls) if f.init}


@dataclass
class SamplingParams:
    """How to sample one request. ``temperature=0`` means greedy.

    A generated token's logprobs are SGLang's: the log-softmax of the logits after logit_bias,
    penalties, min_new_tokens and the grammar mask, divided by the temperature (greedy: not
    divided), before top-k/top-p/min-p (docs/api.md, Output dict).
    """

    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: Optional[dict[int, float]] = None
    sampling_seed: Optional[int] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    custom_params: Optional[dict[str, Any]] = None
    stream_interval: Optional[int] = None    # stream chunks every N tokens (None: the Engine's stream_interval)
    stop_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in NONE_MEANS_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, _defaults(type(self))[name])
        if self.max_new_tokens is not None:
            self.max_new_tokens = _int("max_new_tokens", self.max_new_tokens)
            if self.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        self.min_new_tokens = _int("min_new_tokens", self.min_new_tokens)
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_new_tokens}")
        self.temperature = _num("temperature", self.temperature)
        if self.temperature < 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:   # as SGLang: a tiny temperature is greedy
            self.temperature = 0.0
        self.top_p = _num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        self.min_p = _num("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = _num(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
            setattr(self, name, v)
        self.repetition_penalty = _num("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        self.n = _int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        self.stop_strs = self._str_list("stop", self.stop)
        self._str_list("stop_regex", self.stop_regex)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple, set)):
                raise ArgumentTypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            # None entries are dropped and an empty list means none (as SGLang)
            self.stop_token_ids = [_int("stop_token_ids", t) for t in self.stop_token_ids if t is not None] or None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ArgumentTypeError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tok = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                bias[tok] = _num(f"logit_bias[{k!r}]", v)
                if bias[tok] > FLOAT32_MAX:   # +inf in the float32 logits: NaN probabilities
                    raise ValueError(f"logit_bias[{k!r}] must be at most {FLOAT32_MAX:.4g} (float32) or -inf "
                                     f"(a ban), got {v!r}")
            self.logit_bias = bias
        if self.sampling_seed is not None:
            self.sampling_seed = _int("sampling_seed", self.sampling_seed)
        if self.stream_interval is not None:
            self.stream_interval = _int("stream_interval", self.stream_interval)
            if self.stream_interval < 1:
                raise ValueError(f"stream_interval must be None or an int >= 1, got {self.stream_interval}")
        grammars = [n for n in GRAMMAR_KINDS if getattr(self, n) is not None]
        if len(grammars) > 1:
            raise ValueError(f"only one of json_schema, regex, ebnf, structural_tag may be set, got {grammars}")
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentTypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @staticmethod
    def _str_list(name: str, v: Any) -> list[str]:
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise ArgumentTypeError(f"{name} must be a non-empty string or a list of them, got {v!r}")
        for i, s in enumerate(items):
            if not s:   # an empty stop would match before any text: a value error, not a type error
                raise ValueError(f"{name} must be a non-empty string or a list of them, got {v!r}")
            check_text(s, f"{name}[{i}]")
        return list(items)

    @property
    def constrained(self) -> bool:
        """A grammar (json_schema / regex / ebnf / structural_tag) constrains the output."""
        return any(getattr(self, n) is not None for n in GRAMMAR_KINDS)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no logit processing at all (bias, penalties): the raw logits' argmax.
        (min_new_tokens and grammars depend on the request's state; the sampler checks those.)"""
        return (self.greedy and not self.logit_bias and self.repetition_penalty == 1.0
                and not self.frequency_penalty and not self.presence_penalty)

    @property
    def plain_temperature(self) -> bool:
        """A draw from the raw logits / temperature: no top-k / top-p / min-p cut, no logit processing.
        (min_new_tokens and grammars depend on the request's state; the sampler checks those.)"""
        return (not self.greedy and self.top_k == -1 and self.top_p == 1.0 and self.min_p == 0.0
                and not self.logit_bias and self.repetition_penalty == 1.0
                and not self.frequency_penalty and not self.presence_penalty)

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "SamplingParams":
        """Build from a user dict; an unknown key raises naming it, with a close match."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
        if not isinstance(d, dict):
            raise ArgumentTypeError(f"sampling_params must be a dict, got {type(d).__name__}")
        known = _init_names(cls)
        for key in d:
            if not isinstance(key, str):
                raise ValueError(f"sampling_params names must be strings, got the key {key!r}")
            if key not in known:
                raise unknown_key_error("sampling param", key, list(known))
        return cls(**d)

    def verify(self, vocab_size: int) -> None:
        """Checks that need the model: token ids inside the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids or []),
                          ("logit_bias", list((self.logit_bias or {}).keys()))):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if self.logit_bias and sum(v == -math.inf for v in self.logit_bias.values()) >= vocab_size:
            raise ValueError("logit_bias bans every token of the vocabulary (-inf on all of them)")


from nbgen.core.logit_processor import CustomLogitProcessor  # noqa: E402,F401  (SGLang's import site)
