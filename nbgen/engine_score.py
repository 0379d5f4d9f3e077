"""SGLang's ``score``: probabilities of label tokens right after each query+item prompt.

The zero-shot classification workhorse: one prefill per (query, item) pair, batched like any
generate() call, reading the logprobs of ``label_token_ids`` at the position after the prompt
(a greedy token's: the raw log-softmax of the model's logits). ``apply_softmax=True`` renormalises
over the labels; otherwise each label gets its own probability ``exp(logprob)``.

``score`` / ``async_score`` answer a :class:`ScoreResult`: SGLang's ``ScoreResult(scores, prompt_tokens)``
fields, and a list of the per-item score lists itself, so code reading ``result.scores`` and code
indexing ``result[i]`` (SGLang's releases before the dataclass) both run.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Optional, Sequence, Union

Ids = list[int]


class ScoreResult(list):
    """One list of label probabilities per item (this list), with SGLang's ``scores`` and
    ``prompt_tokens`` (the prompt tokens of every query+item prompt together)."""

    def __init__(self, scores: list[list[float]], prompt_tokens: int) -> None:
        super().__init__(scores)
        self.prompt_tokens = prompt_tokens

    @property
    def scores(self) -> list[list[float]]:
        """The per-item score lists (SGLang's field)."""
        return list(self)


def _result(outs: list[dict[str, Any]], labels: list[int], apply_softmax: bool) -> ScoreResult:
    return ScoreResult([label_scores(o, labels, apply_softmax) for o in outs],
                       sum(o["meta_info"].get("prompt_tokens", 0) for o in outs))


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def score_inputs(query: Union[str, Ids, None], items: Union[str, Sequence[str], Sequence[Ids], None],
                 item_first: bool) -> tuple[str, list[Any]]:
    """("prompt", texts) or ("input_ids", id lists): query and items joined in SGLang's order;
    ("prompt", []) for empty items (SGLang answers them with no scores)."""
    if items is None:
        raise ValueError("items must be provided (a str, a list of str or a list of token-id lists)")
    if isinstance(items, (str, list)) and not items:
        return "prompt", []
    if isinstance(query, str) and (isinstance(items, str) or (
            isinstance(items, list) and items and all(isinstance(i, str) for i in items))):
        texts = [items] if isinstance(items, str) else list(items)
        return "prompt", [f"{i}{query}" if item_first else f"{query}{i}" for i in texts]
    if _is_ids(query) and isinstance(items, list) and items and all(_is_ids(i) for i in items):
        return "input_ids", [list(i) + list(query) if item_first else list(query) + list(i) for i in items]
    raise ValueError("score() takes a str query with str items, or a token-id query with token-id items; "
                     f"got query={type(query).__name__}, items={type(items).__name__}")


def check_labels(label_token_ids: Any, vocab_size: int) -> list[int]:
    """The label ids, validated (a ValueError names ``label_token_ids``)."""
    if label_token_ids is None:
        raise ValueError("label_token_ids must be provided")
    if not _is_ids(label_token_ids) or not label_token_ids:
        raise ValueError(f"label_token_ids must be a non-empty list of token ids, got {label_token_ids!r:.80}")
    bad = [t for t in label_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"label_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return list(label_token_ids)


def label_scores(output: dict[str, Any], labels: list[int], apply_softmax: bool) -> list[float]:
    """One prompt's label probabilities from its output's first-token id logprobs."""
    rows = output["meta_info"].get("output_token_ids_logprobs") or [[]]
    got = {tid: lp for lp, tid, _ in rows[0]}
    lps = [got.get(t, -math.inf) for t in labels]
    if apply_softmax:
        top = max(lps)
        if top == -math.inf:
            return [1.0 / len(lps)] * len(lps)
        exps = [math.exp(v - top) for v in lps]
        total = sum(exps)
        return [e / total for e in exps]
    return [math.exp(v) if v != -math.inf else 0.0 for v in lps]


class ScoreMixin:
    """score() / async_score() for Engine (uses its generate / async_generate and vocab size)."""

    def _score_request(self, query: Any, items: Any, label_token_ids: Any,
                       item_first: bool) -> tuple[dict[str, Any], list[int]]:
        labels = check_labels(label_token_ids, self.get_model_info()["vocab_size"])
        kind, inputs = score_inputs(query, items, item_first)
        # one new token, sampled greedily, carries the label logprobs of the position after the prompt;
        # repetition_penalty 1.0 overrides a generation_config default, which would penalise labels
        # present in the prompt (SGLang's penalties count output tokens only: none before the first)
        sp = {"max_new_tokens": 1, "temperature": 0.0, "repetition_penalty": 1.0}
        kw = {kind: inputs, "sampling_params": sp,
              "return_logprob": True, "token_ids_logprob": labels}
        return kw, labels

    def score(self, query: Optional[Union[str, Ids]] = None,
              items: Optional[Union[str, list[str], list[Ids]]] = None,
              label_token_ids: Optional[list[int]] = None, apply_softmax: bool = False,
              item_first: bool = False) -> ScoreResult:
        """Probability of each label token after ``query + item`` (``item + query`` with item_first),
        one list per item in order (a :class:`ScoreResult`, with ``.scores`` and ``.prompt_tokens``);
        ``apply_softmax`` normalises over the labels. Empty ``items`` give no scores."""
        kw, labels = self._score_request(query, items, label_token_ids, item_first)
        outs = self.generate(use_tqdm=False, **kw) if kw.get("prompt") != [] else []
        return _result(outs, labels, apply_softmax)

    def score_iter(self, query: Optional[Union[str, Ids]] = None,
                   items: Optional[Union[str, list[str], list[Ids]]] = None,
                   label_token_ids: Optional[list[int]] = None, apply_softmax: bool = False,
                   item_first: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(item index, {"scores": [...], "meta_info": {...}})`` as each item finishes; an
        aborted request has ``scores`` None and its abort in ``meta_info["finish_reason"]``.
        Closing early aborts the rest."""
        kw, labels = self._score_request(query, items, label_token_ids, item_first)
        if kw.get("prompt") == []:
            return
        for i, out in self.generate_iter(**kw):
            fr = out["meta_info"].get("finish_reason") or {}
            ok = fr.get("type") != "abort"
            yield i, {"scores": label_scores(out, labels, apply_softmax) if ok else None,
                      "meta_info": out["meta_info"]}

    async def async_score(self, query: Optional[Union[str, Ids]] = None,
                          items: Optional[Union[str, list[str], list[Ids]]] = None,
                          label_token_ids: Optional[list[int]] = None, apply_softmax: bool = False,
                          item_first: bool = False) -> ScoreResult:
        """Awaitable twin of score()."""
        kw, labels = self._score_request(query, items, label_token_ids, item_first)
        outs = await self.async_generate(**kw) if kw.get("prompt") != [] else []
        return _result(outs, labels, apply_softmax)
