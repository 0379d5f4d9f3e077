"""The two typed hand-offs of a step: scheduler -> runner (ScheduledBatch), runner -> scheduler (StepOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nbgen.core.request import Request


@dataclass(slots=True)   # made for every row of every step: slots make it cheaper to build and read
class SeqWork:
    """One request's share of a step."""

    req: Request            # read-only for the runner (sampling params, output ids for penalties, seed)
    token_ids: list[int]    # tokens to run now: all_ids[start_pos : start_pos + len(token_ids)]
    start_pos: int          # position of token_ids[0]; tokens [0, start_pos) already have KV in `pages`
    pages: list[int]        # page table covering at least start_pos + len(token_ids) tokens
    sample: bool            # this chunk reaches the end of all_ids: sample the next token
    prompt_logprob_start: int = -1  # >= 0: return logprobs of the prompt tokens at positions
                                    # [max(start, 1), end of chunk] (prediction from the previous position)
    tree_parents: Optional[list[int]] = None  # a tree verify chunk (runtime/spec_tree.py): each token's
                                    # parent row in token_ids (-1 for the first); a token sees the cached
                                    # prefix and its ancestors only, at position start_pos + its depth

    @property
    def q_len(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        return self.start_pos + len(self.token_ids)

    def tree_depths(self) -> list[int]:
        """Depth of each token of a tree chunk (the first is 0); parents come before their children."""
        assert self.tree_parents is not None
        d: list[int] = []
        for p in self.tree_parents:
            d.append(d[p] + 1 if p >= 0 else 0)
        return d

    @property
    def out_index(self) -> int:
        """Index in req.output_ids of the token this seq samples (independent of when the
        scheduler appends it: overlap scheduling may apply a step before sampling it)."""
        return self.start_pos + len(self.token_ids) - len(self.req.prompt_ids)


@dataclass
class ScheduledBatch:
    """Everything the runner needs for one forward step, in a fixed order."""

    seqs: list[SeqWork]                 # prefill chunks and decodes, any mix
    page_size: int

    # (the properties below read len(token_ids) directly: they walk every row of a step)
    @property
    def num_tokens(self) -> int:
        return sum([len(s.token_ids) for s in self.seqs])

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens of the step: everything but one-token decodes."""
        return sum([n for s in self.seqs if (n := len(s.token_ids)) > 1 or not s.sample])

    @property
    def is_decode_only(self) -> bool:
        return all([len(s.token_ids) == 1 for s in self.seqs])    # q_len inlined: runs every step


@dataclass
class TokenLogprobs:
    """Logprob results of one position: chosen token, top-k, and requested ids."""

    logprob: float
    token_id: int
    top: list[tuple[float, int]] = field(default_factory=list)      # [(logprob, id)] best first
    ids: list[tuple[float, int]] = field(default_factory=list)      # for token_ids_logprob


@dataclass
class HiddenRows:
    """Final-normed last-layer states of one seq's consecutive positions ``first, first + 1, ...``:
    the ones of this step its request still needs (``Request.next_hidden_position`` on)."""

    first: int
    rows: list[list[float]]      # [positions][hidden]


@dataclass
class StepOutput:
    """The runner's answer for one ScheduledBatch; lists are aligned with batch.seqs."""

    next_token_ids: list[int]                              # sampled id, or -1 where seq.sample is False
    output_logprobs: list[Optional[TokenLogprobs]]         # for sampled seqs that asked for logprobs
    prompt_logprobs: list[Optional[list[TokenLogprobs]]]   # per seq: prompt positions of this chunk
    errors: dict[int, str] = field(default_factory=dict)   # seq index -> message: abort that request only
    hidden_states: Optional[list[Optional[HiddenRows]]] = None   # per seq, where its request wants them
    # embedding requests (runtime/embed_step.py), per seq: the pooling state after this chunk, and
    # on the chunk that completes the prompt the finished vector (None for other seqs)
    pool_states: Optional[list] = None
    embeddings: Optional[list[Optional[list[float]]]] = None
    # speculative decoding (runtime/spec_step.py), per seq: the draft tokens accepted before
    # next_token_ids[i], in order, and their logprobs (None entries where not asked for)
    accepted: Optional[list[list[int]]] = None
    accepted_logprobs: Optional[list[list[Optional[TokenLogprobs]]]] = None
