"""Speculative decoding settings (SGLang's ``speculative_*`` server args), validated once.

nbgen drafts chains (one candidate per position, SGLang's ``speculative_eagle_topk=1``), and
EAGLE / EAGLE3 also trees (``speculative_eagle_topk > 1``, runtime/spec_tree*.py):

- ``"NGRAM"``: prompt lookup. The longest recent match (at most ``speculative_ngram_max_trie_depth``
  tokens) of the sequence's own suffix in its earlier context proposes the tokens that followed it;
  ``speculative_num_draft_tokens`` tokens are verified per step (the last sampled one + the drafts).
- ``"STANDALONE"``: a small draft model with the same tokenizer (``speculative_draft_model_path``)
  proposes ``speculative_num_steps`` tokens autoregressively; ``speculative_num_draft_tokens`` is
  ``speculative_num_steps + 1`` (SGLang adjusts it the same way for chains).
- ``"EAGLE"`` / ``"EAGLE3"``: an EAGLE head (``speculative_draft_model_path``: SGLang's
  ``LlamaForCausalLMEagle`` / ``LlamaForCausalLMEagle3`` checkpoints) drafts from the target's hidden
  states; steps and draft tokens as STANDALONE. With ``speculative_eagle_topk = k > 1`` each of
  the ``speculative_num_steps`` draft steps expands the k best leaves by k children, and the
  ``speculative_num_draft_tokens - 1`` best nodes (cumulative draft probability) are verified as a
  tree together with the last sampled token; ``speculative_num_draft_tokens`` is then required (as
  SGLang, which sets the three together) and at most ``k + (steps - 1) * k * k + 1``.

Speculation is one mode per engine, as SGLang: every generate request of the engine is drafted.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
NOT_YET = ("NEXTN", "MTP")
NGRAM_DRAFT_TOKENS = 8            # default verify width of NGRAM (the last token + 7 drafts)
STANDALONE_STEPS = 3              # SGLang's auto choice for chains: 3 steps, topk 1, 4 draft tokens


@dataclass(frozen=True)
class SpecConfig:
    """The resolved speculative settings of an engine (``SpecConfig.of(cfg)``; None when off)."""

    algorithm: str                     # "NGRAM" | "STANDALONE" | "EAGLE" | "EAGLE3"
    num_draft_tokens: int              # tokens verified per step: the last sampled one + drafts
    num_steps: int                     # STANDALONE: draft-model steps per verify (= drafts)
    draft_model_path: Optional[str]    # STANDALONE: the draft model
    ngram_max_match: int               # NGRAM: longest suffix matched against earlier context
    topk: int = 1                      # EAGLE: children per expanded node (> 1: tree drafts)

    @property
    def max_drafts(self) -> int:
        return self.num_draft_tokens - 1

    @classmethod
    def of(cls, cfg: Any) -> Optional["SpecConfig"]:
        """The settings of an EngineConfig (anything with the ``speculative_*`` fields), validated;
        None without ``speculative_algorithm``. Invalid values raise ValueError naming the argument."""
        algo = cfg.speculative_algorithm
        if algo is None:
            return None
        if not isinstance(algo, str):
            raise ValueError(f"speculative_algorithm must be None or a str, got {algo!r}")
        algo = algo.upper()
        if algo in NOT_YET:
            raise ValueError(f"speculative_algorithm is not supported yet by nbgen for {algo!r}; "
                             f"use one of {ALGORITHMS}")
        if algo not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be None or one of {ALGORITHMS}, got {algo!r}")
        for name in ("speculative_num_steps", "speculative_num_draft_tokens", "speculative_eagle_topk"):
            v = getattr(cfg, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
        topk = cfg.speculative_eagle_topk or 1
        if topk > 1 and algo not in ("EAGLE", "EAGLE3"):
            raise ValueError(f"speculative_eagle_topk={topk}: tree drafts are for EAGLE / EAGLE3 in nbgen; "
                             f"{algo} drafts chains (speculative_eagle_topk=1)")
        depth = cfg.speculative_ngram_max_trie_depth
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"speculative_ngram_max_trie_depth must be an int >= 1, got {depth!r}")
        if cfg.is_embedding:
            raise ValueError("speculative_algorithm does not apply to an embedding engine (is_embedding=True)")
        path = cfg.speculative_draft_model_path
        if algo == "NGRAM":
            if path is not None:
                raise ValueError("speculative_draft_model_path is for STANDALONE; NGRAM drafts from the context")
            n = cfg.speculative_num_draft_tokens or NGRAM_DRAFT_TOKENS
            if n < 2:
                raise ValueError(f"speculative_num_draft_tokens must be >= 2 for NGRAM, got {n}")
            return cls("NGRAM", n, n - 1, None, depth)
        if not isinstance(path, str) or not path:
            raise ValueError(f"speculative_algorithm={algo!r} needs speculative_draft_model_path "
                             "(a draft model or EAGLE head for the target's tokenizer)")
        steps = cfg.speculative_num_steps or STANDALONE_STEPS
        n = cfg.speculative_num_draft_tokens
        if topk > 1:
            most = topk + (steps - 1) * topk * topk + 1
            if n is None or not 2 <= n <= most:
                raise ValueError(f"speculative_num_draft_tokens must be set for tree drafts (speculative_eagle_topk="
                                 f"{topk}) and lie in [2, {most}] (the root + the {most - 1} candidates of "
                                 f"{steps} steps), got {n!r}")
            return cls(algo, n, steps, path, depth, topk)
        if n is not None and n != steps + 1:
            warnings.warn(f"speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 = {steps + 1} "
                          "for chain drafts", UserWarning, stacklevel=4)
        return cls(algo, steps + 1, steps, path, depth)
