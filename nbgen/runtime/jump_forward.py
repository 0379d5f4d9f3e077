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
scheduler's update, and the overlap stepper leaves the request out of that step's bitmask fill and
accepts (``jump_rows`` gives the states that jumped); its row there computes the K/V of the token just
sampled, so a jump that keeps that token counts it computed and the next step's forced rows start
after it (where the token is replaced, that K/V is of the old token and is written again).

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

from nbgen.runtime.grammar_batch import force_rows
from nbgen.runtime.grammar_search import JumpSearch

MIN_JUMP = 2  # fewer new tokens than this: decode them (a one-token jump saves one row of one step)
MAX_PLANS = 4096  # (last token, forced text) -> tokenization kept: a batch's requests share keys and punctuation
REPLACEMENT = "\ufffd"
BIG = 1 << 62
_UNSEEN = object()   # a (last token, forced text) not planned yet (a plan may be None)


class JumpForward:
    """Forced-text tokenization and the request update of a jump (loop thread only)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.num_jumps = 0          # jumps made
        self.num_tokens = 0         # tokens appended by them (net of replaced ones)
        self.num_searches = 0       # grammar searches for forced text (find_jump_forward_string)
        self._search = JumpSearch()
        self._plans: dict[tuple[int, str], Optional[tuple[bool, tuple[int, ...]]]] = {}   # tail's results

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
        plan = self._plan_of(last, forced)
        return None if plan is None else (plan[0], list(plan[1]))

    def _plan_of(self, last: int, forced: str) -> Optional[tuple[bool, tuple[int, ...]]]:
        key = (last, forced)
        plan = self._plans.get(key, _UNSEEN)
        if plan is _UNSEEN:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = self._plan(last, forced)
        return plan

    def _plan(self, last: int, forced: str) -> Optional[tuple[bool, tuple[int, ...]]]:
        text = self.tokenizer.decode([last], clean_up_tokenization_spaces=False)
        if text and REPLACEMENT not in text:
            ids = self._encode(text + forced)
            if ids is not None:
                if ids[0] == last:
                    return False, tuple(ids[1:])
                return True, tuple(ids)
        ids = self._encode(forced)
        return None if ids is None else (False, tuple(ids))

    def jump(self, req: Any, state: Any, context_length: Optional[int]) -> bool:
        """Append the forced continuation of req (its grammar ``state`` just accepted the last
        output token); True when the request's output changed."""
        return bool(self.jump_rows([req], [state], context_length))

    def jump_rows(self, reqs: list[Any], states: list[Any], context_length: Optional[int],
                  queued: frozenset[int] = frozenset()) -> list[Any]:
        """``jump`` for a step's rows that go on (``states[k]``: ``reqs[k]``'s grammar, which just
        accepted the request's last output token); -> the states of the rows that jumped. The rows'
        matchers take their forced tokens in one call into xgrammar (``force_rows``). ``queued``: ids of
        requests whose last token's K/V a forward already queued computes (at its position, from it):
        a jump that keeps that token counts it computed, so its forced rows start after it."""
        # every row is searched in one call (grammar_search.py: a search is a read, so rows that cannot
        # jump are asked too); the per-row checks run only for the third or so with forced text
        todo: list[tuple[Any, Any, int, str]] = []      # (req, state, room, forced text) where text is forced
        self.num_searches += len(states)
        for k, forced in self._search.texts(states):
            req, state = reqs[k], states[k]
            limits = state.jump_limits
            if limits is None:
                limits = state.jump_limits = _limits(req, context_length)
            cap, n_prompt = limits
            out = req.output_ids
            n_out = len(out)
            # room: at least one sampled token must follow (max_new_tokens / the context end it); a jump
            # adds at most room tokens
            room = cap - n_out - 1
            if room < MIN_JUMP or req.num_computed != n_prompt + n_out - 1 or out[-1] < 0:
                continue                          # or the last token is not the one just accepted
            todo.append((req, state, room, forced))
        rows: list[tuple[Any, Any, bool, tuple[int, ...]]] = []     # (req, state, replace, ids)
        for req, state, room, forced in todo:
            out = req.output_ids
            plan = self._plan_of(out[-1], forced)
            if plan is None:
                continue
            replace, ids = plan
            if len(ids) > room + replace:
                ids = ids[: room + replace]
            if not req.stop_ids.isdisjoint(ids):  # cut before the first stop id
                ids = ids[: min(k for k, t in enumerate(ids) if t in req.stop_ids)]
            if len(ids) - replace < MIN_JUMP or not state.stops.isdisjoint(ids) or max(ids) >= state.vocab:
                continue
            rows.append((req, state, replace, ids))
        if not rows:
            return []
        took = force_rows([r[1] for r in rows], [r[3] for r in rows],
                          [r[0].output_ids[-1] if r[2] else None for r in rows])
        jumped: list[Any] = []
        for (req, state, replace, ids), ok in zip(rows, took):
            if not ok:
                continue
            out = req.output_ids
            if replace:
                out.pop()
            elif queued and id(req) in queued:
                req.num_computed += 1             # the queued forward writes its K/V (its own row is stale)
            out.extend(ids)
            jumped.append(state)
            self.num_tokens += len(ids) - replace
        self.num_jumps += len(jumped)
        return jumped


def _limits(req: Any, context_length: Optional[int]) -> tuple[int, int]:
    """(the most output tokens req may hold, its prompt length) for the jump's room; a request that
    never jumps (logprobs or hidden states: one entry per sampled token) gets no room."""
    n_prompt = len(req.prompt_ids)
    if req.logprobs.return_logprob or req.return_hidden_states:
        return -1, n_prompt
    limit = req.params.max_new_tokens
    cap = BIG if limit is None else limit
    if context_length is not None:
        cap = min(cap, context_length - n_prompt)
    return cap, n_prompt
