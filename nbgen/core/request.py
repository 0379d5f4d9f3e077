"""Per-request state owned by the loop thread (scheduler, runner and detokenizer read it)."""
from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from nbgen.core.finish import FinishReason
from nbgen.core.sampling import SamplingParams
from nbgen.core.session import SessionParams


class Status(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted and waiting to recompute)
    RUNNING = "running"      # holds pages; prefilling or decoding
    FINISHED = "finished"


@dataclass
class LogprobRequest:
    """What logprobs a request wants (SGLang's generate() arguments)."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1          # -1: no prompt logprobs; k: prompt positions >= k
    token_ids_logprob: Optional[list[int]] = None
    return_text_in_logprobs: bool = False  # fill the text of each (logprob, id, text) triple


POOLING_MODES = ("last", "mean", "cls")


@dataclass(frozen=True)
class EmbedRequest:
    """What an embedding request wants: how its prompt's final hidden states become one vector.

    ``pooling``: "last" (the last token's state), "mean" (over every prompt token) or "cls" (the
    first token's); ``dimensions``: keep the first k components (Matryoshka) before ``normalize``
    (L2). Only "last" may reuse cached prefix pages: the others need every position's state.
    """

    pooling: str = "last"
    normalize: bool = True
    dimensions: Optional[int] = None

    @property
    def reuses_prefix(self) -> bool:
        return self.pooling == "last"


@dataclass(eq=False)   # identity: ``req in running`` / ``running.remove(req)`` compare pointers, not fields
class Request:
    """One sequence to generate. ``n > 1`` becomes n Requests sharing a ``group``."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()   # EOS ids of the model + params.stop_token_ids (none: ignore_eos)
    logprobs: LogprobRequest = field(default_factory=LogprobRequest)
    seed: int = 0                            # per-request RNG seed (sampling_seed or drawn at submit)
    group: Optional[str] = None              # samples of one prompt share a group (prefix sharing)
    arrival: float = field(default_factory=time.perf_counter)
    logit_processor: Optional[Any] = None    # custom logit processor instance (caller-supplied code)
    return_hidden_states: bool = False       # collect final-normed last-layer states (SGLang's shape)
    embed: Optional[EmbedRequest] = None     # an embedding request: prefill only, pooled, never sampled
    weight_version: str = "default"          # the weights it runs with (set when the loop admits it)
    session: Optional[SessionParams] = None  # its place in an engine session (runtime/sessions.py)
    priority: Optional[int] = None           # generate(priority=...); set to the default at add (priority scheduling)
    lora_id: Optional[int] = None            # the LoRA adapter it runs under (runtime/lora.py); None = base model
    images: Optional[Any] = None             # ImageInputs (core/multimodal.py): image_data of a vision model
    rope_delta: int = 0                      # M-RoPE: output position p runs at p + rope_delta (images.rope_delta)

    # --- mutable state (loop thread only) ---
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0                    # tokens of all_ids whose KV is in the cache
    pages: list[int] = field(default_factory=list)  # page table: page i holds tokens [i*P, (i+1)*P)
    num_cached_pages: int = 0                # leading pages that came from / are in the prefix cache
    cached_tokens: int = 0                   # prompt tokens served from the prefix cache (first admit)
    admit_seq: int = -1                      # admission order (preemption picks the newest)
    arrival_seq: int = -1                    # arrival order at the scheduler (priority: the oldest waiting)
    priority_promoted: bool = False          # admitted by the starvation guard: never preempted for priority
    num_retractions: int = 0                 # times it was preempted (SGLang's meta_info num_retractions)
    # the output count from which ``end_after`` ends it whatever the token (``length_limit``, kept by
    # the scheduler at add): a step asks ``end_after`` only for a stop id or from there on; 0: always
    end_len: int = 0
    # no step of it needs its token values on the host before the next step (runtime/overlap.py
    # looks at its fixed needs once, when it first runs); None: not looked at yet
    overlaps: Optional[bool] = None
    finish_reason: Optional[FinishReason] = None
    # logprob results, appended by the scheduler from StepOutputs
    input_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    prompt_logprobs_done: bool = False
    grammar: Optional[Any] = None            # GrammarState (json_schema / regex / ebnf), set before admission
    # SGLang's meta_info["hidden_states"]: [0] the prompt's states [prompt_len][hidden] (filled chunk
    # by chunk), then [k] the state [hidden] of the position that produced output token k
    hidden_states: list[Any] = field(default_factory=list)
    # the sampler's per-request "token from the raw logits alone" kind ("argmax", "draw" from the logits /
    # temperature, "" neither), set at its first step (params, logprobs, processor and grammar are fixed
    # by then); min_new_tokens is checked per step
    raw_kind: Optional[str] = None
    # embedding requests: the pooling state of the prompt computed so far (runtime/pooling.py; a
    # device tensor, e.g. mean pooling's running sum), then the finished vector
    pool_state: Optional[Any] = None
    embedding: Optional[list[float]] = None
    # speculative decoding (runtime/spec_step.py): decode steps it verified in, drafts proposed and
    # accepted, and spec_histogram[k] = verify steps that accepted k drafts (SGLang's meta_info)
    spec_verify_ct: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_histogram: list[int] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.logprobs.logprob_start_len >= 0 and not self.prompt_logprobs_done

    def next_hidden_position(self) -> int:
        """The first position whose hidden state is not collected yet (return_hidden_states)."""
        n_prompt = len(self.prompt_ids)
        if not self.hidden_states or len(self.hidden_states[0]) < n_prompt:
            return len(self.hidden_states[0]) if self.hidden_states else 0
        return n_prompt + len(self.hidden_states) - 1

    def add_hidden_states(self, first: int, rows: list[list[float]]) -> None:
        """Record the states of positions ``first, first + 1, ...``; positions collected already
        (a recomputed chunk) are skipped."""
        n_prompt = len(self.prompt_ids)
        for pos, row in enumerate(rows, first):
            if pos != self.next_hidden_position():
                continue
            if pos < n_prompt:
                if not self.hidden_states:
                    self.hidden_states.append([])
                self.hidden_states[0].append(row)
            else:
                self.hidden_states.append(row)

    def add_output_logprob(self, lp: Any) -> None:
        """Record the logprobs (a ``batch.TokenLogprobs``) of the output token just placed."""
        self.output_token_logprobs.append((lp.logprob, lp.token_id))
        self.output_top_logprobs.append(lp.top)
        self.output_ids_logprobs.append(lp.ids)

    def add_prompt_logprobs(self, lps: Optional[list[Any]], prompt_done: bool) -> None:
        """Record a prompt chunk's logprobs (``batch.TokenLogprobs`` per position; None for a chunk
        before ``logprob_start_len``); ``prompt_done``: the chunk completed the prompt."""
        for lp in lps or ():
            self.input_token_logprobs.append((lp.logprob, lp.token_id))
            self.input_top_logprobs.append(lp.top)
            self.input_ids_logprobs.append(lp.ids)
        if prompt_done:
            self.prompt_logprobs_done = True

    def set_pooled(self, state: Any, embedding: Any = None) -> None:
        """An embedding request's pooling state after a prompt chunk, or its vector once complete."""
        if embedding is not None:
            self.embedding, self.pool_state = embedding, None
        else:
            self.pool_state = state

    def trim_output(self, n: int) -> None:
        """Keep the first ``n`` output tokens (and their logprobs): a stop string matched inside a
        speculative step's accepted run, where plain decoding would have stopped."""
        for lst in (self.output_ids, self.output_token_logprobs, self.output_top_logprobs,
                    self.output_ids_logprobs):
            del lst[n:]

    def length_limit(self, context_length: Optional[int] = None) -> int:
        """The number of output tokens at which ``end_after`` returns "length" for any token:
        ``max_new_tokens``, or fewer where the context length ends the request first."""
        p, lim = self.params, sys.maxsize
        if p.max_new_tokens is not None:
            lim = p.max_new_tokens
        if context_length is not None:
            lim = min(lim, context_length - len(self.prompt_ids))
        return lim

    def end_after(self, tok: int, n_out: int, context_length: Optional[int] = None) -> Optional[FinishReason]:
        """The stop check: the finish reason once ``tok``, the ``n_out``-th output token, was
        generated, or None to go on. A stop id ends the request once ``min_new_tokens`` are out;
        then ``max_new_tokens``, then the context length (when given) end it with "length".
        The one place this is decided: the scheduler's update calls it with the sampled token,
        the overlap stepper with each token it resolves (its length was counted at update)."""
        p = self.params
        if tok in self.stop_ids and n_out >= p.min_new_tokens:
            return FinishReason.stop(tok)
        if p.max_new_tokens is not None and n_out >= p.max_new_tokens:
            return FinishReason.length()
        if context_length is not None and self.num_tokens >= context_length:
            return FinishReason.length()
        return None
