"""A small fake Engine with nbgen's public contract, for widget / dataframe logic tests.

Text is deterministic: the prompt's words reversed, one "token" per word, capped at
max_new_tokens. ``delay`` seconds pass per token so streaming and aborts can be observed.
A prompt containing "FAIL" finishes with an abort, like a request that failed in the engine;
one containing "REJECT" is refused at validation (the whole call raises, as the real engine does).
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Iterator, Optional

from nbgen.core.sampling import SamplingParams


class FakeEngine:
    has_chat_template = True  # apply_chat_template below renders messages as "<role> content"

    def __init__(self, delay: float = 0.0, complete_in_reverse: bool = True) -> None:
        self.delay = delay
        self.reverse = complete_in_reverse
        self._shut = False
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self.calls: list[list[str]] = []  # prompts of each generate_iter / generate call
        self.running = 0
        self.total_out = 0
        self.total_in = 0
        self.finished = 0

    # ---- helpers ----
    def _check(self) -> None:
        if self._shut:
            raise RuntimeError("engine is shut down")

    def _validate(self, prompts: list[str], params: list[Any]) -> list[SamplingParams]:
        sps = [SamplingParams.from_dict(p) for p in params]
        for p in prompts:
            if not isinstance(p, str):
                raise TypeError(f"prompt must be a str, got {type(p).__name__}")
            if "REJECT" in p:
                raise ValueError("prompt has 99999 tokens, over the context length 2048")
        return sps

    def _output(self, prompt: str, sp: SamplingParams, rid: str, j: int = 0) -> dict[str, Any]:
        words = prompt.split()[::-1] + [f"s{j}"] * j
        limit = sp.max_new_tokens if sp.max_new_tokens is not None else 128
        toks = words[:limit]
        fr: dict[str, Any] = {"type": "length" if len(words) > limit else "stop"}
        if "FAIL" in prompt:
            fr = {"type": "abort", "message": "simulated engine failure"}
        with self._lock:
            self.total_in += len(prompt.split())
            self.total_out += len(toks)
            self.finished += 1
        return {"text": " ".join(toks), "output_ids": list(range(len(toks))),
                "meta_info": {"id": rid, "prompt_tokens": len(prompt.split()),
                              "completion_tokens": len(toks), "cached_tokens": 0,
                              "finish_reason": fr, "e2e_latency": 0.01}}

    def _norm(self, prompt: Any, sampling_params: Any) -> tuple[list[str], list[Any], bool]:
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params has the wrong length")
        return prompts, params, single

    # ---- public API ----
    def generate(self, prompt: Any = None, sampling_params: Any = None, stream: bool = False,
                 rid: Optional[str] = None, **kw: Any) -> Any:
        self._check()
        prompts, params, single = self._norm(prompt, sampling_params)
        sps = self._validate(prompts, params)
        if stream:
            return self._stream(prompts[0], sps[0], rid or uuid.uuid4().hex)
        self.calls.append(prompts)
        outs = [self._output(p, sp, uuid.uuid4().hex) for p, sp in zip(prompts, sps)]
        return outs[0] if single else outs

    def _stream(self, prompt: str, sp: SamplingParams, rid: str) -> Iterator[dict[str, Any]]:
        full = self._output(prompt, sp, rid)
        words = full["text"].split(" ") if full["text"] else []
        with self._lock:
            self.running += 1
        try:
            for k, w in enumerate(words):
                time.sleep(self.delay)
                if rid in self._aborted:
                    out = dict(full, text="")
                    out["meta_info"] = dict(full["meta_info"], completion_tokens=k,
                                            finish_reason={"type": "abort", "message": "aborted by the caller"})
                    yield out
                    return
                piece = w if k == 0 else " " + w
                if k == len(words) - 1:
                    yield dict(full, text=piece)
                else:
                    yield {"text": piece, "output_ids": [k], "meta_info": {"id": rid}}
            if not words:
                yield full
        finally:
            with self._lock:
                self.running -= 1

    def generate_iter(self, prompt: Any = None, sampling_params: Any = None, **kw: Any) -> Iterator[tuple[int, dict]]:
        self._check()
        prompts, params, _ = self._norm(prompt, sampling_params)
        sps = self._validate(prompts, params)
        self.calls.append(prompts)
        flat = [(p, sp, j) for p, sp in zip(prompts, sps) for j in range(sp.n)]
        order = range(len(flat) - 1, -1, -1) if self.reverse else range(len(flat))
        for i in order:
            time.sleep(self.delay)
            p, sp, j = flat[i]
            yield i, self._output(p, sp, uuid.uuid4().hex, j)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + (" <assistant>" if add_generation_prompt else "")

    def abort(self, rid: Any) -> None:
        self._check()
        self._aborted.update([rid] if isinstance(rid, str) else list(rid))

    def stats(self) -> dict[str, Any]:
        self._check()
        with self._lock:
            return {"running": self.running, "waiting": 0, "kv_pages_used": 3 * self.running,
                    "kv_pages_total": 100, "prefix_cache_pages": 2, "page_size": 16,
                    "input_tok_s": 10.0 * self.running, "output_tok_s": 5.0 * self.running,
                    "total_input_tokens": self.total_in, "total_output_tokens": self.total_out,
                    "total_cached_tokens": 0, "total_finished": self.finished,
                    "uptime_s": 1.0, "time": time.time()}

    def shutdown(self) -> None:
        self._shut = True


class FakeDisplay:
    """IPython's ``display`` for tests: keeps each display id's current mime bundle, as a saved
    notebook keeps an output after ``update_display_data`` replaced it."""

    def __init__(self) -> None:
        self.outputs: dict[str, dict[str, Any]] = {}  # display id -> current mime bundle
        self.objects: list[Any] = []                  # what was displayed first, per display id
        self.history: list[tuple[str, dict[str, Any]]] = []  # (display id, bundle) of every call

    def __call__(self, obj: Any, raw: bool = False, display_id: Any = None, update: bool = False) -> "FakeHandle":
        did = uuid.uuid4().hex if display_id is True or display_id is None else display_id
        if update and did not in self.outputs:
            raise KeyError(f"update of unknown display id {did}")
        if not update:
            self.objects.append(obj)
        self.outputs[did] = dict(obj) if raw else _mimebundle(obj)
        self.history.append((did, self.outputs[did]))
        return FakeHandle(self, did)


class FakeHandle:
    """IPython's DisplayHandle on a FakeDisplay."""

    def __init__(self, display: FakeDisplay, display_id: str) -> None:
        self.display, self.display_id = display, display_id

    def update(self, obj: Any, raw: bool = False) -> None:
        self.display(obj, raw=raw, display_id=self.display_id, update=True)


def _mimebundle(obj: Any) -> dict[str, Any]:
    if hasattr(obj, "_repr_mimebundle_"):
        b = obj._repr_mimebundle_()
        return dict(b[0] if isinstance(b, tuple) else b)
    if hasattr(obj, "_repr_html_"):
        return {"text/html": obj._repr_html_(), "text/plain": repr(obj)}
    return {"text/plain": repr(obj)}
