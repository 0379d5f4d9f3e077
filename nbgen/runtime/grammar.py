"""Structured output with xgrammar: grammar checks, off-thread compilation, per-request matchers.

- ``check_grammar`` (caller thread): parses a request's json_schema / regex / ebnf / structural_tag
  with xgrammar (no tokenizer needed, cached): a bad one raises ValueError before it is submitted.
- ``GrammarService`` (loop thread): compiles grammars against the model's tokenizer in a worker
  thread (xgrammar's GrammarCompiler caches per grammar), holds a request until its grammar is
  ready (the loop decodes others meanwhile), then hands it to the scheduler with a ``GrammarState``.
- ``GrammarState`` (loop thread): one request's matcher; fills its token-bitmask row before sampling,
  accepts each sampled token (a step's rows together: runtime/grammar_batch.py), ends the request when
  the grammar terminates, and (``enable_jump_forward``) appends the forced text (runtime/jump_forward.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
from collections import OrderedDict
import json
import logging
from typing import Any, Callable, Optional

from nbgen.core.errors import ArgumentTypeError
from nbgen.core.finish import FinishReason
from nbgen.core.request import Status
from nbgen.core.sampling import GRAMMAR_KINDS, SamplingParams
from nbgen.runtime.grammar_rewrite import fast_json_grammar
from nbgen.runtime.jump_forward import JumpForward

logger = logging.getLogger("nbgen")

MAX_READY = 256       # compiled grammars kept on the loop side (xgrammar's compiler caches too)
ANY_JSON = "$$ANY$$"   # json_schema value meaning "any JSON value" (as SGLang)
Key = tuple[str, str]  # (kind, grammar text), kind in GRAMMAR_KINDS


def grammar_key(p: SamplingParams) -> Optional[Key]:
    """(kind, text) of a request's grammar, or None for a free request."""
    for kind in GRAMMAR_KINDS:
        v = getattr(p, kind)
        if v is not None:
            return kind, v
    return None


def structural_tag(text: str) -> Any:
    """xgrammar's StructuralTag of a ``structural_tag`` JSON text, in SGLang's two formats: the
    legacy ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` (a structure's
    missing schema is any JSON, as SGLang) or xgrammar's ``{"format": {...}}``."""
    import xgrammar as xgr

    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise ValueError("a JSON object is needed")
    if obj.get("structures") is None:
        if obj.get("format") is None:
            raise ValueError('it needs "structures" and "triggers" (or an xgrammar "format")')
        return xgr.StructuralTag.model_validate(obj)
    structures, triggers = obj["structures"], obj.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not triggers:
        raise ValueError('"structures" and "triggers" must be lists, with at least one trigger')
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError(f'structures[{i}] needs "begin" and "end" strings')
        schema = s.get("schema")
        tags.append(xgr.StructuralTagItem(begin=s["begin"], end=s["end"],
                                          schema=json.dumps({} if schema is None else schema)))
    tag = xgr.StructuralTag.from_legacy_structural_tag(tags, triggers)
    tag.format.at_least_one = bool(obj.get("at_least_one", False))
    return tag


@functools.lru_cache(maxsize=512)
def _parse(kind: str, text: str) -> None:
    import xgrammar as xgr

    if kind == "json_schema":
        if text != ANY_JSON:
            xgr.Grammar.from_json_schema(text)
    elif kind == "regex":
        xgr.Grammar.from_regex(text)
    elif kind == "ebnf":
        xgr.Grammar.from_ebnf(text)
    else:
        xgr.Grammar.from_structural_tag(structural_tag(text))


def check_grammar(p: SamplingParams) -> None:
    """Raise ValueError when the request's json_schema / regex / ebnf / structural_tag is invalid
    (caller thread)."""
    for kind in ("json_schema", "structural_tag"):   # a convenience: a dict instead of its JSON text
        if isinstance(getattr(p, kind), dict):
            setattr(p, kind, json.dumps(getattr(p, kind)))
    key = grammar_key(p)
    if key is None:
        return
    kind, text = key
    if not isinstance(text, str) or not text:
        raise ArgumentTypeError(f"{kind} must be a non-empty string, got {text!r:.80}")
    if kind in ("json_schema", "structural_tag") and text != ANY_JSON:
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{kind} is not valid JSON: {e}") from None
    try:
        _parse(kind, text)
    except ImportError as e:
        raise ImportError("structured output needs xgrammar: pip install xgrammar") from e
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the parser's message
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
        msg = lines[-1] if lines else type(e).__name__
        raise ValueError(f"invalid {kind}: {msg}") from None


