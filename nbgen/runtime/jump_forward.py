"""Jump-forward decoding: where a grammar allows exactly one continuation, append it at once.

SGLang's compressed-FSM idea over xgrammar's ``GrammarMatcher.find_jump_forward_string``: after a
constrained request accepted a sampled token, the text the grammar forces next (a JSON key with
its quotes and colon, the punctuation after a value, the rest of an enum member) is tokenized and
appended to the request's output in one go. The scheduler then sees a running request with several
tokens without KV and computes them in the next step, as one-token rows of the decode step
(runtime/forced_rows.py) or else as one chunk, whose last position samples the next free token: one
forward instead of one per forced token.

Retokenization at the boundary: the token just sampled (not delivered to the caller yet) is
encoded again together with the forced text, so a token that merges across the boundary (``{`` +
``"name`` -> ``{"`` + ``name``) is replaced; the matcher rolls it back and its KV had not been
computed yet. Tokens delivered earlier are never changed. A step scheduled before the jump (overlap
scheduling queues one ahead) no longer matches the request's length and is ignored by the
scheduler's update; its KV writes are repeated by the next step.

Where outputs can differ from token-by-token decoding: the forced text gets the tokenizer's
canonical tokenization; a model decoding token by token may split the same text differently (``":``
+ `` "`` against ``": "``), and later tokens then see another context. Where the model would pick the
canonical tokens (forced runs that tokenize one way only, e.g. digits), greedy outputs are equal.

Not jumped (token by token as before): requests returning logprobs or hidden states (one entry per
sampled token), forced text that does not survive an encode / decode round trip (tokenizers that
add a prefix space), forced tokens that are stop ids, and whatever would pass max_new_tokens or the
context (the jump is cut, leaving room for one sampled token).
"""
from __future__ import annotations

from typing import Any, Optional

MIN_JUMP = 2  # fewer new tokens than this: decode them (a one-token jump saves one row of one step)
MAX_PLANS = 4096  # (last token, forced text) -> tokenization kept: a batch's requests share keys and punctuation
REPLACEMENT = "\ufffd"


class JumpForward:
    """Forced-text tokenization and the request update of a jump (loop thread only)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.num_jumps = 0          # jumps made
        self.num_tokens = 0         # tokens appended by them (net of replaced ones)
        self.num_searches = 0       # grammar searches for forced text (find_jump_forward_string)
        self._plans: dict[tuple[int, str], Optional[tuple[bool, list[int]]]] = {}   # tail's results

    def _encode(self, text: str) -> Optional[list[int]]:
        """Token ids of text, or None when they do not decode back to exactly text."""
        tok = self.tokenizer
        ids = tok.encode(text, add_special_tokens=False)
        if not ids or tok.decode(ids, clean_up_tokenization_spaces=False) != text:
            return None
        return list(ids)

    def tail(self, last: int, forced: str) -> Optional[tuple[bool, list[int]]]:
        """-> (replace the last token?, the ids that follow the kept output), or None (no jump).

        ``last`` is the token just sampled; it is encoded again with the forced text when it
        decodes to whole characters. Results are cached (the tokenizer calls cost ~30-100 us)."""
        key = (last, forced)
        if key not in self._plans:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[key] = self._plan(last, forced)
        plan = self._plans[key]
        return None if plan is None else (plan[0], list(plan[1]))

    def _plan(self, last: int, forced: str) -> Optional[tuple[bool, list[int]]]:
        text = self.tokenizer.decode([last], clean_up_tokenization_spaces=False)
        if text and REPLACEMENT not in text:
            ids = self._encode(text + forced)
            if ids is not None:
                if ids[0] == last:
                    return False, ids[1:]
                return True, ids
        ids = self._encode(forced)
        return None if ids is None else (False, ids)

    def jump(self, req: Any, state: Any, context_length: Optional[int]) -> bool:
        """Append the forced continuation of req (its grammar ``state`` just accepted the last
        output token); True when the request's output changed."""
        # runs for every constrained row of every step: the checks before the search stay few
        out = req.output_ids
        n_out, n_prompt = len(out), len(req.prompt_ids)
        if not n_out or req.num_computed != n_prompt + n_out - 1 or out[-1] < 0:
            return False                          # the last token is not the one just accepted
        if req.logprobs.return_logprob or req.return_hidden_states:
            return False
        # room: at least one sampled token must follow (max_new_tokens / the context end it); a jump
        # adds at most room tokens, so without room for MIN_JUMP the grammar is not even asked
        limit = req.params.max_new_tokens
        room = (limit if limit is not None else 1 << 62) - n_out - 1
        if context_length is not None:
            room = min(room, context_length - n_prompt - n_out - 1)
        if room < MIN_JUMP:
            return False
        self.num_searches += 1
        forced = state.search()                   # the matcher's find_jump_forward_string
        if not forced:
            return False
        planned = self.tail(out[-1], forced)
        if planned is None:
            return False
        replace, ids = planned
        keep = len(out) - (1 if replace else 0)
        ids = ids[: max(0, room + (1 if replace else 0))]
        for k, t in enumerate(ids):
            if t in req.stop_ids or not 0 <= t < state.vocab:
                ids = ids[:k]
                break
        if len(ids) - (1 if replace else 0) < MIN_JUMP:
            return False
        if not state.force(ids, out[-1] if replace else None):
            return False
        del out[keep:]
        out.extend(ids)
        self.num_jumps += 1
        self.num_tokens += len(ids) - (1 if replace else 0)
        return True