class GrammarState:
    """One request's xgrammar matcher (loop thread only)."""

    def __init__(self, compiled: Any, stop_ids: frozenset[int], vocab: int,
                 jumper: Optional[JumpForward] = None) -> None:
        import xgrammar as xgr

        self.jumper = jumper  # jump-forward decoding (None: off)

        self.vocab = vocab   # the tokenizer's ids [0, vocab) are in the bitmask; logits beyond are masked
        # the request's stop ids (model EOS + stop_token_ids) end the grammar; with ignore_eos (no stop
        # ids) the tokenizer's EOS still does (a grammar needs some way to end). Ids past
        # the tokenizer (a model EOS the tokenizer lacks) can never be sampled under a mask: dropped.
        stops = sorted(t for t in stop_ids if 0 <= t < vocab) or list(compiled.tokenizer_info.stop_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        # the matcher terminates exactly when it accepts one of these: tracked here, so a step needs
        # only the accept from xgrammar (not is_terminated as well)
        self.stops = frozenset(stops)
        self.done = False
        self.plain: Optional[bool] = None   # ``plain_greedy``'s answer, set on the first step
        # jump-forward: (the most output tokens the request may hold, its prompt length), set on first use
        self.jump_limits: Optional[tuple[int, int]] = None
        # the matcher's FFI object: a step's tokens are accepted by one batched call over these
        # (runtime/grammar_batch.py); its accept_token, called as (token, debug_print), skips
        # xgrammar's Python wrapper for single tokens (matcher.accept_token if it moves)
        self.handle = getattr(self.matcher, "_handle", None)
        self._accept = getattr(self.handle, "accept_token", None) or (lambda t, _d: self.matcher.accept_token(t))
        # the text the grammar forces next (jump-forward asks after each accepted token): the FFI
        # object's method, as the matcher's wrapper adds a call per row and step
        self.search: Callable[[], str] = (getattr(self.handle, "find_jump_forward_string", None)
                                          or self.matcher.find_jump_forward_string)

    def plain_greedy(self, req: Any) -> bool:
        """req (this state's request) samples the argmax of its masked logits: greedy, no bias, penalties,
        min_new_tokens, logprobs or custom processor (computed once; runtime/grammar_batch.live_rows)."""
        if self.plain is None:
            p = req.params
            self.plain = bool(p.plain_greedy and not p.min_new_tokens and not req.logprobs.return_logprob
                              and req.logit_processor is None)
        return self.plain

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 [B, ceil(vocab/32)] bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def on_token(self, tok: int, reason: Optional[FinishReason]) -> Optional[FinishReason]:
        """Accept a sampled token; returns the request's finish reason after it (or None)."""
        if self.done:
            return reason
        return self.settle(tok, self._accept(tok, False), reason)

    def accept(self, tok: int) -> bool:
        """The matcher accepts tok (False: refused, the matcher unchanged)."""
        return bool(self._accept(tok, False))

    def settle(self, tok: int, accepted: bool, reason: Optional[FinishReason]) -> Optional[FinishReason]:
        """The request's finish reason after the matcher took (``accepted``) or refused ``tok``."""
        if not accepted:
            return FinishReason.abort(f"sampled token {tok} is not allowed by the grammar")
        if tok in self.stops:
            # the grammar accepted a stop token: it is complete; a length cut in the same step loses
            self.done = True
            return reason if reason is not None and reason.is_stop else FinishReason.stop(tok)
        return reason

    def force(self, ids: list[int], replaced: Optional[int] = None) -> bool:
        """Accept ``ids`` after rolling back the last accepted token ``replaced`` (if given); all
        or nothing: on a refusal the matcher is put back as it was."""
        m = self.matcher
        if replaced is not None:
            m.rollback(1)
        for k, t in enumerate(ids):
            if t in self.stops or not self._accept(t, False):   # a refused token changes nothing
                if k:
                    m.rollback(k)
                if replaced is not None:
                    self._accept(replaced, False)
                return False
        return True


class GrammarService:
    """Compiles grammars in a worker thread and holds requests until theirs is ready (loop thread)."""

    def __init__(self, tokenizer: Any, vocab_size: int, post: Callable[..., None],
                 admit: Callable[[Any], None], finished: Callable[[], None], threads: int = 2,
                 jump_forward: bool = False) -> None:
        self._tokenizer = tokenizer
        # one for all requests (its counters are the engine's); None: jump-forward off
        self.jumper = JumpForward(tokenizer) if jump_forward and tokenizer is not None else None
        # The grammar covers the tokenizer's ids only. The logits may be wider (config.vocab_size
        # pads the embedding): those columns are set to -inf next to the bitmask. Giving xgrammar
        # the padded size instead costs ~25x more per bitmask fill (~140 us a row for 100k pads).
        self._vocab = len(tokenizer) if tokenizer is not None else vocab_size
        self._post = post                      # post(fn, *args): run fn on the loop thread (thread-safe)
        self._admit = admit                    # hand a ready request to the scheduler
        self._finished = finished              # deliver requests finished here (the loop's reap)
        self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nbgen-grammar")
        self._compiler: Optional[Any] = None   # built lazily in a worker (TokenizerInfo takes ~0.1-1 s)
        self._ready: OrderedDict[Key, Any] = OrderedDict()  # compiled grammars, least recently used first
        self._futures: dict[Key, cf.Future] = {}
        self.held: dict[str, Any] = {}         # rid -> Request waiting for its grammar

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def _compile(self, key: Key) -> Any:  # worker thread
        kind, text = key
        comp = self._get_compiler()
        if kind == "json_schema":
            if text == ANY_JSON:
                return comp.compile_builtin_json_grammar()
            # compact separators: free whitespace lets small models pad with blanks until max_new_tokens;
            # maxLength strings rewritten so their bitmask fills stay cheap (runtime/grammar_rewrite.py)
            fast = fast_json_grammar(text, any_whitespace=False)
            return comp.compile_json_schema(text, any_whitespace=False) if fast is None else comp.compile_grammar(fast)
        if kind == "regex":
            return comp.compile_regex(text)
        if kind == "structural_tag":
            return comp.compile_structural_tag(structural_tag(text))
        return comp.compile_grammar(text)

    def prepare(self, req: Any) -> None:
        """Give req its GrammarState and admit it now, or once its grammar compiled off-thread."""
        if self._tokenizer is None:
            self._fail(req, "structured output needs a tokenizer (the engine has skip_tokenizer_init=True)")
            return
        key = grammar_key(req.params)
        if key in self._ready:
            self._ready.move_to_end(key)
            self._start(req, self._ready[key])
            return
        self.held[req.rid] = req
        if key not in self._futures:
            fut = self._futures[key] = self._pool.submit(self._compile, key)
            fut.add_done_callback(lambda f, k=key: self._post_safely(self._done, k, f))

    def _fail(self, req: Any, message: str) -> None:
        req.finish_reason, req.status = FinishReason.abort(message), Status.FINISHED
        self._finished()

    def _post_safely(self, *args: Any) -> None:
        try:
            self._post(*args)
        except RuntimeError:  # engine shut down meanwhile
            pass

    def _done(self, key: Key, fut: cf.Future) -> None:  # loop thread
        self._futures.pop(key, None)
        err = fut.exception()
        if err is None:
            self._ready[key] = fut.result()
            while len(self._ready) > MAX_READY:
                self._ready.popitem(last=False)
        waiting = [r for r in self.held.values() if grammar_key(r.params) == key]
        for req in waiting:
            del self.held[req.rid]
            if err is not None:
                self._fail(req, f"grammar compilation failed: {err}")
            else:
                self._start(req, fut.result())

    def _start(self, req: Any, compiled: Any) -> None:
        """Give req its matcher and admit it; a matcher that cannot be built fails req (never lost)."""
        try:
            req.grammar = GrammarState(compiled, req.stop_ids, self._vocab, self.jumper)
        except Exception as e:  # noqa: BLE001 - e.g. xgrammar refusing a stop id
            self._fail(req, f"grammar matcher failed: {type(e).__name__}: {e}")
            return
        self._admit(req)

    def abort(self, rid: str, message: str) -> None:
        """Abort a request still waiting for its grammar (unknown rids are ignored)."""
        req = self.held.pop(rid, None)
        if req is not None:
            self._fail(req, message)

    def shutdown(self, message: str) -> None:
        """Abort every held request and stop the workers (at engine shutdown)."""
        for rid in list(self.held):
            self.abort(rid, message)
        self._pool.shutdown(wait=False, cancel_futures=True)
